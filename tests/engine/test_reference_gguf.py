"""`--reference-model` across sources: a tiny model's Hugging Face folder as the reference and GGUF files of it at
three quantization types as candidates (tests/gguf_files.py quantizes with gguf-py). The exact mean KL ranks them as
their weights' error does: Q8_0 < Q5_1 < Q4_0."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from apcscore.config import EngineConfig
from apcscore.engine.loader import load_engine
from apcscore.engine.step import Request
from apcscore.models.loading import load_state_dict
from conftest import build_tiny_model
from gguf_files import small_bpe_tokenizer, write_gguf

QUANTS = ["Q8_0", "Q5_1", "Q4_0"]
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France, and Berlin"]


def test_exact_kl_ranks_quantizations_as_their_weight_error(default_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("APCSCORE_CACHE", str(tmp_path / "cache"))  # the GGUF conversions stay in the test's folder
    # a 1024-token vocabulary (the default tokenizer's first tokens): transformers reads such a GGUF quickly
    ref = build_tiny_model("llama", tmp_path / "hf", small_bpe_tokenizer(default_tokenizer, 1024))
    original = {k: v for k, v in load_state_dict(ref).items() if v.ndim == 2}
    norm = sum(float((v.double() ** 2).sum()) for v in original.values())
    mean_kl, weight_error = {}, {}
    for quant in QUANTS:
        gguf_file = write_gguf(ref, tmp_path / f"tiny-{quant}.gguf", quant=quant)
        engine = load_engine(str(gguf_file), EngineConfig(num_kv_blocks=256), reference=str(ref))
        dequantized = load_state_dict(Path(engine.info.path))  # the GGUF's weights as the engine read them
        weight_error[quant] = sum(float(((dequantized[k].double() - v.double()) ** 2).sum())
                                  for k, v in original.items()) / norm
        requests = [Request(i, engine.tokenizer.encode(p), prompt_logprobs=0) for i, p in enumerate(PROMPTS)]
        kl = np.concatenate([out.prompt_logprobs.divergence.kl for out in engine.run(requests)])
        mean_kl[quant] = float(kl.mean())
    assert sorted(QUANTS, key=weight_error.get) == QUANTS and weight_error["Q8_0"] > 0, weight_error
    assert sorted(QUANTS, key=mean_kl.get) == QUANTS and mean_kl["Q8_0"] > 0, mean_kl
