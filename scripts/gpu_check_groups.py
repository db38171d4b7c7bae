"""GPU check, `exactness` part: shared-prefix decode groups against today's paged attention, bitwise, and timed.

One decode step's attention on the Llama-3.2-1B shape (32 query heads, 8 KV heads, head_dim 64, bf16, blocks of
16): 256 sequences behind a 1,024-token shared prefix (the cached blocks of the bench's generate workload),
each with its own 1..512 further tokens (the 256 x 512 generation's decode steps). The grouped path
(paged_attention skipping the grouped sequences, then the shared-prefix kernel) must equal paged_attention over
the whole batch bitwise, and a few sequences run alone; docs/architecture.md ("Shared-prefix decode") says why
it should and on which assumption (a tl.dot row depends only on its own row), which this check confirms on the
GPU. Times both (CUDA events, median of 20) per layer and per decode step (x 16 layers), and groups capped at
8 and 4 members (more programs, each walking fewer members' own tiles one after the other: the cap to choose
if the engine's 16 members per group lose parallelism).

--small (the dry run, on the CPU): a tiny shape in fp32, in a subprocess under TRITON_INTERPRET=1 whose tl.dot is
made row-exact as tests/conftest.py makes it (OpenBLAS may round a row by its place in the matrix).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def _row_exact_interpreter_dot() -> None:
    """The interpreter's tl.dot as a fixed-order einsum (tests/conftest.py, _row_exact_interpreter_dot)."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
        product = np.einsum("...mk,...kn->...mn", a.data, b.data, dtype=d.data.dtype, optimize=False)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    builder.create_dot = create_dot


def measure(small: bool) -> dict[str, Any]:
    """Build the step, compare the grouped path with paged_attention bitwise, time both: one result dict."""
    import numpy as np
    import torch

    from apcscore.attention.decode_groups import pack_decode_groups, plan_decode_groups
    from apcscore.kernels.paged_attention import paged_attention, tile_config
    from apcscore.kernels.paged_decode_shared import shared_prefix_decode

    device = "cpu" if small else "cuda"
    dtype = torch.float32 if small else torch.bfloat16
    hq, hkv, d, layers = (4, 2, 16, 2) if small else (32, 8, 64, 16)
    num_seqs, prefix, most_own = (6, 80, 40) if small else (256, 1024, 512)
    bs = 16
    rng = np.random.default_rng(45)
    own = rng.integers(1, most_own + 1, num_seqs)
    lens = (prefix + own).astype(np.int32)
    shared_blocks = prefix // bs
    tables, nxt = [], shared_blocks
    for n in lens:
        blocks = -(-int(n) // bs)
        tables.append(list(range(shared_blocks)) + list(range(nxt, nxt + blocks - shared_blocks)))
        nxt += blocks - shared_blocks
    width = max(map(len, tables))
    host_tables = np.zeros((num_seqs, width), np.int32)
    for i, t in enumerate(tables):
        host_tables[i, :len(t)] = t
    g = torch.Generator(device=device).manual_seed(45)
    k_cache = torch.randn(nxt, bs, hkv, d, generator=g, device=device).to(dtype)
    v_cache = torch.randn(nxt, bs, hkv, d, generator=g, device=device).to(dtype)
    q = torch.randn(num_seqs, hq, d, generator=g, device=device).to(dtype)
    cu = np.arange(num_seqs + 1, dtype=np.int32)
    block_m, block_n, _ = tile_config(d, hq // hkv)
    block_q = block_m // (hq // hkv)
    as_dev = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    bt, cu_t, lens_t = map(as_dev, (host_tables, cu, lens))
    scale = d ** -0.5

    def ungrouped() -> torch.Tensor:
        return paged_attention(q, k_cache, v_cache, bt, cu_t, lens_t, scale)

    want = ungrouped()
    plans = {}  # members per group at most: block_q (the engine's), and fewer (more programs, less sharing)
    for cap in sorted({block_q, min(block_q, 8), min(block_q, 4)}, reverse=True):
        groups = plan_decode_groups(cu, lens, host_tables, bs, block_n, cap)
        table, grouped = pack_decode_groups(groups, num_seqs, block_q)
        plans[cap] = (len(groups), int(grouped.sum()), as_dev(table), as_dev(grouped))

    def grouped_path(cap: int) -> torch.Tensor:
        _, _, table_t, grouped_t = plans[cap]
        out = paged_attention(q, k_cache, v_cache, bt, cu_t, lens_t, scale, skip=grouped_t)
        return shared_prefix_decode(q, k_cache, v_cache, bt, cu_t, lens_t, table_t, out, scale)

    differing, nan, got = {}, False, None
    for cap in plans:
        got = grouped_path(cap)
        differing[f"paged_attention, groups of <= {cap}"] = int((got != want).sum())
        nan |= bool(got.isnan().any())
    alone_bad = 0
    for i in (0, 1, num_seqs // 2, num_seqs - 1):
        one = paged_attention(q[i:i + 1], k_cache, v_cache, bt[i:i + 1], cu_t[:2], lens_t[i:i + 1], scale)
        alone_bad += int((one[0] != got[i]).sum())
    differing["alone (4 sequences)"] = alone_bad
    result = {"check": "shared_prefix_decode", "backend": "triton", "shape": f"{hq}x{hkv}x{d}",
              "dtype": str(dtype).split(".")[-1], "sequences": num_seqs, "shared_prefix": prefix,
              "own_tokens_max": most_own, "groups": plans[block_q][0], "grouped_sequences": plans[block_q][1],
              "differing_vs_today": differing, "nan": nan,
              "ok": plans[block_q][0] > 0 and not any(differing.values()) and not nan}
    if not small:
        times = {"ungrouped": _median_ms(ungrouped)}
        times.update({f"grouped_max{cap}": _median_ms(lambda: grouped_path(cap)) for cap in plans})
        result.update({f"ms_per_layer_{n}": round(t, 4) for n, t in times.items()})
        result["ms_per_step_ungrouped"] = round(times["ungrouped"] * layers, 3)
        result["ms_per_step_grouped"] = round(times[f"grouped_max{block_q}"] * layers, 3)  # the engine's
        result["speedup"] = round(times["ungrouped"] / times[f"grouped_max{block_q}"], 2)
    return result


def _median_ms(fn) -> float:
    """Median CUDA time of fn() over 20 calls, after one warm-up call (compiles)."""
    import torch

    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return sorted(samples)[len(samples) // 2]


def check_shared_prefix_decode(small: bool) -> dict[str, Any]:
    """The check's result; with small, from a subprocess under the Triton interpreter."""
    if not small:
        return measure(False)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=150)
    if proc.returncode != 0:
        return {"check": "shared_prefix_decode", "ok": False, "error": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":  # the --small check's subprocess (TRITON_INTERPRET=1)
    _row_exact_interpreter_dot()
    print(json.dumps(measure(True)))
