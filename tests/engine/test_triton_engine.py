"""The engine with the Triton backend against the engine with the torch backend, on tiny random-weight models.

Runs on the CPU under TRITON_INTERPRET=1 (`make test` sets it) or on CUDA; skipped otherwise. Both engines
use fp32. Tolerances: prompt and sampled-token logprobs and top-K logprobs within 1e-4; greedy tokens equal;
ranks and top-K ids equal, or differing only where transformers' own fp32 logprobs put the entries involved
within 1e-4 of each other (a near-tie that a 1e-4 difference may legitimately flip).

The interpreter pays ~0.2 s per kernel launch, so prompts are short, the step budget is small (8 tokens:
several chunked-prefill steps) and few positions are scored.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from apcscore import EngineConfig, Request, SamplingParams
from apcscore.engine import Engine
from apcscore.engine.loader import load_native_engine
from triton_device import DEVICE, TRITON_MARKS  # noqa: E402
from portable_models import tiny_dir  # noqa: F401  (fixture; works without the default model: GPU machine)

TOL = 1e-4

pytestmark = TRITON_MARKS


def make_engine(model_dir, backend: str) -> Engine:
    # block_size 4: the 12-token shared prefix fills 3 blocks; max_batch_tokens 8 chunks every prompt
    return load_native_engine(str(model_dir), EngineConfig(
        device=DEVICE, dtype="float32", num_kv_blocks=64, block_size=4, max_batch_tokens=8,
        attention_backend=backend, use_cuda_graphs=False))


def make_prompts(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts to score, prompts to generate from): all share a 12-token prefix."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(0, 49152, (n,), generator=g).tolist()  # noqa: E731
    shared = ids(12)
    return [shared + ids(3), shared + ids(6)], [shared + ids(2), shared + ids(5)]


def run_both(model_dir, seed: int) -> dict:
    """Score, then generate (reading the prefix blocks scoring wrote) with each backend."""
    scored, gen_prompts = make_prompts(seed)
    out = {}
    for backend in ("torch", "triton"):
        engine = make_engine(model_dir, backend)
        assert engine.attention_backend == backend
        score = {o.request_id: o for o in engine.run(
            Request(i, p, prompt_logprobs=3) for i, p in enumerate(scored))}
        gen = {o.request_id: o for o in engine.run(
            Request(i, p, sampling=SamplingParams(max_tokens=4, logprobs=2, ignore_eos=True))
            for i, p in enumerate(gen_prompts))}
        assert all(o.error is None for o in [*score.values(), *gen.values()])
        out[backend] = ([score[i] for i in range(len(scored))], [gen[i] for i in range(len(gen_prompts))])
    out["prompts"] = scored
    return out


def hf_logprobs(model_dir, prompt: list[int]) -> np.ndarray:
    """transformers' fp32 log-softmax [len - 1, V] of each prompt position that predicts the next token, with its
    eager attention (its SDPA path drops Gemma 2's attention soft-cap in transformers 5.17, the H200's)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].float(), -1).numpy()


def assert_near_ties(a_ids: np.ndarray, b_ids: np.ndarray, ref: np.ndarray) -> None:
    """top-K id lists a and b ([n, K]) differ only by entries that the reference rows ([n, V]) tie within TOL."""
    for row, (x, y) in enumerate(zip(a_ids, b_ids)):
        for j in np.flatnonzero(x != y):
            assert abs(ref[row, x[j]] - ref[row, y[j]]) < TOL, (row, j, x[j], y[j])


def assert_ranks_near(a: np.ndarray, b: np.ndarray, targets: np.ndarray, ref: np.ndarray) -> None:
    """Ranks a and b of the targets differ only by vocabulary entries within TOL of the target (reference)."""
    tgt = ref[np.arange(len(targets)), targets][:, None]
    lo = (ref > tgt + TOL).sum(-1) + 1
    hi = (ref > tgt - TOL).sum(-1) + 1
    assert np.all((a == b) | ((b >= lo) & (b <= hi) & (a >= lo) & (a <= hi)))


@pytest.mark.slow
@pytest.mark.parametrize("arch,seed", [("llama", 0), ("qwen3", 1)])  # qwen3: q/k RMSNorm, head_dim 32, tied
def test_triton_engine_matches_torch_engine(tiny_dir, arch: str, seed: int) -> None:
    model_dir = tiny_dir(arch)
    res = run_both(model_dir, seed)
    (t_score, t_gen), (k_score, k_gen) = res["torch"], res["triton"]
    for prompt, a, b in zip(res["prompts"], t_score, k_score):
        pa, pb = a.prompt_logprobs, b.prompt_logprobs
        assert pa.positions.tolist() == pb.positions.tolist() == list(range(1, len(prompt)))
        assert np.array_equal(pa.token_ids, pb.token_ids)
        assert np.abs(pa.token_logprobs - pb.token_logprobs).max() < TOL
        assert np.abs(pa.top_logprobs - pb.top_logprobs).max() < TOL
        ref = hf_logprobs(model_dir, prompt)
        # the torch engine itself is checked against transformers in test_engine; here it sets the scale
        assert np.abs(ref[np.arange(len(prompt) - 1), pa.token_ids] - pa.token_logprobs).max() < TOL
        assert_ranks_near(pa.ranks, pb.ranks, pa.token_ids, ref)
        assert_near_ties(pa.top_ids, pb.top_ids, ref)
        assert (pa.top_ids == pb.top_ids).mean() > 0.9 and (pa.ranks == pb.ranks).mean() > 0.9
    for a, b in zip(t_gen, k_gen):
        assert a.num_cached_tokens == b.num_cached_tokens == 12  # the shared prefix came from the cache
        assert a.output_token_ids == b.output_token_ids and len(a.output_token_ids) == 4
        la, lb = a.output_logprobs, b.output_logprobs
        assert la.ranks.tolist() == lb.ranks.tolist() == [1] * 4  # greedy: the argmax
        assert np.abs(la.token_logprobs - lb.token_logprobs).max() < TOL
        assert np.abs(la.top_logprobs - lb.top_logprobs).max() < TOL


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_on_the_triton_backend_matches_transformers(tiny_dir, arch: str) -> None:
    """Gemma 2 (window 24, attention soft-cap 5) and Gemma 3 (window 70 on its sliding layer) through the Triton
    kernels: prompts of 100 and 77 tokens chunked by a 32-token budget (windows across chunks and key tiles)
    within 1e-4 of transformers; the 100-token one scored alone gives the same bits; 6 greedy tokens decoded
    past an 80-token prompt (every decode step past the window) are transformers' argmax (up to 1e-4 near-ties)
    with its logprobs."""
    model_dir = tiny_dir(arch)
    engine = load_native_engine(str(model_dir), EngineConfig(
        device=DEVICE, dtype="float32", num_kv_blocks=128, block_size=4, max_batch_tokens=32,
        attention_backend="triton", use_cuda_graphs=False))
    assert engine.attention_backend == "triton" and engine.info.sliding_window is None  # the window is masked
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (100, 77)]
    together = {o.request_id: o for o in engine.run(Request(i, p, prompt_logprobs=1) for i, p in enumerate(prompts))}
    (alone,) = engine.run([Request(0, prompts[0], prompt_logprobs=1)])
    assert np.array_equal(alone.prompt_logprobs.token_logprobs, together[0].prompt_logprobs.token_logprobs)
    for i, p in enumerate(prompts):
        ref = hf_logprobs(model_dir, p)
        got = together[i].prompt_logprobs
        assert np.abs(ref[np.arange(len(p) - 1), got.token_ids] - got.token_logprobs).max() < TOL
    (gen,) = engine.run([Request(0, prompts[0][:80], sampling=SamplingParams(max_tokens=6, logprobs=1,
                                                                              ignore_eos=True))])
    tokens = gen.output_token_ids
    assert len(tokens) == 6
    ref = hf_logprobs(model_dir, prompts[0][:80] + tokens)[79:]  # [6, V]: the rows that chose each token
    assert np.all(ref[np.arange(6), tokens] >= ref.max(-1) - TOL)  # greedy: transformers' argmax
    assert np.abs(ref[np.arange(6), tokens] - gen.output_logprobs.token_logprobs).max() < TOL
