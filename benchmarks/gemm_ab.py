"""A/B of two versions of cpu_gemm.c in one process: alternating calls, one thread, best and median GFLOPS,
with torch's F.linear (MKL / oneDNN) in the same loop; the two must give the same bits.

    git show OLD:apcscore/kernels/cpu_gemm.c > /tmp/a.c; git show NEW:apcscore/kernels/cpu_gemm.c > /tmp/b.c
    .venv/bin/python benchmarks/gemm_ab.py /tmp/a.c /tmp/b.c [--calls 40]

For a busy machine, where whole-process or separate runs cannot tell a 10% kernel change apart: each version
is compiled with the library's own flags (apcscore.kernels.cpu_library) next to its source, then every call
of one is followed by a call of the other at the default model's shapes (benchmarks/gemm_cpu.py's SHAPES).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from apcscore.kernels import cpu_library

SHAPES = [(512, 576, 1536), (512, 1536, 576), (512, 576, 576), (2048, 576, 1536)]  # (M, K, N)


def build(src: Path) -> ctypes.CDLL:
    out = src.with_suffix(".so")
    others = [str(f) for f in cpu_library.SOURCES if f.name != "cpu_gemm.c"]  # the library's other C files
    subprocess.run([*cpu_library.compiler(), *cpu_library.FLAGS, "-I", str(cpu_library.KERNELS), "-o", str(out),
                    str(src), *others, "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    cpu_library._declare(lib)
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--calls", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)
    libs = {"before": build(args.before), "after": build(args.after)}
    for m, k, n in SHAPES:
        x, w = torch.randn(m, k), torch.randn(n, k)
        lib = libs["before"]  # the packed layout is the same in both (checked: equal outputs)
        packed = torch.empty(lib.apc_packed_b_bytes(n, k, 0), dtype=torch.uint8)
        lib.apc_pack_b(w.data_ptr(), 0, n, k, k, 1, packed.data_ptr(), 1)
        ws = torch.empty(lib.apc_workspace_bytes(k, 1), dtype=torch.uint8)
        outs = {name: torch.empty(m, n) for name in libs}

        def gemm(name: str) -> None:
            libs[name].apc_gemm(m, n, k, x.data_ptr(), 0, k, 1, packed.data_ptr(), 0, outs[name].data_ptr(), n,
                                ws.data_ptr(), 1, -1)

        fns = {"before": lambda: gemm("before"), "after": lambda: gemm("after"), "F.linear": lambda: F.linear(x, w)}
        times: dict[str, list[float]] = {name: [] for name in fns}
        for fn in fns.values():
            fn()
        for _ in range(args.calls):
            for name, fn in fns.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        if not torch.equal(outs["before"], outs["after"]):
            raise SystemExit(f"M={m} K={k} N={n}: the two versions give different bits")
        gf = 2 * m * k * n / 1e9
        print(f"M={m} K={k} N={n}: " + " | ".join(f"{name} best {gf / min(t):.0f}, median "
                                                  f"{gf / statistics.median(t):.0f} GFLOPS"
                                                  for name, t in times.items()), flush=True)


if __name__ == "__main__":
    main()
