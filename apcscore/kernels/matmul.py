"""Triton kernel: a batch-invariant linear layer, y = x @ w.T, in one fixed configuration per weight shape.

Why: cuBLAS picks its kernel, tile shape and split-K from the row count M, so a row's result depends on how
many other rows share the call. Here every output tile [BLOCK_M, BLOCK_N] is computed by one program that
walks the whole K dimension in BLOCK_K steps, in the same order, with the same instruction, whatever M is:
row i of y depends on row i of x and on w alone. M only changes the size of the grid (and it is never
specialised on: `do_not_specialize`), so the bits of a row cannot depend on the batch. The configuration
(block sizes, warps, stages, and whether the tiles are fetched by TMA in a persistent kernel) comes from
kernels/matmul_configs.py, chosen by (device capability, dtype, N, K) and never by M.

Accumulation is fp32; the output dtype is the caller's choice (fp32 logits from bf16 weights: the LM head
of every logprob path). fp32 inputs use IEEE fp32 products (no TF32).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from apcscore.kernels._checks import check_float_input, check_tensors
from apcscore.kernels.matmul_configs import MatmulConfig, config_for

_properties_of_index = functools.cache(torch.cuda.get_device_properties)


def _cuda_properties(device: torch.device) -> torch._C._CudaDeviceProperties:
    """A CUDA device's properties, read once per device (every linear call asks for them)."""
    return _properties_of_index(device.index if device.index is not None else torch.cuda.current_device())


def capability_of(device: torch.device) -> str:
    """matmul_configs' capability key of a device: "sm<major><minor>" on CUDA, "cpu" (the interpreter)."""
    if device.type != "cuda":
        return device.type
    properties = _cuda_properties(device)
    return f"sm{properties.major}{properties.minor}"


def weight_config(weight: torch.Tensor) -> MatmulConfig:
    """The configuration invariant_linear runs for `weight` [N, K]: matmul_configs' entry for its device,
    dtype and shape (never a row count)."""
    n, k = weight.shape
    return config_for(capability_of(weight.device), str(weight.dtype).removeprefix("torch."), n, k)


@triton.jit
def _tile_position(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of output tile `tile`, in grouped order: GROUP_M row tiles share a column sweep
    (L2 reuse of w). Where a tile is computed, never how: it does not touch the arithmetic."""
    group = tile // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % (GROUP_M * num_n)) % size_m
    pid_n = (tile % (GROUP_M * num_n)) // size_m
    return pid_m, pid_n


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr):
    pid_m, pid_n = _tile_position(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    ks = tl.arange(0, BLOCK_K)  # [BK]
    x_tile = x_ptr + rows[:, None] * stride_xm + ks[None, :]  # [BM, BK]
    w_tile = w_ptr + cols[None, :] * stride_wn + ks[:, None]  # [BK, BN] (w is [N, K]: read transposed)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = (k0 + ks) < K
        x = tl.load(x_tile, mask=(rows[:, None] < M) & kmask[None, :], other=0.0)
        w = tl.load(w_tile, mask=kmask[:, None] & (cols[None, :] < N), other=0.0)
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
        x_tile += BLOCK_K
        w_tile += BLOCK_K
    y = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit(do_not_specialize=["M"])
def _linear_tma_persistent_kernel(x_desc, w_desc, y_desc, M, N, K, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                                  NUM_PROGRAMS: tl.constexpr):
    """The same tile arithmetic as _linear_kernel, with TMA loads and stores (tensor descriptors: the copy
    engine fetches each [BLOCK, BLOCK_K] tile, zero-filled past M, N and K, as the masks do) and one program
    per SM that walks the output tiles (NUM_PROGRAMS apart). Which program computes a tile, and how many
    tiles there are (M), changes nothing in how that tile is summed: its K steps, in order, one tl.dot each.
    `flatten` lets the compiler pipeline the tile loop and the K loop as one (the next tile's loads overlap
    this tile's store), as Triton's persistent-matmul tutorial does on Hopper: a schedule, not an order."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_position(tile, num_m, num_n, GROUP_M)
        row, col = pid_m * BLOCK_M, pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = x_desc.load([row, k0])  # [BM, BK]
            w = w_desc.load([col, k0])  # [BN, BK] (w is [N, K])
            if IEEE:
                acc = tl.dot(x, w.T, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w.T, acc)
        y_desc.store([row, col], acc.to(y_desc.dtype))


INTERPRETER_PROGRAMS = 3  # the persistent kernel's program count under the interpreter: several tiles each


def _launch_tma_persistent(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, cfg: MatmulConfig) -> None:
    """out[:M] = x @ weight.T through tensor descriptors; refuses tensors TMA cannot address (16-byte aligned
    bases and row strides) rather than computing them another way, which could sum in another order."""
    # imported here: host tensor descriptors are newer than the Triton this module otherwise needs (>= 3.2)
    from triton.tools.tensor_descriptor import TensorDescriptor

    strides = {}
    for arg, t in (("x", x), ("weight", weight), ("out", out)):
        strides[arg] = t.stride(0) if t.shape[0] > 1 else t.shape[1]  # one row: any stride torch gave it is moot
        if t.data_ptr() % 16 or (strides[arg] * t.element_size()) % 16:
            raise ValueError(f"invariant_linear: a TMA configuration needs 16-byte aligned rows, but {arg} has "
                             f"address {t.data_ptr()} and row stride {t.stride(0)} x {t.element_size()} bytes")
    (m, k), n = x.shape, weight.shape[0]
    x_desc = TensorDescriptor(x, [m, k], [strides["x"], 1], [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor(weight, [n, k], [strides["weight"], 1], [cfg.block_n, cfg.block_k])
    y_desc = TensorDescriptor(out, [m, n], [strides["out"], 1], [cfg.block_m, cfg.block_n])
    programs = (_cuda_properties(x.device).multi_processor_count if x.device.type == "cuda"
                else INTERPRETER_PROGRAMS)  # one per SM
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    _linear_tma_persistent_kernel[(min(programs, tiles),)](
        x_desc, w_desc, y_desc, m, n, k, IEEE=x.dtype == torch.float32, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, NUM_PROGRAMS=programs, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                     config: MatmulConfig | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias) -> [M, N] (out_dtype, default x's), fp32 accumulation, batch-invariant.

    x and weight share a dtype; rows may be strided, the K dimension must be contiguous. `out` ([M, N] or
    more rows, row-contiguous) receives the result if given. The bias is added afterwards, element by element.
    `config` overrides the table's configuration for (device, dtype, N, K) (the GPU check's sweep times
    candidates with it); the engine never passes one.
    """
    name = "invariant_linear"
    check_tensors(name, x=x, weight=weight)
    for arg, t in (("x", x), ("weight", weight)):
        check_float_input(name, arg, t, 2)
    if x.dtype != weight.dtype:
        raise ValueError(f"{name}: x is {x.dtype} but weight is {weight.dtype}; cast one first")
    (m, k), (n, k_w) = x.shape, weight.shape
    if k != k_w:
        raise ValueError(f"{name}: x has {k} columns but weight rows have {k_w}")
    if out is None:
        out = torch.empty(m, n, device=x.device, dtype=out_dtype or x.dtype)
    elif out.dim() != 2 or out.shape[0] < m or out.shape[1] != n or (n > 1 and out.stride(1) != 1):
        raise ValueError(f"{name}: out must be [>={m}, {n}] with contiguous rows, got {tuple(out.shape)}")
    out = out[:m]
    if m == 0:
        return out
    cfg = config or weight_config(weight)  # never M
    if cfg.tma_persistent:
        _launch_tma_persistent(x, weight, out, cfg)
    else:
        grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
        _linear_kernel[grid](x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
                             IEEE=x.dtype == torch.float32, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                             BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
                             num_stages=cfg.num_stages)
    return out if bias is None else out.add_(bias)


# How the reduction order is fixed, as the run metadata records it (numerics.linear; models/ops.linear_construction).
invariant_linear.construction = "Triton matmul, one fixed configuration"  # type: ignore[attr-defined]
# The configuration depends on the weight's shape: a caller that multiplies a slice of a weight as a stand-in for
# the whole (the start-up probe, engine/gemm_probe.py) passes config=invariant_linear.config_for_weight(whole).
invariant_linear.config_for_weight = weight_config  # type: ignore[attr-defined]
