"""The real default model (SmolLM2-135M-Instruct) against Hugging Face transformers on the same weights.

Tolerances, fp32 on CPU: prompt logprobs within 1e-3 (measured: ~1e-5), identical token ids, ranks and
top-K ids; greedy completions identical to `generate()`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from apcscore import EngineConfig, Request, SamplingParams
from apcscore.engine import Engine
from apcscore.engine.loader import load_native_engine

TEXTS = [
    "The capital of France is Paris. The capital of Germany is Berlin.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Once upon a time, in a small village by the sea, there lived an old fisherman.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return load_native_engine("smollm2-135m", EngineConfig(device="cpu", dtype="float32", max_batch_tokens=512))


@pytest.mark.slow
def test_prompt_logprobs_ranks_and_topk_match_transformers(engine, hf_default_model, default_tokenizer):
    ids = [default_tokenizer(t).input_ids for t in TEXTS]
    outs = {o.request_id: o for o in engine.run(Request(i, p, prompt_logprobs=5) for i, p in enumerate(ids))}
    for i, p in enumerate(ids):
        with torch.no_grad():
            ref = torch.log_softmax(hf_default_model(torch.tensor([p])).logits[0].float(), -1)[:-1]
        target = torch.tensor(p[1:])
        ref_lp = ref.gather(1, target[:, None])[:, 0]
        lps = outs[i].prompt_logprobs
        assert outs[i].prompt_token_ids == p
        assert lps.token_ids.tolist() == p[1:]
        assert np.abs(lps.token_logprobs - ref_lp.numpy()).max() < 1e-3
        assert lps.ranks.tolist() == ((ref > ref_lp[:, None]).sum(-1) + 1).tolist()
        top = ref.topk(5, -1)
        assert lps.top_ids.tolist() == top.indices.tolist()
        assert np.abs(lps.top_logprobs - top.values.numpy()).max() < 1e-3


@pytest.mark.slow
def test_greedy_generation_equals_generate(engine, hf_default_model, default_tokenizer):
    chats = [[{"role": "user", "content": q}] for q in ("What is the capital of France?", "Name three colors.")]
    prompts = [default_tokenizer(default_tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False),
                                 add_special_tokens=False).input_ids for c in chats]
    prompts.append(default_tokenizer(TEXTS[2]).input_ids)
    outs = {o.request_id: o for o in engine.run(
        Request(i, p, sampling=SamplingParams(max_tokens=24)) for i, p in enumerate(prompts))}
    for i, p in enumerate(prompts):
        ref = hf_default_model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                        max_new_tokens=24, do_sample=False, eos_token_id=2, pad_token_id=2)
        ref = ref[0, len(p):].tolist()
        if 2 in ref:  # generate() pads after EOS; we stop at it (and keep it)
            ref = ref[:ref.index(2) + 1]
        assert outs[i].output_token_ids == ref
        assert outs[i].finish_reason == ("stop" if ref[-1] == 2 else "length")
