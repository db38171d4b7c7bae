"""GPU check parts `exactness` and `tax` (see scripts/gpu_check.py for the plan).

exactness: the engine's bitwise contracts end to end on the Llama-3.2-1B shape in bf16 with the Triton backend
(tests/engine/test_invariance.py, test_exact_reuse.py and test_last_token_alternatives.py, on CUDA): every output
column (ids, logprobs, ranks, top-K ids and logprobs) compared with `!=`, no tolerance. Fails (rc 1) when any
value differs or when a reuse check reused nothing (it would test nothing). Then the fused SiLU-and-multiply
kernel (kernels/silu_mul.py) against torch's two kernels `F.silu(gate) * up` on the 1B MLP shape (8,192 tokens x
8,192) in bf16, fp16 and fp32, bitwise, with every bf16 / fp16 gate value, and the time of each form (in --small,
under the interpreter: against silu_mul_reference with numpy's exp, the interpreter's).
Last, the shared-prefix decode groups against today's paged attention, bitwise, with their time
(scripts/gpu_check_groups.py).
tax: the same score and generate workloads with batch invariance on (the Triton matmul) and off (cuBLAS,
`--no-batch-invariant`; "library" in the output), one after the other in one process; time ratio invariant /
library.
"""

from __future__ import annotations

import random
from functools import partial
from typing import Any

from gpu_check_common import (GENERATE_SHAPE, columns, emit, engine_and_state, engine_generate, engine_score,
                              generate_workload, llama_config, make_engine, matmul_params, median_time, mfu,
                              random_prompts, rounded, score_workload)
from gpu_check_groups import check_shared_prefix_decode

K = 5


def differing(runs: dict[str, dict], ref: dict) -> dict[str, int]:
    """Per run: how many values differ from ref (runs and ref map a key to a flat vector; a missing key or a
    length change counts as the whole vector)."""
    out = {}
    for name, run in runs.items():
        bad = 0
        for key, want in ref.items():
            got = run.get(key)
            bad += want.size if got is None or got.shape != want.shape else int((got != want).sum())
        out[name] = bad
    return out


def part_exactness(args) -> bool:
    """Budgets and alone, exact reuse, last-token alternatives, greedy generation: one JSON line each."""
    import numpy as np

    from apcscore.engine.step import Request, SamplingParams
    from apcscore.jobs.loglikelihood import group_by_last_token

    import os

    from apcscore.attention.decode_groups import SWITCH

    small = args.small
    os.environ[SWITCH] = "1"  # decode groups on in this part (its own process): checked bitwise below
    cfg, state, precision, backend, device, _ = engine_and_state("llama-3.2-1b", small)
    vocab = cfg.vocab_size
    base = dict(max_batch_tokens=8192, max_num_seqs=16, use_cuda_graphs=False)  # graphs: generation only
    tag = {"part": "exactness", "model": "llama-3.2-1b-" + ("tiny" if small else "shape"), "dtype": precision,
           "backend": backend}

    def engine(**overrides):
        return make_engine(cfg, state, device, precision, backend, **{**base, **overrides})

    def run(eng, requests: list) -> dict:
        """request_id -> flat vector of its prompt-logprob columns (and its alternatives' when it has some)."""
        out = {}
        for o in eng.run(requests):
            if o.error:
                raise RuntimeError(f"engine error: {o.error}")
            parts = [columns(o.prompt_logprobs)]
            if o.last_token_alternatives is not None:
                parts.append(columns(o.last_token_alternatives))
            out[o.request_id] = np.concatenate(parts)
        return out

    ok = True
    # 1. the same prompts under token budgets 57..8192, shuffled, and each alone
    lengths = [16, 40, 23, 70] if small else [64, 130, 300, 700, 1500, 90, 33, 500]
    prompts = random_prompts(lengths, vocab, seed=21)
    reqs = [Request(i, p, prompt_logprobs=K) for i, p in enumerate(prompts)]
    big = engine()
    ref = run(big, reqs)
    runs = {str(b): run(engine(max_batch_tokens=b), reqs) for b in (57, 64, 100, 191)}
    runs["alone"] = {k: v for r in reqs for k, v in run(big, [r]).items()}
    shuffled = list(reqs)
    random.Random(7).shuffle(shuffled)
    runs["shuffled, warm cache"] = run(big, shuffled)
    bad = differing(runs, ref)
    ok &= not any(bad.values())
    emit({**tag, "check": "budgets", "prompts": len(prompts), "prompt_tokens": sum(lengths),
          "values": int(sum(v.size for v in ref.values())), "differing_vs_budget_8192": bad,
          "ok": not any(bad.values())})

    # 2. --exact-reuse: few-shot contexts (context reuse) and full-prompt scoring of a shared prefix (score store)
    rng = np.random.default_rng(23)
    prefix = rng.integers(0, vocab, 40 if small else 350).tolist()
    fewshot = []
    for q in range(6 if small else 24):
        context = prefix + rng.integers(0, vocab, int(rng.integers(5, 40))).tolist()
        for c in range(4):
            cont = rng.integers(0, vocab, int(rng.integers(1, 10))).tolist()
            fewshot.append(Request((q, c), context + cont, prompt_logprobs=K, score_from=len(context)))
    fewshot += [Request(("full", i), prefix + rng.integers(0, vocab, 20).tolist(), prompt_logprobs=K)
                for i in range(4)]
    ref = run(engine(), fewshot)
    reuse = engine(exact_reuse=True)
    runs = {"exact_reuse": run(reuse, fewshot), "exact_reuse, warm, reversed": run(reuse, fewshot[::-1]),
            "exact_reuse, budget 100": run(engine(exact_reuse=True, max_batch_tokens=100), fewshot)}
    stats = reuse.block_manager.stats
    bad = differing(runs, ref)
    reused = stats.hit_tokens > 0 and stats.score_store_hits > 0
    ok &= reused and not any(bad.values())
    emit({**tag, "check": "exact_reuse", "requests": len(fewshot), "shared_prefix": len(prefix),
          "differing_vs_recompute": bad, "hit_tokens": stats.hit_tokens,
          "score_store_hits": stats.score_store_hits, "ok": reused and not any(bad.values())})

    # 3. last-token alternatives: one request per context, one-token choices read from the same row
    separate = []  # per question: its few-shot context and 4 distinct one-token choices, each its own request
    for q in range(6 if small else 24):
        context = fewshot[4 * q].prompt_token_ids[:fewshot[4 * q].score_from]
        separate += [Request((q, c), context + [int(t)], prompt_logprobs=K, score_from=len(context))
                     for c, t in enumerate(rng.choice(vocab, 4, replace=False))]
    want = {r.request_id: columns(next(iter(big.run([r]))).prompt_logprobs) for r in separate}  # each alone
    runs = {}
    for name, eng in (("recompute", engine()), ("exact_reuse", engine(exact_reuse=True))):
        merged, owner = group_by_last_token(separate)
        for i, r in enumerate(merged):
            r.request_id = i
        outs = {o.request_id: o for o in eng.run(merged)}
        got = {}
        for r, o in zip(separate, owner):
            out, token = outs[o], r.prompt_token_ids[-1]
            p = out.prompt_logprobs
            if token == p.token_ids[-1]:
                got[r.request_id] = columns(p)
            else:
                i = int(np.flatnonzero(out.last_token_alternatives.token_ids == token)[0])
                got[r.request_id] = columns(out.last_token_alternatives.rows(i, i + 1))
        runs[name] = got
    bad = differing(runs, want)
    ok &= not any(bad.values())
    emit({**tag, "check": "last_token_alternatives", "questions": len(separate) // 4, "choices": 4,
          "engine_requests": len(merged), "differing_vs_separate_requests": bad, "ok": not any(bad.values())})

    # 4. greedy generation: batched with CUDA graphs, eager, alone, a small budget, preempted
    # an 80-token shared prefix: 5 blocks, one whole 64-key tile, so that the warm run's decodes form a group
    gen_prompts = random_prompts([5, 17, 40, 64, 100, 300], vocab, seed=22, prefix=80)
    params = SamplingParams(max_tokens=8 if small else 32, logprobs=2, ignore_eos=True)

    def generate(eng, which: list[int]) -> dict[int, Any]:
        outs = eng.run(Request(i, gen_prompts[i], sampling=params) for i in which)
        return {o.request_id: np.concatenate([np.asarray(o.output_token_ids, np.float64),
                                              columns(o.output_logprobs)]) for o in outs}

    every = list(range(len(gen_prompts)))
    graphs = dict(use_cuda_graphs=True)  # decode steps replay CUDA graphs (on CUDA), except the eager run
    batched = engine(**graphs)
    ref_gen = generate(batched, every)
    alone = engine(**graphs)
    longest = max(len(p) for p in gen_prompts) + params.max_tokens
    tight = engine(max_batch_tokens=256, num_kv_blocks=-(-longest // 16) + 2, **graphs)
    runs = {"eager (no CUDA graphs)": generate(engine(), every),
            "batched, warm (decode groups)": generate(batched, every),
            "alone": {k: v for i in every for k, v in generate(alone, [i]).items()},
            "budget 64": generate(engine(max_batch_tokens=64, **graphs), every), "preempted": generate(tight, every)}
    bad = differing(runs, ref_gen)
    preempted = tight.stats.preemptions > 0
    ok &= preempted and not any(bad.values())
    emit({**tag, "check": "greedy_generation", "prompts": len(gen_prompts), "new_tokens": params.max_tokens,
          "preemptions": tight.stats.preemptions, "differing_vs_batched": bad,
          "ok": preempted and not any(bad.values())})
    del big, reuse, alone, tight
    try:
        ok &= check_silu_mul(small, tag)
    except Exception as e:  # a kernel that does not compile here: its own line, the checks above kept
        emit({**tag, "check": "silu_mul", "error": f"{type(e).__name__}: {e}"[:2000], "ok": False})
        ok = False

    # 5. shared-prefix decode groups: bitwise paged_attention per sequence, and their time (gpu_check_groups.py)
    try:
        row = check_shared_prefix_decode(small)
    except Exception as e:  # a kernel that does not compile here: its own line, the checks above kept
        row = {"check": "shared_prefix_decode", "error": f"{type(e).__name__}: {e}"[:2000], "ok": False}
    ok &= row["ok"]
    emit({**tag, **row})
    return bool(ok)


def differing_bits(a, b) -> int:
    """How many elements of a and b differ in their bits (-0 vs 0 counts), NaN against NaN equal (a NaN's
    payload is the arithmetic's, not a rounding point)."""
    import torch

    ints = torch.int32 if a.element_size() == 4 else torch.int16
    nan_a, nan_b = a.isnan(), b.isnan()
    bits = (a.contiguous().view(ints) != b.contiguous().view(ints)) & ~(nan_a & nan_b)
    return int(bits.sum())


def check_silu_mul(small: bool, tag: dict) -> bool:
    """silu_mul against torch's F.silu(gate) * up, gate and up the halves of one [T, 2I] projection: the 1B MLP
    shape (T = 8,192 tokens, the score budget), every 16-bit gate value (a [256, 256] tensor against random up),
    and the mean time of 20 launches of each form after a warm-up. One JSON line."""
    import numpy as np
    import torch

    from apcscore.kernels.silu_mul import silu_mul
    from apcscore.kernels.silu_mul_torch import silu_mul_reference

    inter = llama_config("llama-3.2-1b", small).intermediate_size
    tokens, device, reps = (16, "cpu", 2) if small else (8192, "cuda", 20)
    if small:  # the interpreter's exp is numpy's: its rounding points, not torch's own kernels, are checked
        def torch_form(g, u):
            return silu_mul_reference(g, u, lambda x: torch.from_numpy(np.exp(x.numpy())))
    else:
        def torch_form(g, u):
            return torch.nn.functional.silu(g) * u

    def mean_ms(fn) -> float:
        fn()
        if device == "cpu":
            return rounded(median_time(fn, reps) * 1e3)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return rounded(start.elapsed_time(end) / reps)

    gen = torch.Generator(device).manual_seed(45)
    row: dict[str, Any] = {**tag, "check": "silu_mul", "shape": [tokens, inter], "differing_vs_torch": {},
                           "every_16_bit_gate_value_differing": {}, "fused_ms": {}, "torch_ms": {}, "speedup": {}}
    with np.errstate(over="ignore", invalid="ignore"):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            name = str(dtype).removeprefix("torch.")
            fused = (4 * torch.randn(tokens, 2 * inter, generator=gen, device=device)).to(dtype)
            gate, up = fused.split(inter, dim=-1)
            row["differing_vs_torch"][name] = differing_bits(silu_mul(gate, up), torch_form(gate, up))
            if dtype != torch.float32:
                every = torch.arange(-2**15, 2**15, dtype=torch.int32, device=device).to(torch.int16)
                g16 = every.view(dtype).reshape(256, 256)
                u16 = (3 * torch.randn(256, 256, generator=gen, device=device)).to(dtype)
                row["every_16_bit_gate_value_differing"][name] = differing_bits(silu_mul(g16, u16),
                                                                                torch_form(g16, u16))
            row["fused_ms"][name] = mean_ms(partial(silu_mul, gate, up))
            row["torch_ms"][name] = mean_ms(partial(torch_form, gate, up))
            row["speedup"][name] = rounded(row["torch_ms"][name] / row["fused_ms"][name], 3)
            del fused, gate, up
    row["ok"] = not any(row["differing_vs_torch"].values()) and not any(
        row["every_16_bit_gate_value_differing"].values())
    row["compared_with"] = ("silu_mul_reference, numpy's exp (interpreter)" if small
                            else "torch.nn.functional.silu(gate) * up on CUDA")
    emit(row)
    return row["ok"]


def part_tax(args) -> None:
    """Invariance tax on the 1B shape: score (K=5, 64..2048 tokens) and generate (shared 1,024-token prefix,
    64 greedy tokens) with the invariant engine and with --no-batch-invariant, medians of 3, interleaved."""
    small = args.small
    cfg, state, precision, backend, device, _ = engine_and_state("llama-3.2-1b", small)
    engines = {inv: make_engine(cfg, state, device, precision, backend, batch_invariant=inv)
               for inv in (True, False)}
    params = matmul_params(engines[True])
    prompts, gen_prompts = score_workload(cfg.vocab_size, small), generate_workload(cfg.vocab_size, small)
    n_prompts, n_gen, (_, prefix, _, new) = len(prompts), len(gen_prompts), GENERATE_SHAPE[small]
    tokens = sum(len(p) for p in prompts)
    reps = 1 if small else 3
    for eng in engines.values():  # compile, pick cuBLAS kernels, fill the prefix cache: outside the timing
        engine_score(eng, prompts[:4], K)
        engine_generate(eng, gen_prompts[:4], 4)
    row: dict[str, Any] = {"part": "tax", "model": "llama-3.2-1b-" + ("tiny" if small else "shape"),
                           "dtype": precision, "backend": backend, "score_prompts": n_prompts,
                           "score_tokens": tokens, "k": K, "generate_prompts": n_gen, "shared_prefix": prefix,
                           "new_tokens_each": new, "repeats": reps}
    times: dict[str, dict[bool, list[float]]] = {"score": {True: [], False: []}, "generate": {True: [], False: []}}
    for _ in range(reps):  # interleaved, so drift in clocks hits both sides alike
        for inv, eng in engines.items():
            times["score"][inv].append(median_time(lambda: engine_score(eng, prompts, K), 1))
            times["generate"][inv].append(median_time(lambda: engine_generate(eng, gen_prompts, new), 1))
    for task, by in times.items():
        for inv, ts in by.items():
            secs = sorted(ts)[len(ts) // 2]
            side = "invariant" if inv else "library"
            row[f"{task}_s_{side}"] = rounded(secs)
            if task == "score":
                row[f"score_tokens_per_s_{side}"] = round(tokens / secs)
                row[f"score_mfu_{side}"] = mfu(params, tokens, secs)
            else:
                row[f"generate_tokens_per_s_{side}"] = round(n_gen * new / secs)
        row[f"{task}_ratio"] = rounded(row[f"{task}_s_invariant"] / row[f"{task}_s_library"], 3)
    emit(row)
