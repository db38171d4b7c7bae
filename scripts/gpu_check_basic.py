"""GPU check parts env, tests, compare and bench (see scripts/gpu_check.py for the plan)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from gpu_check_common import (GENERATE_SHAPE, PART_DEADLINE_ENV, PEAK_BF16_FLOPS, ROOT, SCORE_SHAPE, common_prefix,
                              emit, engine_generate, engine_score, generate_workload, hf_generate, hf_score,
                              llama_config, make_engine, matmul_params, mfu, random_hf_model, random_prompts, rounded,
                              score_workload, timed)


def part_env(args) -> bool:
    import importlib.util

    import torch

    info: dict[str, Any] = {"part": "env", "python": sys.version.split()[0], "torch": torch.__version__}
    for mod in ("transformers", "triton", "pytest"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as e:  # report, do not fail: the other parts say what they need
            info[mod] = f"unavailable: {type(e).__name__}"
    for mod in ("datasets", "gguf"):  # the repo's own datasets/ folder is a namespace package, not the library
        spec = importlib.util.find_spec(mod)
        info[f"has_{mod}"] = spec is not None and spec.origin not in (None, "namespace")
    info["cuda"] = torch.cuda.is_available()
    if info["cuda"]:
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        info.update(device=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gib=round(total / 2**30, 1), free_gib=round(free / 2**30, 1))
    t0 = time.perf_counter()
    import apcscore.engine.cuda_graphs  # noqa: F401
    import apcscore.engine.engine  # noqa: F401
    import apcscore.models.ops

    apcscore.models.ops.select_ops("triton")  # the attention backend and every Triton kernel it uses

    info["apcscore_import_s"] = round(time.perf_counter() - t0, 2)
    info["apcscore_loaded_datasets_or_gguf"] = sorted(m for m in ("datasets", "gguf") if sys.modules.get(m))
    info["ok"] = not info["apcscore_loaded_datasets_or_gguf"]
    emit(info)
    return info["ok"]


PYTEST_GRACE_S = 8  # after SIGINT, pytest's time to finish the test it is in and print its summary
EMIT_MARGIN_S = 4  # then the part's time to report before its own limit
OUTCOMES = "PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS"
TEST_OUTCOME = re.compile(rf"^(?!(?:{OUTCOMES}) )(\S.*?::\S.*?) ({OUTCOMES})\b")  # -v's line; not -r's summary


def run_pytest(pytest_args: list[str], cwd, env: dict[str, str], stop_after_s: float | None) -> dict[str, Any]:
    """pytest -v PYTEST_ARGS in its own process group, its output echoed to stderr as it comes. After
    `stop_after_s` seconds it gets SIGINT (a Ctrl-C: pytest ends the test it is in and prints its summary), and
    PYTEST_GRACE_S later SIGKILL. So a run cut short still reports every test that finished: the counts are
    taken from pytest's per-test lines, not from a summary that may never come. Returns the counts by outcome,
    the failed and errored tests, the slowest durations, the tracebacks, rc and whether it was interrupted."""
    cmd = [sys.executable, "-m", "pytest", "-v", *pytest_args]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own group: the SIGINT is pytest's alone
    interrupted = threading.Event()

    def kill_group() -> None:  # pytest and what its tests started
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def stop() -> None:
        interrupted.set()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=PYTEST_GRACE_S)
        except subprocess.TimeoutExpired:
            kill_group()

    def terminated(signum, frame) -> None:  # this part killed after all: its own group is not pytest's
        kill_group()
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminated)
    timer = threading.Timer(max(stop_after_s, 0.0), stop) if stop_after_s is not None else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    lines, outcomes = [], {}
    try:
        for line in proc.stdout:  # echoed as it comes: a part killed all the same still shows where
            lines.append(line.rstrip("\n"))
            print(line, end="", file=sys.stderr, flush=True)
            match = TEST_OUTCOME.match(line)
            if match:
                outcomes[match.group(1)] = match.group(2)
        rc = proc.wait()
    finally:
        if timer is not None:
            timer.cancel()
        kill_group()  # nothing of the run outlives it
        signal.signal(signal.SIGTERM, previous)
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        key = {"ERROR": "errors"}.get(outcome, outcome.lower())
        counts[key] = counts.get(key, 0) + 1
    last = next((ln for ln in reversed(lines) if ln.strip()), "")
    deselected = re.search(r"(\d+) deselected", last)
    if deselected:
        counts["deselected"] = int(deselected.group(1))
    text = "\n".join(lines)
    failures = text[text.find("= FAILURES ="):text.find("short test summary")] if "= FAILURES =" in text else ""
    return {"rc": rc, "interrupted": interrupted.is_set(), "seconds": round(time.perf_counter() - t0, 1), **counts,
            "failed_tests": [f"{outcome} {test}" for test, outcome in outcomes.items()
                             if outcome in ("FAILED", "ERROR")][:30],
            # modules this machine cannot import (e.g. hypothesis absent): collection errors, reported, not fatal
            "collection_errors": [ln for ln in lines if ln.startswith("ERROR") and "::" not in ln][:20],
            "slowest": [ln.strip() for ln in lines if re.match(r"\s*\d+\.\d+s (call|setup)", ln)][:8],
            "tracebacks": failures[:12000]}


def part_tests(args) -> bool:
    """pytest -m "gpu or triton"; one JSON line with the counts and the failures. Stopped before the part's
    deadline, so that a run longer than the part's limit still reports the tests it finished."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    deadline = os.environ.get(PART_DEADLINE_ENV)
    stop_after = float(deadline) - time.time() - PYTEST_GRACE_S - EMIT_MARGIN_S if deadline else None
    result = run_pytest(["-m", "gpu or triton", "-rfE", "--tb=short", "-p", "no:cacheprovider",
                         "--continue-on-collection-errors", "--durations=8"], ROOT, env, stop_after)
    ok = (not result["failed_tests"] and not result["interrupted"] and result["rc"] in (0, 1)
          and (result.get("passed", 0) > 0 or args.small))
    emit({"part": "tests", **result, "ok": ok})
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
    params = matmul_params(engine)
    graphs = engine.runner.cuda_graphs
    emit({**base, "task": "setup", "params": engine.info.num_parameters, "mfu_params": params,
          "seconds": round(time.perf_counter() - t0, 1),
          "cuda_graph_sizes": graphs.sizes if graphs is not None else None,
          "engine_config": engine.config.to_dict()})

    # -- scoring: K=5, lengths log-uniform in 64..2048
    k = 5
    n_prompts, lo, hi = SCORE_SHAPE[small]
    prompts = score_workload(cfg.vocab_size, small)
    warm = random_prompts([lo, hi, (lo + hi) // 2], cfg.vocab_size, seed=3)
    engine_score(engine, warm, k)  # Triton compiles and cuBLAS picks its kernels outside the timing
    hf_score(hf, warm, k, budget=8192)
    tokens = sum(len(p) for p in prompts)
    ours, t_ours = timed(lambda: engine_score(engine, prompts, k))
    theirs, t_hf = timed(lambda: hf_score(hf, prompts, k, budget=8192))
    for side, secs in (("apcscore", t_ours), ("transformers", t_hf)):
        emit({**base, "task": "score", "side": side, "prompts": n_prompts, "tokens": tokens, "k": k,
              "seconds": round(secs, 3), "tokens_per_s": round(tokens / secs), "mfu": mfu(params, tokens, secs),
              "mfu_peak_flops": PEAK_BF16_FLOPS})
    d = np.concatenate([np.abs(o.token_logprobs - t[0]) for o, t in zip(ours, theirs)])
    top1 = np.concatenate([o.top_ids[:, 0] == t[1][:, 0] for o, t in zip(ours, theirs)])
    emit({**base, "task": "score", "speedup_vs_transformers": round(t_hf / t_ours, 2),
          "agreement": {"mean_abs_logprob_diff": rounded(d.mean()), "max_abs_logprob_diff": rounded(d.max()),
                        "top1_agree": rounded(top1.mean())}})

    # -- generation: 256 prompts sharing a 1,024-token prefix (+ 32 own tokens), 64 greedy tokens each
    n_gen, prefix, own, new = GENERATE_SHAPE[small]
    gen_prompts = generate_workload(cfg.vocab_size, small)
    warm = random_prompts([own] * 4, cfg.vocab_size, seed=5, prefix=prefix)  # another prefix: no cache hits
    engine_generate(engine, warm, 4)
    hf_generate(hf, warm, 4, batch_size=4)
    hits0, replays0 = engine.block_manager.stats.hit_tokens, graphs.num_replays if graphs is not None else 0
    ours, t_ours = timed(lambda: engine_generate(engine, gen_prompts, new))
    hits = engine.block_manager.stats.hit_tokens - hits0  # the timed run's, not the warm-up's
    theirs, t_hf = timed(lambda: hf_generate(hf, gen_prompts, new, batch_size=n_gen))
    replays = graphs.num_replays - replays0 if graphs is not None else 0
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
