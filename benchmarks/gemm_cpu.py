"""Microbenchmark: the fixed-order CPU GEMM (each micro-kernel) against torch's own linear (MKL / oneDNN).

    .venv/bin/python benchmarks/gemm_cpu.py

The default model's shapes (x [M, K] @ w[N, K].T, fp32), median of 7 calls after a warm-up, torch's threads.
Also checks that every micro-kernel this CPU has gives the same bits (scalar is left out: it is slow).
"""

from __future__ import annotations

import time

import torch

from apcscore.kernels.cpu_gemm import SIMD_NAMES, FixedOrderLinear, library

SHAPES = [(512, 576, 1536), (512, 1536, 576), (512, 576, 576), (2048, 576, 1536)]  # (M, K, N)


def median_seconds(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2]


def main() -> None:
    best = library().apc_simd_level()
    kernels = {SIMD_NAMES[level]: FixedOrderLinear(simd=level) for level in range(1, best + 1)}
    print(f"torch threads {torch.get_num_threads()}; micro-kernels: {', '.join(kernels)}")
    for m, k, n in SHAPES:
        x, w = torch.randn(m, k), torch.randn(n, k)
        outs = [lin(x, w) for lin in kernels.values()]
        assert all(torch.equal(outs[0], o) for o in outs), "micro-kernels differ"
        flops = 2 * m * k * n
        line = [f"M={m} K={k} N={n}:"]
        ref = median_seconds(lambda: torch.nn.functional.linear(x, w))
        for name, lin in kernels.items():
            sec = median_seconds(lambda: lin(x, w))
            line.append(f"{name} {flops / sec / 1e9:.0f} GFLOPS ({sec / ref:.2f}x torch)")
        line.append(f"torch {flops / ref / 1e9:.0f} GFLOPS")
        print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()
