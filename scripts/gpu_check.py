"""GPU check: every GPU measurement of apcscore in one call, printed as JSON lines.

    python3 scripts/gpu_check.py [--small]            # all parts, each in its own process under a timeout
    python3 scripts/gpu_check.py env|tests|compare|bench --model NAME [--small]   # one part

scripts/gpu_check.sh is the entry point (it sets PYTHONPATH and the overall limit). Parts:

- env      versions, device, and whether apcscore imports without `datasets` / `gguf` (absent there).
- tests    `pytest -m "gpu or triton"` (TRITON_INTERPRET unset: the kernels and engines run on CUDA).
- compare  the Triton backend against the torch backend on a random-weight Llama-3.2-1B-shaped model: both in
           bf16 against the torch backend in fp32, plus Triton fp32 against torch fp32. Tolerances below.
- bench    apcscore against plain transformers (bf16, SDPA) on the same random weights, for a
           SmolLM2-135M-shaped and a Llama-3.2-1B-shaped model: prompt-logprob scoring (K=5, lengths 64..2048;
           transformers: one padded forward per batch, prompts sorted by length) with model FLOP utilisation
           (2 x params x tokens / s / 989e12, params including the tied embedding), and generation (256 prompts
           sharing a 1,024-token prefix, 64 greedy tokens each; transformers: generate() on the whole batch).

Token ids are synthetic (random, fixed seeds) and the engine gets a minimal tokenizer (it only calls `decode`
and reads `eos_token_id`): nothing is downloaded, and the GPU machine needs no tokenizer files.
`--small` (GPU_CHECK_SMALL=1, or gpu_check.sh --dry-run) runs every part end to end on the CPU in fp32 with
tiny shapes, the torch backend for the benchmark and the Triton interpreter for the comparison.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
PEAK_BF16_FLOPS = 989e12  # H100/H200 SXM dense bf16
TOTAL_LIMIT_S = 530  # the whole check stays under 9 minutes
# run 1 on the H200 took env 9, tests 55, compare 23, bench 28 and 26, invariance 22 s (docs/gpu_runs/)
PART_LIMITS_S = {"env": 20, "tests": 150, "compare": 50, "bench:smollm2-135m": 45, "bench:llama-3.2-1b": 85,
                 "invariance": 170}
SMALL_LIMITS_S = {"env": 60, "tests": 180, "compare": 240, "bench:smollm2-135m": 120, "bench:llama-3.2-1b": 120,
                  "invariance": 240}

# Llama-3.2-1B and SmolLM2-135M shapes (transformers LlamaConfig arguments).
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0,
                                                low_freq_factor=1.0, high_freq_factor=4.0,
                                                original_max_position_embeddings=8192)),
    "smollm2-135m": dict(
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_parameters=dict(rope_type="default", rope_theta=100000.0)),
}
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=1024, initializer_range=0.2)


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
    """transformers' Llama with random weights (its own initialisation, seed 0), built on `device`, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def make_engine(cfg, state: dict, device: str, dtype: str, backend: str, **overrides):
    """Engine.from_parts on these weights; on CUDA with the Triton backend, decode steps replay CUDA graphs."""
    from apcscore.config import EngineConfig
    from apcscore.engine.cuda_graphs import attach
    from apcscore.engine.engine import Engine

    config = dict(device=device, dtype=dtype, attention_backend=backend, max_model_len=4096, num_kv_blocks=4096,
                  block_size=16, max_batch_tokens=8192, max_num_seqs=256, logprobs_chunk_size=2048)
    config.update(overrides)
    engine = Engine.from_parts(cfg, state, IdsTokenizer(), EngineConfig(**config))
    runner = engine.runner
    if device == "cuda" and backend == "triton" and engine.config.use_cuda_graphs and runner.cuda_graphs is None:
        attach(engine)  # until Engine passes use_cuda_graphs / max_num_seqs on to ModelRunner
    return engine


def random_prompts(lengths: list[int], vocab: int, seed: int, prefix: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    shared = rng.integers(0, vocab, prefix).tolist()
    return [shared + rng.integers(0, vocab, n).tolist() for n in lengths]


def score_lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    """n lengths, log-uniform in [lo, hi] (fixed seed)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return np.exp(rng.uniform(math.log(lo), math.log(hi), n)).round().astype(int).clip(lo, hi).tolist()


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


# ---- engine and transformers workloads -----------------------------------------------------------------------
def engine_score(engine, prompts: list[list[int]], k: int) -> list:
    """PromptLogprobs of every prompt, in input order."""
    from apcscore.engine.sequence import Request

    outs = {o.request_id: o for o in engine.run(Request(i, p, prompt_logprobs=k) for i, p in enumerate(prompts))}
    bad = [o.error for o in outs.values() if o.error]
    if bad:
        raise RuntimeError(f"engine errors: {bad[:3]}")
    return [outs[i].prompt_logprobs for i in range(len(prompts))]


def engine_generate(engine, prompts: list[list[int]], max_tokens: int, logprobs: int | None = None) -> list:
    from apcscore.engine.sampling_params import SamplingParams
    from apcscore.engine.sequence import Request

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


# ---- parts --------------------------------------------------------------------------------------------------
def part_env(args) -> bool:
    import importlib.util

    import torch

    info: dict[str, Any] = {"part": "env", "python": sys.version.split()[0], "torch": torch.__version__}
    for mod in ("transformers", "triton", "pytest"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as e:  # report, do not fail: the other parts say what they need
            info[mod] = f"unavailable: {type(e).__name__}"
    info["has_datasets"] = importlib.util.find_spec("datasets") is not None
    info["has_gguf"] = importlib.util.find_spec("gguf") is not None
    info["cuda"] = torch.cuda.is_available()
    if info["cuda"]:
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        info.update(device=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gib=round(total / 2**30, 1), free_gib=round(free / 2**30, 1))
    t0 = time.perf_counter()
    import apcscore.engine.cuda_graphs  # noqa: F401
    import apcscore.engine.engine  # noqa: F401
    import apcscore.models.backend

    apcscore.models.backend.select_backend("triton")  # the attention backend and every Triton kernel it uses

    info["apcscore_import_s"] = round(time.perf_counter() - t0, 2)
    info["apcscore_loaded_datasets_or_gguf"] = sorted(m for m in ("datasets", "gguf") if sys.modules.get(m))
    info["ok"] = not info["apcscore_loaded_datasets_or_gguf"]
    emit(info)
    return info["ok"]


def part_tests(args) -> bool:
    """pytest -m "gpu or triton"; one JSON line with the counts and the failures."""
    import re

    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu or triton", "-rfE", "--tb=short", "-p", "no:cacheprovider",
           "--continue-on-collection-errors", "--durations=8"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:  # echoed to stderr as it comes: a part killed by its timeout still shows where
        lines.append(line.rstrip("\n"))
        print(line, end="", file=sys.stderr, flush=True)
    rc = proc.wait()
    last = next((ln for ln in reversed(lines) if ln.strip()), "")
    counts = {key: int(n) for n, key in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed)", last)}
    text = "\n".join(lines)
    failures = text[text.find("= FAILURES ="):text.find("short test summary")] if "= FAILURES =" in text else ""
    # Modules this machine cannot import (e.g. hypothesis absent) are collection errors: reported, not fatal.
    failed = [ln for ln in lines if ln.startswith("FAILED") or (ln.startswith("ERROR") and "::" in ln)]
    uncollected = [ln for ln in lines if ln.startswith("ERROR") and "::" not in ln]
    ok = not failed and rc in (0, 1) and (counts.get("passed", 0) > 0 or args.small)
    emit({"part": "tests", "rc": rc, "seconds": round(time.perf_counter() - t0, 1), **counts,
          "failed_tests": failed[:30], "collection_errors": uncollected[:20],
          "slowest": [ln.strip() for ln in lines if re.match(r"\s*\d+\.\d+s (call|setup)", ln)][:8],
          "tracebacks": failures[:12000], "ok": ok})
    return ok


def part_compare(args) -> bool:
    """Triton vs torch backend on the Llama-3.2-1B shape (random weights). Stated tolerances:
    bf16: the Triton engine's mean |logprob - fp32 torch| at most 1.5x the torch-bf16 engine's + 0.005, its max
    at most 2x + 0.05; greedy continuations equal until a near-tie (top-2 gap < 0.1 in the torch-bf16 run).
    fp32: Triton within 1e-3 (max |delta logprob|) of torch, greedy tokens equal up to top-2 ties within 1e-3."""
    import numpy as np
    import torch

    small = args.small
    device = "cpu" if small else "cuda"
    name = "llama-3.2-1b"
    cfg = llama_config(name, small)
    hf = random_hf_model(cfg, torch.float32, device)
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    lengths = [16, 40, 23] if small else [64, 200, 512, 1000, 1500, 2048]
    prompts = random_prompts(lengths, cfg.vocab_size, seed=11)
    gen_prompts = random_prompts([3, 9] if small else [5, 40, 77, 130], cfg.vocab_size, seed=12,
                                 prefix=32 if small else 512)
    new = 4 if small else 32
    # chunked prefill of the longer prompts; decode batches of at most 8 (graphs of sizes 1, 2, 4, 8)
    chunk = dict(max_batch_tokens=16 if small else 1024, max_num_seqs=8)
    runs: dict[str, dict] = {}
    for tag, dtype, backend in (("torch-fp32", "float32", "torch"), ("triton-fp32", "float32", "triton"),
                                ("torch-bf16", "bfloat16", "torch"), ("triton-bf16", "bfloat16", "triton")):
        if small and dtype == "bfloat16":
            continue  # the interpreter's bf16 tl.dot is not GPU arithmetic (triton issue #11584)
        t0 = time.perf_counter()
        engine = make_engine(cfg, state, device, dtype, backend, **chunk)
        scored = engine_score(engine, prompts, 5)
        gen = engine_generate(engine, gen_prompts, new, logprobs=2)
        runs[tag] = {"lp": np.concatenate([s.token_logprobs for s in scored]),
                     "top1": np.concatenate([s.top_ids[:, 0] for s in scored]), "gen": gen,
                     "seconds": time.perf_counter() - t0}
        del engine
        if device == "cuda":
            torch.cuda.empty_cache()
    ref = runs["torch-fp32"]

    def diff(a: str, b: str) -> dict[str, float]:
        d = np.abs(runs[a]["lp"] - runs[b]["lp"])
        return {"mean": rounded(d.mean()), "max": rounded(d.max()),
                "top1_agree": rounded((runs[a]["top1"] == runs[b]["top1"]).mean())}

    def gen_agree(a: str, b: str, tie: float) -> dict[str, Any]:
        """Common greedy prefix of each prompt, and whether every divergence sits at a near-tie of run b
        (its top-2 logprobs within `tie`)."""
        prefix, explained = [], True
        for x, y in zip(runs[a]["gen"], runs[b]["gen"]):
            n = common_prefix(x.output_token_ids, y.output_token_ids)
            prefix.append(n)
            if n < new:
                top = y.output_logprobs.top_logprobs
                explained &= bool(top[n, 0] - top[n, 1] < tie)
        return {"common_prefix": prefix, "of": new, "divergences_at_near_ties": explained, "tie": tie}

    fp32 = diff("triton-fp32", "torch-fp32")
    fp32_gen = gen_agree("triton-fp32", "torch-fp32", 1e-3)
    out: dict[str, Any] = {"part": "compare", "model": name + ("-tiny" if small else "-shape"),
                           "device": device, "prompt_tokens": sum(lengths), "scored": int(ref["lp"].size),
                           "triton_vs_torch_fp32": fp32, "generation_fp32": fp32_gen,
                           "seconds": {k: round(v["seconds"], 1) for k, v in runs.items()}}
    ok = fp32["max"] < 1e-3 and fp32_gen["divergences_at_near_ties"]
    if not small:
        e_torch, e_triton = diff("torch-bf16", "torch-fp32"), diff("triton-bf16", "torch-fp32")
        gen_bf16 = gen_agree("triton-bf16", "torch-bf16", 0.1)
        out.update(torch_bf16_vs_fp32=e_torch, triton_bf16_vs_fp32=e_triton,
                   triton_vs_torch_bf16=diff("triton-bf16", "torch-bf16"), generation_bf16=gen_bf16)
        ok &= e_triton["mean"] <= 1.5 * e_torch["mean"] + 0.005 and e_triton["max"] <= 2 * e_torch["max"] + 0.05
        ok &= gen_bf16["divergences_at_near_ties"]
    out["tolerance"] = ("fp32: max |dlogprob| < 1e-3, greedy tokens equal up to top-2 ties within 1e-3; bf16: "
                        "Triton error vs fp32 <= 1.5x torch-bf16's mean + 0.005 and 2x its max + 0.05, greedy "
                        "divergences only where torch-bf16's top-2 are within 0.1")
    out["ok"] = bool(ok)
    emit(out)
    return out["ok"]


def part_bench(args) -> None:
    """apcscore vs transformers on one model shape: scoring then generation, same random weights."""
    import numpy as np
    import torch

    small, name = args.small, args.model
    device, dtype = ("cpu", torch.float32) if small else ("cuda", torch.bfloat16)
    dtype_name = "float32" if small else "bfloat16"
    backend = "torch" if small else "triton"
    cfg = llama_config(name, small)
    base = {"part": "bench", "model": name + ("-tiny" if small else "-shape"), "device": device,
            "dtype": dtype_name, "backend": backend, "inputs": "synthetic token ids, minimal tokenizer"}
    t0 = time.perf_counter()
    hf = random_hf_model(cfg, dtype, device)
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    engine = make_engine(cfg, state, device, dtype_name, backend)
    params = engine.info.num_parameters
    graphs = engine.runner.cuda_graphs
    emit({**base, "task": "setup", "params": params, "seconds": round(time.perf_counter() - t0, 1),
          "cuda_graph_sizes": graphs.sizes if graphs is not None else None,
          "engine_config": engine.config.to_dict()})

    # -- scoring: K=5, lengths log-uniform in 64..2048
    k = 5
    n_prompts, lo, hi = (8, 16, 128) if small else (128, 64, 2048)
    prompts = random_prompts(score_lengths(n_prompts, lo, hi, seed=1), cfg.vocab_size, seed=2)
    warm = random_prompts([lo, hi, (lo + hi) // 2], cfg.vocab_size, seed=3)
    engine_score(engine, warm, k)  # Triton compiles and cuBLAS picks its kernels outside the timing
    hf_score(hf, warm, k, budget=8192)
    tokens = sum(len(p) for p in prompts)
    ours, t_ours = timed(lambda: engine_score(engine, prompts, k))
    theirs, t_hf = timed(lambda: hf_score(hf, prompts, k, budget=8192))
    for side, secs in (("apcscore", t_ours), ("transformers", t_hf)):
        emit({**base, "task": "score", "side": side, "prompts": n_prompts, "tokens": tokens, "k": k,
              "seconds": round(secs, 3), "tokens_per_s": round(tokens / secs), "mfu": rounded(
                  2 * params * tokens / secs / PEAK_BF16_FLOPS), "mfu_peak_flops": PEAK_BF16_FLOPS})
    d = np.concatenate([np.abs(o.token_logprobs - t[0]) for o, t in zip(ours, theirs)])
    top1 = np.concatenate([o.top_ids[:, 0] == t[1][:, 0] for o, t in zip(ours, theirs)])
    emit({**base, "task": "score", "speedup_vs_transformers": round(t_hf / t_ours, 2),
          "agreement": {"mean_abs_logprob_diff": rounded(d.mean()), "max_abs_logprob_diff": rounded(d.max()),
                        "top1_agree": rounded(top1.mean())}})

    # -- generation: 256 prompts sharing a 1,024-token prefix (+ 32 own tokens), 64 greedy tokens each
    n_gen, prefix, own, new = (8, 64, 8, 8) if small else (256, 1024, 32, 64)
    gen_prompts = random_prompts([own] * n_gen, cfg.vocab_size, seed=4, prefix=prefix)
    warm = random_prompts([own] * 4, cfg.vocab_size, seed=5, prefix=prefix)  # another prefix: no cache hits
    engine_generate(engine, warm, 4)
    hf_generate(hf, warm, 4, batch_size=4)
    hits0 = engine.block_manager.stats.hit_tokens
    ours, t_ours = timed(lambda: engine_generate(engine, gen_prompts, new))
    hits = engine.block_manager.stats.hit_tokens - hits0
    theirs, t_hf = timed(lambda: hf_generate(hf, gen_prompts, new, batch_size=n_gen))
    replays = graphs.num_replays if graphs is not None else 0
    prompt_tokens = sum(len(p) for p in gen_prompts)
    for side, secs in (("apcscore", t_ours), ("transformers", t_hf)):
        emit({**base, "task": "generate", "side": side, "prompts": n_gen, "shared_prefix": prefix,
              "prompt_tokens": prompt_tokens, "new_tokens_each": new, "seconds": round(secs, 3),
              "generated_tokens_per_s": round(n_gen * new / secs),
              **({"prefix_cache_hit_tokens": hits, "cuda_graph_replays": replays} if side == "apcscore" else {})})
    same = [common_prefix(o.output_token_ids, t) for o, t in zip(ours, theirs)]
    emit({**base, "task": "generate", "speedup_vs_transformers": round(t_hf / t_ours, 2),
          "agreement": {"mean_common_greedy_prefix": round(float(np.mean(same)), 1), "of": new,
                        "first_token_agree": rounded(float(np.mean([s > 0 for s in same])))}})


def part_invariance(args) -> bool:
    """Batch invariance on CUDA: does a row's result depend on the row count? For the GEMMs of a
    Llama-3.2-1B-shaped model: cuBLAS (F.linear), cuBLAS on fixed 128-row tiles (one strided-batched call),
    and apcscore's fixed-configuration Triton kernel (apcscore.kernels.matmul), each against its own
    result at M = 4096 (rows that differ in any bit), plus median time per call. Then the engine as it is
    today: the same prompts scored under several token budgets, logprobs compared bitwise to the largest
    budget's. Measures; fails only on a crash."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from apcscore.kernels.matmul import invariant_linear

    small = args.small
    device, dtype = ("cpu", torch.float32) if small else ("cuda", torch.bfloat16)
    hidden, inter, vocab = (64, 128, 1024) if small else (2048, 8192, 128256)
    shapes = {"qkv": (hidden, hidden + 2 * hidden // 4), "o": (hidden, hidden), "gate_up": (hidden, 2 * inter),
              "down": (inter, hidden), "lm_head": (hidden, vocab)}
    ref_m = 256 if small else 4096
    ms = [1, 7, 16, 57, 64, 100, 191, 257, 1000] if not small else [1, 7, 57, 100, 191]
    tile = 128

    def tiled(x, w):  # fixed 128-row tiles through one strided-batched cuBLAS call
        m = x.shape[0]
        pad = -m % tile
        xp = F.pad(x, (0, 0, 0, pad)).view(-1, tile, x.shape[1])
        return torch.matmul(xp, w.t())[...].reshape(-1, w.shape[0])[:m]

    variants = {"cublas": lambda x, w: F.linear(x, w), "cublas_tiles128": tiled,
                "triton_fixed": lambda x, w: invariant_linear(x, w)}
    if not small:
        variants["triton_fixed_fp32_out"] = lambda x, w: invariant_linear(x, w, out_dtype=torch.float32)

    def median_ms(fn, reps: int = 5 if small else 20) -> float:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return rounded(1e3 * float(np.median(times)))

    g = torch.Generator(device="cpu").manual_seed(0)
    ok = True
    for name, (k_dim, n_dim) in shapes.items():
        w = (torch.randn(n_dim, k_dim, generator=g) * k_dim ** -0.5).to(device, dtype)
        x = torch.randn(ref_m, k_dim, generator=g).to(device, dtype)
        row: dict[str, Any] = {"part": "invariance", "gemm": name, "k": k_dim, "n": n_dim, "ref_m": ref_m}
        for vname, fn in variants.items():
            ref = fn(x, w)
            bad = {m: int((fn(x[:m], w) != ref[:m]).any(dim=1).sum()) for m in ms}
            row[vname] = {"rows_differing_at_m": {m: b for m, b in bad.items() if b},
                          "invariant": not any(bad.values()),
                          "ms": {m: median_ms(lambda: fn(x[:m], w)) for m in ([1, 256, ref_m] if not small else [ref_m])}}
        if not small:
            row["triton_vs_cublas_max_abs"] = rounded(float((variants["triton_fixed"](x, w).float() - F.linear(x, w).float()).abs().max()))
        emit(row)
        del w, x

    engine_matrix(small)
    return ok


def engine_matrix(small: bool) -> None:
    """The invariance matrix on CUDA (tests/test_invariance.py's, smaller): the same requests alone, under
    token budgets, shuffled, in a warm prefix cache and under preemption, every logprob compared bitwise to
    the big-budget run; greedy generation with CUDA graphs alone vs batched. On the Llama-3.2-1B shape in
    bf16 with the Triton backend, batch-invariant (the default), then the same budgets with
    --no-batch-invariant (what cuBLAS does), and the invariance tax: score and generate time, invariant over
    not (medians of 3). On the CPU (--small) the tiny shape, torch backend."""
    import random

    import numpy as np
    import torch

    from apcscore.engine.sampling_params import SamplingParams
    from apcscore.engine.sequence import Request

    device = "cpu" if small else "cuda"
    precision, backend = ("float32", "torch") if small else ("bfloat16", "triton")
    cfg = llama_config("smollm2-135m" if small else "llama-3.2-1b", small)
    hf = random_hf_model(cfg, torch.float32 if small else torch.bfloat16, device)
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    del hf
    lengths = [16, 40, 23, 70] if small else [64, 130, 300, 700, 1500, 90, 33, 500]
    prompts = random_prompts(lengths, cfg.vocab_size, seed=21)
    budgets = [57, 64, 100, 191] + ([] if small else [1000])
    big = 8192

    def scores(invariant: bool = True, order: list[int] | None = None, engine=None, **overrides) -> np.ndarray:
        settings = dict(max_batch_tokens=big, max_num_seqs=8, use_cuda_graphs=False, batch_invariant=invariant)
        engine = engine or make_engine(cfg, state, device, precision, backend, **{**settings, **overrides})
        order = order or list(range(len(prompts)))
        got = engine_score(engine, [prompts[i] for i in order], 5)
        by_id = {i: g for i, g in zip(order, got)}
        return np.concatenate([np.concatenate([by_id[i].token_logprobs, by_id[i].top_logprobs.ravel()])
                               for i in range(len(prompts))])

    for invariant in (True, False):
        engine = make_engine(cfg, state, device, precision, backend, max_batch_tokens=big, max_num_seqs=8,
                             use_cuda_graphs=False, batch_invariant=invariant)
        ref = scores(engine=engine)
        runs = {str(b): scores(invariant, max_batch_tokens=b) for b in budgets}
        if invariant:
            alone = [engine_score(engine, [p], 5)[0] for p in prompts]
            runs["alone"] = np.concatenate([np.concatenate([a.token_logprobs, a.top_logprobs.ravel()]) for a in alone])
            runs["warm_cache"] = scores(engine=engine)
            shuffled = list(range(len(prompts)))
            random.Random(7).shuffle(shuffled)
            runs["shuffled"] = scores(order=shuffled)
        emit({"part": "invariance", "engine": ("tiny" if small else "llama-3.2-1b-shape") + f"-{precision}",
              "backend": backend, "batch_invariant": invariant, "values": int(ref.size),
              "differing_vs_budget_8192": {k: int((r != ref).sum()) for k, r in runs.items()},
              "max_abs_diff": {k: rounded(float(np.abs(r - ref).max())) for k, r in runs.items()}})

    # greedy generation: CUDA graphs (on CUDA), alone vs batched vs a small budget vs preempted
    gen_prompts = random_prompts([5, 17, 40, 64, 100, 300], cfg.vocab_size, seed=22, prefix=32)
    params = SamplingParams(max_tokens=8 if small else 16, logprobs=2, ignore_eos=True)

    def generate(engine, which: list[int]) -> dict[int, tuple]:
        outs = engine.run(Request(i, gen_prompts[i], sampling=params) for i in which)
        return {o.request_id: (list(o.output_token_ids), o.output_logprobs.token_logprobs.tolist()) for o in outs}

    base = dict(max_batch_tokens=big, max_num_seqs=8)
    ref_gen = generate(make_engine(cfg, state, device, precision, backend, **base), list(range(len(gen_prompts))))
    alone_engine = make_engine(cfg, state, device, precision, backend, **base)
    gen_runs = {"alone": {i: generate(alone_engine, [i])[i] for i in range(len(gen_prompts))},
                "budget_64": generate(make_engine(cfg, state, device, precision, backend, max_batch_tokens=64,
                                                  max_num_seqs=8), list(range(len(gen_prompts))))}
    longest = max(len(p) for p in gen_prompts) + params.max_tokens
    tight = make_engine(cfg, state, device, precision, backend, max_batch_tokens=256, max_num_seqs=8,
                        num_kv_blocks=-(-longest // 16) + 2)
    gen_runs["preemption"] = generate(tight, list(range(len(gen_prompts))))
    emit({"part": "invariance", "engine": ("tiny" if small else "llama-3.2-1b-shape") + f"-{precision}",
          "task": "greedy generate", "prompts": len(gen_prompts), "preemptions": tight.stats.preemptions,
          "differing_requests": {k: sum(r[i] != ref_gen[i] for i in ref_gen) for k, r in gen_runs.items()}})

    # the tax: invariant over library GEMMs, same work, medians of 3
    def timed(fn) -> float:
        times = []
        for _ in range(1 if small else 3):  # the dry run only checks that this runs
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    row: dict[str, Any] = {"part": "invariance", "task": "tax", "engine": "tiny" if small else "llama-3.2-1b-shape"}
    for invariant in (True, False):
        e_score = make_engine(cfg, state, device, precision, backend, max_batch_tokens=big, max_num_seqs=8,
                              use_cuda_graphs=False, batch_invariant=invariant)
        e_gen = make_engine(cfg, state, device, precision, backend, max_batch_tokens=big, max_num_seqs=8,
                            batch_invariant=invariant)
        key = "invariant" if invariant else "library_gemms"
        row[f"score_s_{key}"] = rounded(timed(lambda: engine_score(e_score, prompts, 5)))
        row[f"generate_s_{key}"] = rounded(timed(lambda: generate(e_gen, list(range(len(gen_prompts))))))
        del e_score, e_gen
    row["score_tax"] = rounded(row["score_s_invariant"] / row["score_s_library_gemms"] - 1, 3)
    row["generate_tax"] = rounded(row["generate_s_invariant"] / row["generate_s_library_gemms"] - 1, 3)
    emit(row)


# ---- orchestration ------------------------------------------------------------------------------------------
PARTS = {"env": part_env, "tests": part_tests, "compare": part_compare, "bench": part_bench,
         "invariance": part_invariance}


def run_part(argv: list[str], label: str, limit: float, env: dict[str, str], log) -> dict[str, Any]:
    """Run one part in its own process group under `limit` seconds; pass its JSON lines through."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    reader.start()
    lines = 0

    def pump() -> None:
        nonlocal lines
        for line in proc.stdout:
            line = line.strip()
            if line.startswith("{"):
                lines += 1
                write(line, log)
            elif line:
                err.append(line + "\n")

    pumper = threading.Thread(target=pump, daemon=True)
    pumper.start()
    timed_out = False
    try:
        proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    pumper.join(timeout=5)
    reader.join(timeout=5)
    status = {"part": "end", "name": label, "rc": proc.returncode, "timed_out": timed_out, "limit_s": round(limit),
              "seconds": round(time.perf_counter() - t0, 1), "json_lines": lines}
    if proc.returncode != 0:
        status["stderr_tail"] = "".join(err)[-3000:]
    write(json.dumps(status), log)
    return status


def write(line: str, log) -> None:
    print(line, flush=True)
    if log is not None:
        log.write(line + "\n")
        log.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", nargs="?", choices=[*PARTS, "all"], default="all")
    parser.add_argument("--model", choices=list(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--small", action="store_true", default=os.environ.get("GPU_CHECK_SMALL") == "1",
                        help="CPU dry run: tiny shapes, fp32")
    args = parser.parse_args(argv)
    if args.part != "all":
        return 0 if PARTS[args.part](args) is not False else 1
    out_dir = os.environ.get("OUT")
    log = open(Path(out_dir) / "gpu_check.jsonl", "w", encoding="utf-8") if out_dir else None
    limits = SMALL_LIMITS_S if args.small else PART_LIMITS_S
    deadline = time.perf_counter() + TOTAL_LIMIT_S * (3 if args.small else 1)
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    small = ["--small"] if args.small else []
    plan = [(["env"], "env", env), (["tests"], "tests", env),
            (["compare"], "compare", {**env, "TRITON_INTERPRET": "1"} if args.small else env),
            (["bench", "--model", "smollm2-135m"], "bench:smollm2-135m", env),
            (["bench", "--model", "llama-3.2-1b"], "bench:llama-3.2-1b", env),
            (["invariance"], "invariance", {**env, "TRITON_INTERPRET": "1"} if args.small else env)]
    ok = True
    for part_argv, label, part_env_vars in plan:
        left = deadline - time.perf_counter()
        if left < 20:
            write(json.dumps({"part": "end", "name": label, "skipped": "no time left"}), log)
            ok = False
            continue
        status = run_part(part_argv + small, label, min(limits[label], left), part_env_vars, log)
        ok &= status["rc"] == 0
    write(json.dumps({"part": "summary", "ok": ok, "small": args.small,
                      "seconds": round(TOTAL_LIMIT_S * (3 if args.small else 1) - (deadline - time.perf_counter()), 1)}),
          log)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
