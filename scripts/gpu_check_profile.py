"""GPU check part `profile`: where the time of the 1B shape's score and generate workloads goes, kernel by kernel.

Run 2 (2026-12-04) measured invariant scoring on the Llama-3.2-1B shape at 31% MFU and --no-batch-invariant
(cuBLAS) at 32%: the GEMMs are not what keeps it from issue 28's 50%. This part runs the tax's workloads (score:
128 prompts of 64..2048 tokens at K=5; generate: 256 prompts behind a 1,024-token prefix, 64 greedy tokens) once
each, warm, under torch.profiler with CUDA activity only (no host-side op tracing, so the host is timed as it
runs), for the invariant engine and the cuBLAS one. One line per (workload, side):

- `wall_s`: the run's wall time under the profiler; `kernel_s`: the union of the kernels' intervals on the GPU;
  `gpu_busy`: their ratio (what is left is the GPU waiting for the host: scheduling, input staging, syncs);
- `groups_s`: kernel time by group (matmul Triton / cuBLAS, attention, logprobs and top-K, RMSNorm, rotary, KV
  store, copies and fills, other torch ops); `top`: the 12 kernels with the most time (name, calls, seconds);
- `by_op`: from a second run with host-side op tracing too (its wall time is not reported), the device time of
  the kernels each torch op launched itself (aten::mul, aten::cat, ...; Triton kernels appear under their own
  names): which line of the model the "other torch ops" come from.

On the CPU (--small) the same plumbing runs with CPU activity (op names, not kernels): it only shows the part works.
"""

from __future__ import annotations

from typing import Any

from gpu_check_common import (GENERATE_SHAPE, emit, engine_and_state, engine_generate, engine_score,
                              generate_workload, make_engine, rounded, score_workload, sync)

K = 5
TOP = 12
# kernel-name fragments -> group (first match wins; names are lower-cased)
GROUPS = (("matmul (triton)", ("_linear_kernel", "_linear_tma_persistent_kernel")),
          ("matmul (cublas)", ("gemm", "nvjet", "cutlass", "xmma", "aten::mm", "aten::addmm", "aten::linear")),
          ("attention", ("paged_attention", "shared_prefix_decode", "flash", "attention")),
          ("logprobs and top-k", ("logprob", "top_k", "topk", "sort", "lse")),
          ("rmsnorm", ("rms_norm",)),
          ("rotary", ("rotary",)),
          ("kv store", ("store_kv",)),
          ("copies and fills", ("memcpy", "memset", "copy", "fill")))


def group_of(name: str) -> str:
    low = name.lower()
    for group, fragments in GROUPS:
        if any(f in low for f in fragments):
            return group
    return "other torch ops"


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (microseconds in), in seconds."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total / 1e6


def profiled(fn, on_cuda: bool) -> dict[str, Any]:
    """Run fn once under torch.profiler; its wall time, the kernels' busy time, time by group and the top kernels."""
    import time

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU
    device_type = DeviceType.CUDA if on_cuda else DeviceType.CPU
    sync()
    with profile(activities=[activity]) as prof:
        t0 = time.perf_counter()
        fn()
        sync()
        wall = time.perf_counter() - t0
    events = [e for e in prof.events() if e.device_type == device_type]
    if not on_cuda:  # CPU ops nest: count the top-level ones (no parent) for the busy time
        events = [e for e in events if e.cpu_parent is None]
    by_name: dict[str, list[float]] = {}
    for e in events:
        calls_and_us = by_name.setdefault(e.name, [0, 0.0])
        calls_and_us[0] += 1
        calls_and_us[1] += e.time_range.end - e.time_range.start
    groups: dict[str, float] = {}
    for name, (_, us) in by_name.items():
        group = group_of(name)
        groups[group] = groups.get(group, 0.0) + us / 1e6
    kernel_s = busy_seconds([(e.time_range.start, e.time_range.end) for e in events])
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:TOP]
    return {"wall_s": rounded(wall), "kernel_s": rounded(kernel_s), "gpu_busy": rounded(kernel_s / wall, 3),
            "kernels": sum(calls for calls, _ in by_name.values()),
            "groups_s": {g: rounded(s) for g, s in sorted(groups.items(), key=lambda kv: -kv[1])},
            "top": [[name[:90], calls, rounded(us / 1e6)] for name, (calls, us) in top]}


def device_time_by_op(fn, on_cuda: bool) -> list[list[Any]]:
    """[op name, calls, seconds] of the TOP torch ops by the device time of the kernels they launched themselves
    (on the CPU: their own CPU time), from one run of fn traced on the host and the device."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    sync()
    with profile(activities=activities) as prof:
        fn()
        sync()

    def own(e) -> float:  # microseconds
        return getattr(e, "self_device_time_total", 0) if on_cuda else e.self_cpu_time_total

    ops = sorted((e for e in prof.key_averages() if own(e) > 0), key=lambda e: -own(e))[:TOP]
    return [[e.key[:90], e.count, rounded(own(e) / 1e6)] for e in ops]


def part_profile(args) -> None:
    small = args.small
    cfg, state, precision, backend, device, _ = engine_and_state("llama-3.2-1b", small)
    prompts, gen_prompts = score_workload(cfg.vocab_size, small), generate_workload(cfg.vocab_size, small)
    new = GENERATE_SHAPE[small][3]
    tag = {"part": "profile", "model": "llama-3.2-1b-" + ("tiny" if small else "shape"), "dtype": precision,
           "backend": backend}
    for invariant in (True, False):  # one engine at a time (freed when profile_side returns)
        profile_side(make_engine(cfg, state, device, precision, backend, batch_invariant=invariant),
                     {**tag, "side": "invariant" if invariant else "library"}, prompts, gen_prompts, new,
                     device == "cuda")


def profile_side(engine, tag: dict[str, Any], prompts: list[list[int]], gen_prompts: list[list[int]], new: int,
                 on_cuda: bool) -> None:
    """The score and generate lines of one engine (warm: compiled, cuBLAS kernels picked, prefix cache filled)."""
    workloads = {"score": (lambda: engine_score(engine, prompts, K), sum(len(p) for p in prompts)),
                 "generate": (lambda: engine_generate(engine, gen_prompts, new), len(gen_prompts) * new)}
    for fn, _ in workloads.values():
        fn()
    for task, (fn, tokens) in workloads.items():
        emit({**tag, "task": task, "tokens": tokens, **profiled(fn, on_cuda), "by_op": device_time_by_op(fn, on_cuda)})
