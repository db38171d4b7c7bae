"""Batch-invariant linear layers through torch: the CPU's construction (and the fallback off the fast path).

Why: a BLAS library picks its kernel and blocking from the row count M, so a row's result can depend on how
many other rows share the call. Measured on torch 2.13 CPU (oneDNN/MKL, fp32 and bf16, every projection of
the default model and of Llama-3.2-1B, M = 1..8192): a row gets other bits below 16 rows and at many M that
are not multiples of 16 (57..191, ...), but every M that *is* a multiple of 16 gives each row exactly the
bits it gets inside any other such M. So rows are padded to a multiple of ROW_TILE, which costs at most 15
padding rows, and the engine pads each step to that multiple anyway (then nothing is copied here).
tests/engine/test_invariance.py checks the property on the real shapes, so a torch or BLAS upgrade that breaks it
fails CI instead of silently changing scores. The thread count (1 or 2) does not change these bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_TILE = 16  # rows of every GEMM are padded to a multiple of this


def padded_rows(m: int) -> int:
    """The row count a GEMM of m rows runs with: m rounded up to a multiple of ROW_TILE (at least one tile)."""
    return max(ROW_TILE, -(-m // ROW_TILE) * ROW_TILE)


def invariant_linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias) -> [M, N], each row's bits independent of M (see the module doc).

    The GEMM runs on padded_rows(M) rows (x is copied only when M is not already such a multiple); the bias
    is added afterwards, element by element. `out` [padded_rows(M), N] receives the GEMM when given (a reused
    buffer); the result is then a view of it. x and weight share a dtype (cast before calling).
    """
    m = x.shape[0]
    rows = padded_rows(m)
    if rows != m:
        x = F.pad(x, (0, 0, 0, rows - m))
    y = (F.linear(x, weight) if out is None else torch.mm(x, weight.t(), out=out))[:m]
    return y if bias is None else y + bias


# how the reduction order is fixed, as the run metadata records it (numerics.linear; models/ops.linear_construction)
invariant_linear_torch.construction = (  # type: ignore[attr-defined]
    "library GEMM on rows padded to 16 (probed, not by construction)")


def plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """The fast path without the invariance guarantee (`--no-batch-invariant`): one library GEMM."""
    if out is None:
        return F.linear(x, weight, bias)
    y = torch.mm(x, weight.t(), out=out[:x.shape[0]])
    return y if bias is None else y + bias


plain_linear.construction = "library GEMM (not batch-invariant)"  # type: ignore[attr-defined]


def library_logits(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The LM head without the invariance guarantee on CUDA (`--no-batch-invariant`): x [M, K] @ weight[N, K].T
    -> fp32 [M, N] in one cuBLAS GEMM. Half-precision inputs write fp32 logits straight from the fp32
    accumulator (torch.mm's out_dtype, CUDA only: pytorch/pytorch#150812), as the Triton matmul does on the
    invariant path, so `--no-batch-invariant` changes the GEMM and not the logits' precision. `out` (fp32,
    rows >= M) receives them when given."""
    out_dtype = {} if weight.dtype == torch.float32 else {"out_dtype": torch.float32}
    return torch.mm(x, weight.t(), **out_dtype, out=None if out is None else out[:x.shape[0]])
