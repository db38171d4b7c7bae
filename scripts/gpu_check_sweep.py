"""GPU check part `sweep`: the Triton matmul's configuration per (N, K), chosen from a handful of candidates.

For each weight shape (N, K) of the Llama-3.2-1B, Llama-3.1-8B and SmolLM2-135M shapes (in that order: the
most used first, so a part cut short by its limit still has the 1B rows), every candidate of CANDIDATES is
timed at M = 256, 2048 and 8192 (median of CUDA-event timings; a call under 0.2 ms as replays of a CUDA
graph of 20 calls, so that the GPU's time is compared, not the launch's), next to cuBLAS (`F.linear`), and checked
for batch invariance (rows of M = 1, 57, 256 and 2048 against the same rows at M = 8192, bitwise) and for
being right (its first 256 rows against an fp32 product: max error at most 1% of the largest value; a
kernel that is wrong the same way at every M is invariant too). The LM head writes fp32 logits, as in the
engine. The proposal for a shape is the invariant, right candidate with the lowest mean of (its time / the
best candidate's time) over the three M: one configuration for every M, as kernels/matmul_configs.py requires. The part
prints one line per shape and, last, the proposed TABLE rows as Python text to paste into
apcscore/kernels/matmul_configs.py (rows whose proposal is DEFAULT are left out: DEFAULT is the fallback).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gpu_check_common import emit, gemm_shapes, rounded

# Where the orchestrator (gpu_check.py) has the sweep write its proposal, shape by shape, for the later parts
SWEPT_TABLE_ENV = "GPU_CHECK_SWEPT_TABLE"

MODELS = ("llama-3.2-1b", "llama-3.1-8b", "smollm2-135m")
ACCURACY_ROWS = 256  # rows checked against an fp32 product
MAX_RELATIVE_ERROR = 0.01  # max |y - fp32 product| / max |fp32 product|: bf16 rounds by up to 2^-8
MS = (256, 2048, 8192)
CHECK_MS = (1, 57, 256, 2048)  # rows compared bitwise with the same rows at max(MS)


def candidates() -> dict[str, Any]:
    """name -> MatmulConfig: DEFAULT, variations of its block sizes, warps and stages, and TMA persistent ones
    (Hopper: at most 227 KB of shared memory per block: (BM x BK + BK x BN) x 2 bytes per stage in bf16, plus
    BM x BN x the output's bytes for a TMA store; tests/kernels/test_kernels.py compiles each for sm_90 and checks
    it)."""
    from apcscore.kernels.matmul_configs import DEFAULT, MatmulConfig

    c = MatmulConfig
    table = {"default": DEFAULT,
             "128x256x64_w8_s3": c(128, 256, 64, 8, 8, 3), "256x128x64_w8_s3": c(256, 128, 64, 8, 8, 3),
             "128x128x64_w4_s4": c(128, 128, 64, 8, 4, 4), "64x128x64_w4_s4": c(64, 128, 64, 8, 4, 4),
             "tma_128x128x64_w8_s4": c(128, 128, 64, 8, 8, 4, tma_persistent=True),
             "tma_128x256x64_w8_s3": c(128, 256, 64, 8, 8, 3, tma_persistent=True),
             "tma_128x128x64_w4_s4": c(128, 128, 64, 8, 4, 4, tma_persistent=True),
             # smaller tiles: at M = 256 (decode) a 2048-wide GEMM has 32 tiles of 128 x 128 for 132 SMs; in run 2
             # the 1B's qkv, o and down took ~2x cuBLAS's time there, and generation paid a 1.14x tax
             "tma_64x128x64_w4_s4": c(64, 128, 64, 8, 4, 4, tma_persistent=True),
             "tma_128x64x64_w4_s4": c(128, 64, 64, 8, 4, 4, tma_persistent=True),
             "tma_64x64x64_w4_s4": c(64, 64, 64, 8, 4, 4, tma_persistent=True)}
    return table


GRAPHED_BELOW_MS = 0.2  # calls shorter than this (launch included) are timed as replays of a CUDA graph
GRAPH_CALLS = 20  # calls captured in that graph


def time_ms(fn, small: bool) -> tuple[float, str]:
    """(median milliseconds of fn, how it was timed). CUDA events around each call, after two warm-up calls,
    ~30 ms of repeats (3..25). A call shorter than GRAPHED_BELOW_MS is then timed again as a CUDA graph of
    GRAPH_CALLS calls, replayed 5 times: a small kernel is shorter than its launch from Python (descriptors,
    argument checks), and events around one call would time the host; decode runs the GEMMs in graphs, so the
    GPU's time is the one to compare. On the CPU one wall-clock call (the dry run only checks the plumbing)."""
    import time

    import torch

    if small:
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0), "wall clock"
    fn()
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    reps = max(3, min(25, int(30 / max(start.elapsed_time(end), 1e-3))))
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    median = sorted(times)[len(times) // 2]
    if median >= GRAPHED_BELOW_MS:
        return median, "events"
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_CALLS):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        replays = []
        for _ in range(5):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            replays.append(start.elapsed_time(end) / GRAPH_CALLS)
        del graph
        return sorted(replays)[2], "cuda graph"
    except Exception:  # a call that cannot be captured keeps its event timing
        torch.cuda.synchronize()
        return median, "events (capture failed)"


def sweep_shape(n: int, k: int, small: bool, device: str, dtype, out_dtype) -> dict[str, Any]:
    """Times and invariance of every candidate for weight [n, k], writing `out_dtype` as the engine does (fp32
    logits from the LM head); the proposal (see the module doc)."""
    import torch
    import torch.nn.functional as F

    from apcscore.kernels.matmul import invariant_linear

    ms = (16, 48, 96) if small else MS
    check_ms = (1, 7, 48) if small else CHECK_MS
    gen = torch.Generator(device=device).manual_seed(n * 31 + k)
    weight = (torch.randn(n, k, generator=gen, device=device) * k ** -0.5).to(dtype)  # [N, K]
    x = torch.randn(max(ms), k, generator=gen, device=device).to(dtype)  # [max M, K]
    row: dict[str, Any] = {"ms": {}, "invariant": {}, "relative_error": {}, "errors": {}, "timing": {}}
    exact = F.linear(x[:ACCURACY_ROWS].float(), weight.float())  # [rows, N] fp32: is a candidate right at all?

    def timed(name: str, fn) -> dict[int, float]:
        result = {m: time_ms(lambda: fn(m), small) for m in ms}
        row["timing"][name] = sorted({how for _, how in result.values()})
        return {m: rounded(t) for m, (t, _) in result.items()}

    # cuBLAS as a user would get this output: bf16, or for the LM head bf16 logits cast to fp32 (transformers)
    row["cublas_ms"] = timed("cublas", lambda m: F.linear(x[:m], weight).to(out_dtype))
    for name, cfg in candidates().items():
        try:
            full = invariant_linear(x, weight, out_dtype=out_dtype, config=cfg)  # [max M, N]
            bad = {m: int((invariant_linear(x[:m], weight, out_dtype=out_dtype, config=cfg) != full[:m])
                           .any(dim=1).sum())
                   for m in check_ms}
            row["invariant"][name] = not any(bad.values())
            row["relative_error"][name] = rounded(float((full[:ACCURACY_ROWS].float() - exact).abs().max()
                                                        / exact.abs().max()), 3)
            row["ms"][name] = timed(name, lambda m: invariant_linear(x[:m], weight, out_dtype=out_dtype,
                                                                     config=cfg))
        except Exception as e:  # out of shared memory / registers: that candidate is out, the sweep goes on
            row["errors"][name] = f"{type(e).__name__}: {str(e)[:200]}"
    ok = [name for name in row["ms"] if row["invariant"][name]
          and row["relative_error"][name] <= MAX_RELATIVE_ERROR]  # invariant and right
    if not ok:
        row["proposed"] = None
        return row
    best = {m: min(row["ms"][name][m] for name in ok) for m in ms}
    score = {name: sum(row["ms"][name][m] / best[m] for m in ms) / len(ms) for name in ok}
    proposed = min(ok, key=lambda name: (score[name], name != "default"))
    row.update(proposed=proposed, proposed_config=vars(candidates()[proposed]),
               mean_time_over_best={name: rounded(v, 3) for name, v in score.items()},
               proposed_over_cublas={m: rounded(row["ms"][proposed][m] / row["cublas_ms"][m], 3) for m in ms},
               default_over_proposed={m: rounded(row["ms"]["default"][m] / row["ms"][proposed][m], 3) for m in ms}
               if "default" in row["ms"] else None)
    return row


def write_table(path: Path, rows: list[list[Any]]) -> None:
    """The proposal so far as JSON rows [capability, dtype, N, K, config fields], replaced atomically (a sweep
    cut short by its limit leaves the shapes it finished)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rows), encoding="utf-8")
    tmp.replace(path)


def swept_table_path() -> Path | None:
    """The file the orchestrator named for the sweep's proposal ($GPU_CHECK_SWEPT_TABLE), if any."""
    path = os.environ.get(SWEPT_TABLE_ENV)
    return Path(path) if path else None


def read_table(path: Path | None) -> list[list[Any]]:
    """The rows write_table wrote ([] where no sweep wrote any)."""
    return json.loads(path.read_text(encoding="utf-8")) if path is not None and path.exists() else []


def apply_swept_table() -> int:
    """In a part after the sweep: the sweep's proposal as matmul_configs.TABLE, so that the part measures the
    table a lease would commit. Where a sweep ran (its file exists, maybe empty), its proposal replaces the
    committed table whole: a shape it proposed DEFAULT for runs DEFAULT, not an older entry. Returns its entries."""
    from apcscore.kernels.matmul_configs import TABLE, MatmulConfig

    path = swept_table_path()
    if path is None or not path.exists():
        return 0
    rows = read_table(path)
    TABLE.clear()
    for capability, dtype, n, k, fields in rows:
        TABLE[(capability, dtype, n, k)] = MatmulConfig(**fields)
    return len(rows)


def part_sweep(args) -> bool:
    """One line per (N, K), then the proposed table; fails when a shape has no invariant candidate."""
    import torch

    from apcscore.kernels.matmul import capability_of

    small = args.small
    device, dtype = ("cpu", torch.float32) if small else ("cuda", torch.bfloat16)
    capability, dtype_name = capability_of(torch.device(device)), str(dtype).removeprefix("torch.")
    seen: set[tuple[int, int]] = set()
    proposals: list[str] = []
    table_rows: list[list[Any]] = []
    table_path = swept_table_path()
    if table_path is not None:
        write_table(table_path, [])  # the sweep ran: its proposal, however short, is the later parts' table
    ok = True
    for model in MODELS:
        for gemm, (n, k) in gemm_shapes(model, small).items():
            if (n, k) in seen:
                continue
            seen.add((n, k))
            out_dtype = torch.float32 if gemm == "lm_head" else dtype  # the engine's logits are fp32
            row = sweep_shape(n, k, small, device, dtype, out_dtype)
            ok &= row["proposed"] is not None
            emit({"part": "sweep", "model": model, "gemm": gemm, "n": n, "k": k, "capability": capability,
                  "dtype": dtype_name, **row})
            if row["proposed"] not in (None, "default"):  # None: no candidate invariant and right
                c = row["proposed_config"]
                proposals.append(f'    ("{capability}", "{dtype_name}", {n}, {k}): MatmulConfig('
                                 f'{c["block_m"]}, {c["block_n"]}, {c["block_k"]}, {c["group_m"]}, '
                                 f'{c["num_warps"]}, {c["num_stages"]}'
                                 f'{", tma_persistent=True" if c["tma_persistent"] else ""}),  # {model} {gemm}')
                table_rows.append([capability, dtype_name, n, k, c])
                if table_path is not None:
                    write_table(table_path, table_rows)
    emit({"part": "sweep", "proposed_table": "TABLE: dict[Key, MatmulConfig] = {\n" + "\n".join(proposals)
          + ("\n" if proposals else "") + "}", "shapes": len(seen), "non_default": len(proposals)})
    return bool(ok)
