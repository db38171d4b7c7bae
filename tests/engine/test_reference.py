"""`score --reference-model`: the exact divergence of a model from a reference in one run (engine/reference.py,
kernels/divergence_torch.py): equal to a float64 computation from both models' full logits, the reference's
token logprobs bitwise those of the reference alone, every column bitwise the same whatever the batch, budget,
chunk size or order, and a reference whose tokens mean something else refused."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from apcscore.config import EngineConfig
from apcscore.engine import paired_rows as reference_module
from apcscore.engine.loader import load_engine
from apcscore.engine.step import Request
from apcscore.errors import ApcscoreError
from apcscore.kernels.divergence_torch import row_divergence, tree_sum

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of", "1, 2, 3, 4, 5, 6, 7",
           "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole."]


def noisy_copy(src, dst, scale: float, seed: int = 1):
    """A copy of the model folder `src` with Gaussian noise of `scale` x each tensor's std added to its 2-D
    weights: a stand-in for a quantized or fine-tuned candidate."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    for name, w in state.items():
        if w.ndim == 2:
            state[name] = w + scale * w.std() * torch.randn(w.shape, generator=gen)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def pair(tiny_model_dir, tmp_path_factory):
    ref = tiny_model_dir("llama")
    return ref, noisy_copy(ref, tmp_path_factory.mktemp("cand") / "cand", 0.05)


def _requests(tokenizer, order=None):
    ids = [tokenizer.encode(p) for p in PROMPTS]
    order = order or range(len(ids))
    return [Request(i, ids[i], prompt_logprobs=0) for i in order]


def _score(engine, requests):
    return {out.request_id: out.prompt_logprobs for out in engine.run(requests)}


def test_exact_against_float64_of_both_logits(pair, monkeypatch):
    ref, cand = pair
    seen = []
    kernel = reference_module.row_divergence

    def spy(logits, ref_logits, targets):
        seen.append((logits.clone(), ref_logits.clone(), targets.clone()))
        return kernel(logits, ref_logits, targets)

    monkeypatch.setattr(reference_module, "row_divergence", spy)
    engine = load_engine(str(cand), EngineConfig(dtype="float32"), reference=str(ref))
    out = _score(engine, _requests(engine.tokenizer))
    logits, ref_logits, targets = (torch.cat([s[i] for s in seen]) for i in range(3))
    lp = torch.log_softmax(logits.double(), -1)
    ref_lp = torch.log_softmax(ref_logits.double(), -1)
    want_kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1)
    got = torch.from_numpy(np.concatenate([out[i].divergence.kl for i in range(len(PROMPTS))]))
    assert got.dtype == torch.float64 and (want_kl > 1e-4).all()
    assert torch.allclose(got, want_kl, rtol=1e-6, atol=0)
    at = targets[:, None]
    want_dp = (lp.gather(1, at).exp() - ref_lp.gather(1, at).exp())[:, 0]
    got_dp = torch.from_numpy(np.concatenate([out[i].divergence.delta_p for i in range(len(PROMPTS))]))
    assert torch.allclose(got_dp, want_dp, rtol=1e-6, atol=1e-12)
    agree = np.concatenate([out[i].divergence.top1_agree for i in range(len(PROMPTS))])
    assert (agree == (logits.argmax(-1) == ref_logits.argmax(-1)).numpy()).all()


def test_columns_match_each_model_alone(pair):
    """The model's own columns are unchanged, and the reference's token logprobs are those of the reference alone."""
    ref, cand = pair
    cfg = EngineConfig(num_kv_blocks=256)
    paired = load_engine(str(cand), cfg, reference=str(ref))
    both = _score(paired, _requests(paired.tokenizer))
    alone = _score(load_engine(str(cand), cfg), _requests(paired.tokenizer))
    ref_alone = _score(load_engine(str(ref), cfg), _requests(paired.tokenizer))
    for i in range(len(PROMPTS)):
        assert np.array_equal(both[i].token_logprobs, alone[i].token_logprobs)
        assert np.array_equal(both[i].ranks, alone[i].ranks)
        assert np.array_equal(both[i].divergence.ref_logprobs, ref_alone[i].token_logprobs)


def test_bitwise_whatever_the_batch(pair):
    """One at a time, all together in other orders, other budgets and chunk sizes, warm prefix cache: same bits."""
    ref, cand = pair
    engine = load_engine(str(cand), EngineConfig(num_kv_blocks=256), reference=str(ref))
    tok = engine.tokenizer
    together = _score(engine, _requests(tok))
    runs = [{i: next(iter(_score(engine, _requests(tok, [i])).values())) for i in range(len(PROMPTS))},
            _score(engine, _requests(tok, [3, 1, 0, 2]))]
    small = load_engine(str(cand), EngineConfig(max_batch_tokens=16, logprobs_chunk_size=5, num_kv_blocks=64),
                        reference=str(ref))
    runs.append(_score(small, _requests(tok, [2, 0, 3, 1])))
    for run in runs:
        for i in range(len(PROMPTS)):
            a, b = together[i].divergence, run[i].divergence
            for field in ("ref_logprobs", "kl", "delta_p", "top1_agree"):
                assert getattr(a, field).tobytes() == getattr(b, field).tobytes(), (i, field)


def test_refuses_other_vocabularies(pair, tiny_model_dir, tmp_path, default_tokenizer):
    from conftest import build_tiny_model

    ref, _ = pair
    other = build_tiny_model("llama", tmp_path / "other", default_tokenizer, {"vocab_size": 49160})
    with pytest.raises(ApcscoreError, match="vocabulary of 49,152 entries"):
        load_engine(str(other), EngineConfig(), reference=str(ref))
    with pytest.raises(ApcscoreError, match="--exact-reuse"):
        load_engine(str(ref), EngineConfig(exact_reuse=True), reference=str(ref))


def test_kernel_rows_are_independent():
    """row_divergence of a row is the same alone, in a batch and across tiles; tree_sum sums exactly small ints."""
    gen = torch.Generator().manual_seed(0)
    logits, ref_logits = (4 * torch.randn(70, 1000, generator=gen) for _ in range(2))
    targets = torch.randint(0, 1000, (70,), generator=gen)
    batch = row_divergence(logits, ref_logits, targets)
    for i in (0, 31, 32, 69):
        alone = row_divergence(logits[i:i + 1], ref_logits[i:i + 1], targets[i:i + 1])
        for a, b in zip(batch, alone):
            assert a[i:i + 1].numpy().tobytes() == b.numpy().tobytes()
    assert tree_sum(torch.arange(7, dtype=torch.float64)[None]).item() == 21.0
    same = row_divergence(logits, logits, targets)
    assert (same[0] == 0).all() and (same[2] == 0).all() and same[3].all()
