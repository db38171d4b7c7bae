"""The Triton matmul's configuration per shape: (device capability, dtype, N, K) -> block sizes, warps, stages.

Why per shape and never per row count: a configuration fixes the order in which a row's products are summed
(BLOCK_K steps, the dot instruction), so the bits of a row depend on it. Choosing it from (N, K), the weight's
shape, keeps a row's bits independent of M, the number of rows in the call (what batch invariance means);
choosing it from M would bring back exactly what cuBLAS does. `config_for` therefore takes no M, and
`invariant_linear` never specialises its kernel on M.

Entries come from the sweep of `scripts/gpu_check.sh` (part `sweep`), which times a handful of configurations
at M = 256, 2048 and 8192 for each (N, K) of the SmolLM2-135M, Llama-3.2-1B and Llama-3.1-8B shapes and prints
the proposed rows of TABLE. A shape not in the table gets DEFAULT. Changing an entry changes the bits of that
shape's GEMM (a new invariance contract for it), so entries change only with a measured reason.

Capability keys are "sm<major><minor>" for CUDA ("sm90": H100/H200) and "cpu" for the Triton interpreter.
Leaf module: imports nothing (no torch, no Triton).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MatmulConfig:
    """One launch configuration of kernels/matmul.py's `_linear_kernel`."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8  # row tiles sharing a column sweep (L2 reuse of the weight); does not touch the arithmetic
    num_warps: int = 8
    num_stages: int = 3
    # TMA tile loads and one program per SM walking the tiles (`_linear_tma_persistent_kernel`; Hopper and
    # newer, 16-byte aligned rows): another kernel, so another entry's bits, never chosen by M either
    tma_persistent: bool = False


# The configuration of every shape before the table existed (run 1 on the H200: invariant for every M,
# 1.4-1.5x cuBLAS's time per GEMM at M=4096).
DEFAULT = MatmulConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)

Key = tuple[str, str, int, int]  # (capability, dtype name, N, K): no M, by construction

# (capability, dtype, N, K) -> configuration: the sweep of GPU check run 3 (H200, 2026-12-04,
# docs/gpu_runs/2026-12-04-h200-run3.jsonl; 11 candidates), the lowest mean time over the best candidate at
# M = 256, 2048, 8192 among those invariant across M and right against an fp32 product. Run 2's sweep (8
# candidates) proposed the same except the 8B's gate_up (128 x 128, 8 warps, 4 stages: 1.08x this one's time).
# With this table run 3's exactness part was bitwise in every check. Shapes not listed run DEFAULT.
TABLE: dict[Key, MatmulConfig] = {
    ("sm90", "bfloat16", 3072, 2048): MatmulConfig(128, 128, 64, 8, 4, 4, tma_persistent=True),  # llama-3.2-1b qkv
    ("sm90", "bfloat16", 2048, 2048): MatmulConfig(128, 128, 64, 8, 4, 4, tma_persistent=True),  # llama-3.2-1b o
    ("sm90", "bfloat16", 16384, 2048): MatmulConfig(128, 256, 64, 8, 8, 3, tma_persistent=True),  # llama-3.2-1b gate_up
    ("sm90", "bfloat16", 2048, 8192): MatmulConfig(128, 128, 64, 8, 4, 4, tma_persistent=True),  # llama-3.2-1b down
    # llama-3.2-1b lm_head
    ("sm90", "bfloat16", 128256, 2048): MatmulConfig(128, 128, 64, 8, 4, 4, tma_persistent=True),
    ("sm90", "bfloat16", 6144, 4096): MatmulConfig(128, 128, 64, 8, 4, 4, tma_persistent=True),  # llama-3.1-8b qkv
    ("sm90", "bfloat16", 4096, 4096): MatmulConfig(128, 128, 64, 8, 4, 4, tma_persistent=True),  # llama-3.1-8b o
    ("sm90", "bfloat16", 28672, 4096): MatmulConfig(128, 256, 64, 8, 8, 3, tma_persistent=True),  # llama-3.1-8b gate_up
    ("sm90", "bfloat16", 4096, 14336): MatmulConfig(128, 128, 64, 8, 4, 4, tma_persistent=True),  # llama-3.1-8b down
    # llama-3.1-8b lm_head
    ("sm90", "bfloat16", 128256, 4096): MatmulConfig(128, 128, 64, 8, 4, 4, tma_persistent=True),
    ("sm90", "bfloat16", 960, 576): MatmulConfig(128, 128, 64, 8, 4, 4, tma_persistent=True),  # smollm2-135m qkv
    ("sm90", "bfloat16", 576, 576): MatmulConfig(128, 128, 64, 8, 4, 4, tma_persistent=True),  # smollm2-135m o
    ("sm90", "bfloat16", 3072, 576): MatmulConfig(128, 128, 64, 8, 4, 4, tma_persistent=True),  # smollm2-135m gate_up
    ("sm90", "bfloat16", 576, 1536): MatmulConfig(128, 128, 64, 8, 4, 4, tma_persistent=True),  # smollm2-135m down
    ("sm90", "bfloat16", 49152, 576): MatmulConfig(128, 128, 64, 8, 4, 4, tma_persistent=True),  # smollm2-135m lm_head
}


def config_for(capability: str, dtype: str, n: int, k: int) -> MatmulConfig:
    """The configuration of a GEMM with weight [n, k] in `dtype` ("bfloat16", "float16", "float32") on a device
    of `capability` ("sm90", "cpu"): TABLE's entry, else DEFAULT. Deliberately no row-count argument."""
    return TABLE.get((capability, dtype, n, k), DEFAULT)
