"""What every part of the GPU check shares: JSON-line output, the model shapes, random-weight models and engines,
synthetic prompts, and the engine's and transformers' scoring and generation workloads.

Token ids are synthetic (random, fixed seeds) and the engine gets a minimal tokenizer (it only calls `decode`
and reads `eos_token_id`): nothing is downloaded, and the GPU machine needs no tokenizer files. Random-weight
models built from a config measure speed as real ones do.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
PEAK_BF16_FLOPS = 989e12  # H100/H200 SXM dense bf16
# A part's deadline (epoch seconds), set by the orchestrator (gpu_check.py) for each part it starts
PART_DEADLINE_ENV = "GPU_CHECK_PART_DEADLINE"


def matmul_params(engine) -> int:
    """The weights a token is multiplied by, for MFU (2 x this x tokens FLOPs): every parameter, less an untied
    input embedding (a lookup; tied, it is the LM head's GEMM and counts once, as num_parameters has it)."""
    model = engine.runner.model
    untied = getattr(model, "lm_head", None) is not None
    return engine.info.num_parameters - (model.embed_tokens.weight.numel() if untied else 0)


def mfu(params: int, tokens: int, secs: float) -> float:
    """Model FLOP utilisation of `tokens` through `params` (matmul_params) weights in `secs`: 2 FLOPs per weight
    and token, over PEAK_BF16_FLOPS."""
    return rounded(2 * params * tokens / secs / PEAK_BF16_FLOPS)


# Llama-3.2-1B, SmolLM2-135M and Llama-3.1-8B shapes (transformers LlamaConfig arguments).
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_parameters=LLAMA3_ROPE),
    "smollm2-135m": dict(
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_parameters=dict(rope_type="default", rope_theta=100000.0)),
    "llama-3.1-8b": dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_parameters=LLAMA3_ROPE),
}
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=1024, initializer_range=0.2)


def gemm_shapes(name: str, small: bool = False) -> dict[str, tuple[int, int]]:
    """The linear layers of a shape as {name: (N, K)} (weight [N, K]): fused qkv, o, fused gate_up, down, LM head."""
    s = dict(SHAPES[name], **(TINY if small else {}))
    hidden, head_dim = s["hidden_size"], s["head_dim"]
    qkv = (s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * head_dim
    return {"qkv": (qkv, hidden), "o": (hidden, s["num_attention_heads"] * head_dim),
            "gate_up": (2 * s["intermediate_size"], hidden), "down": (hidden, s["intermediate_size"]),
            "lm_head": (s["vocab_size"], hidden)}


# ---- output --------------------------------------------------------------------------------------------------
def emit(record: dict[str, Any]) -> None:
    """One JSON line on stdout (flushed: a part killed by its timeout keeps what it printed)."""
    print(json.dumps(record, default=_jsonable), flush=True)


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)


def rounded(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}") if math.isfinite(x) else x


# ---- models and inputs -----------------------------------------------------------------------------------------
class IdsTokenizer:
    """What the engine needs of a tokenizer: `decode` (completion text) and `eos_token_id`. Ids are synthetic."""

    eos_token_id = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def llama_config(name: str, small: bool):
    from transformers import LlamaConfig

    shape = dict(SHAPES[name])
    if small:
        shape.update(TINY, max_position_embeddings=4096)
    return LlamaConfig(**shape, bos_token_id=None, eos_token_id=None, pad_token_id=0)


def random_hf_model(cfg, dtype, device: str):
    """transformers' Llama with random weights (its own initialisation, seed 0), built on `device` (no host
    copy of the weights), eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def make_engine(cfg, state: dict, device: str, dtype: str, backend: str, **overrides):
    """native_engine_from_parts on these weights; on CUDA with the Triton backend, decode steps replay CUDA graphs."""
    from apcscore.config import EngineConfig
    from apcscore.engine.loader import native_engine_from_parts

    config = dict(device=device, dtype=dtype, attention_backend=backend, max_model_len=4096, num_kv_blocks=4096,
                  block_size=16, max_batch_tokens=8192, max_num_seqs=256, logprobs_chunk_size=2048)
    config.update(overrides)
    return native_engine_from_parts(cfg, state, IdsTokenizer(), EngineConfig(**config))


def engine_and_state(name: str, small: bool):
    """(config, weights, engine dtype name, backend, device, transformers model) of a random-weight model of
    shape `name`: bf16 and the Triton backend on CUDA, fp32 and the torch backend on the CPU (--small). The
    weights are the model's tensors, on the device; drop both (`del`) to free them."""
    import torch

    device = "cpu" if small else "cuda"
    precision, backend = ("float32", "torch") if small else ("bfloat16", "triton")
    cfg = llama_config(name, small)
    hf = random_hf_model(cfg, torch.float32 if small else torch.bfloat16, device)
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    return cfg, state, precision, backend, device, hf


def columns(p) -> Any:
    """A TokenLogprobs as one flat float64 vector of every output column, for bitwise
    comparison: ids, logprobs, ranks, top ids, top logprobs."""
    import numpy as np

    return np.concatenate([np.asarray(a, np.float64).ravel() for a in
                           (p.token_ids, p.token_logprobs, p.ranks, p.top_ids, p.top_logprobs)])


def peak_memory_gib() -> float | None:
    """Peak allocated CUDA memory since the last reset, in GiB (None on the CPU)."""
    import torch

    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None


def random_prompts(lengths: list[int], vocab: int, seed: int, prefix: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    shared = rng.integers(0, vocab, prefix).tolist()
    return [shared + rng.integers(0, vocab, n).tolist() for n in lengths]


# The score and generate workloads that the bench, tax, 8b and profile parts share, so that they measure the same
# work: score 128 prompts of 64..2048 tokens (log-uniform); generate 256 prompts of a shared 1,024-token prefix
# and 32 own tokens, 64 greedy tokens each. --small: tiny versions.
SCORE_SHAPE = {False: (128, 64, 2048), True: (8, 16, 128)}  # (prompts, shortest, longest) by small
GENERATE_SHAPE = {False: (256, 1024, 32, 64), True: (8, 64, 8, 8)}  # (prompts, shared prefix, own tokens, new)


def score_workload(vocab: int, small: bool) -> list[list[int]]:
    """The shared scoring prompts (SCORE_SHAPE; fixed seeds)."""
    n, lo, hi = SCORE_SHAPE[small]
    return random_prompts(score_lengths(n, lo, hi, seed=1), vocab, seed=2)


def generate_workload(vocab: int, small: bool) -> list[list[int]]:
    """The shared generation prompts (GENERATE_SHAPE; a fixed seed): a common prefix, then each its own tokens."""
    n, prefix, own, _ = GENERATE_SHAPE[small]
    return random_prompts([own] * n, vocab, seed=4, prefix=prefix)


def score_lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    """n lengths, log-uniform in [lo, hi] (fixed seed)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return np.exp(rng.uniform(math.log(lo), math.log(hi), n)).round().astype(int).clip(lo, hi).tolist()


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_time(fn: Callable[[], Any], reps: int) -> float:
    """Median wall seconds of `reps` synchronised calls of fn."""
    times = sorted(timed(fn)[1] for _ in range(reps))
    return times[len(times) // 2]


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


# ---- engine and transformers workloads -----------------------------------------------------------------------
def engine_score(engine, prompts: list[list[int]], k: int) -> list:
    """The prompt TokenLogprobs of every prompt, in input order."""
    from apcscore.engine.step import Request

    outs = {o.request_id: o for o in engine.run(Request(i, p, prompt_logprobs=k) for i, p in enumerate(prompts))}
    bad = [o.error for o in outs.values() if o.error]
    if bad:
        raise RuntimeError(f"engine errors: {bad[:3]}")
    return [outs[i].prompt_logprobs for i in range(len(prompts))]


def engine_generate(engine, prompts: list[list[int]], max_tokens: int, logprobs: int | None = None) -> list:
    from apcscore.engine.step import Request, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs, ignore_eos=True)
    outs = {o.request_id: o for o in engine.run(Request(i, p, sampling=params) for i, p in enumerate(prompts))}
    bad = [o.error for o in outs.values() if o.error]
    if bad:
        raise RuntimeError(f"engine errors: {bad[:3]}")
    return [outs[i] for i in range(len(prompts))]


def hf_score(model, prompts: list[list[int]], k: int, budget: int) -> list[tuple]:
    """Per prompt: (logprobs [n-1], top-k ids [n-1, k]) from padded forwards of length-sorted batches with at
    most `budget` padded tokens each; logprobs, ranks and top-k are computed as the engine does (fp32)."""
    import torch

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: list[tuple | None] = [None] * len(prompts)
    dev = next(model.parameters()).device
    start = 0
    with torch.inference_mode():
        while start < len(order):
            end = start + 1
            while end < len(order) and len(prompts[order[end]]) * (end + 1 - start) <= budget:
                end += 1
            idx = order[start:end]
            width = len(prompts[idx[-1]])
            ids = torch.zeros(len(idx), width, dtype=torch.long)
            mask = torch.zeros(len(idx), width, dtype=torch.long)
            for r, i in enumerate(idx):
                ids[r, :len(prompts[i])] = torch.tensor(prompts[i])
                mask[r, :len(prompts[i])] = 1
            ids, mask = ids.to(dev), mask.to(dev)
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]  # [b, L-1, V]
            targets = ids[:, 1:, None]
            logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
            token_lp = logprobs.gather(-1, targets)[..., 0]
            ranks = (logits > logits.gather(-1, targets)).sum(-1) + 1
            top_ids = logits.topk(k, dim=-1).indices
            top_lp = logprobs.gather(-1, top_ids)
            token_lp, ranks, top_ids, top_lp = (t.cpu().numpy() for t in (token_lp, ranks, top_ids, top_lp))
            for r, i in enumerate(idx):
                n = len(prompts[i]) - 1
                results[i] = (token_lp[r, :n], top_ids[r, :n], ranks[r, :n], top_lp[r, :n])
            del logits, logprobs
            start = end
    return results


def hf_generate(model, prompts: list[list[int]], max_new: int, batch_size: int) -> list[list[int]]:
    """Greedy generate() of equal-length prompts (no padding), `batch_size` prompts per call."""
    import torch

    dev = next(model.parameters()).device
    out: list[list[int]] = []
    with torch.inference_mode():
        for s in range(0, len(prompts), batch_size):
            ids = torch.tensor(prompts[s:s + batch_size], device=dev)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                 min_new_tokens=max_new, do_sample=False, pad_token_id=0)
            out += gen[:, ids.shape[1]:].tolist()
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n

