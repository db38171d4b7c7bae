"""Triton kernel: rotary position embedding of q and k in one launch, bitwise transformers' arithmetic.

The torch form (kernels/rotary_torch.rotary_torch: `x * cos + rotate_half(x) * sin`) is about ten launches per
layer (products, negation, concatenation, sum, for q and k) over tensors of the batch's size (their time against
this kernel's: docs/benchmarks.md, runs 3 and 4). This kernel reads q and k where they lie (strided views of the
fused qkv projection) and writes them rotated and contiguous. It rounds as torch does: each product to the
inputs' dtype, then their sum (with fp-contraction off, so that in fp32 a product and the sum are not fused into
one fma), so it gives torch's bits, on any batch, row by row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from apcscore.kernels._checks import FLOAT_DTYPES, check_dtype, check_shape, check_tensors
from apcscore.kernels.rotary_torch import rotary_torch

BLOCK_H = 4  # heads per step of the kernel's loop


@triton.jit
def _rounded(x, dt: tl.constexpr, IS_BF16: tl.constexpr):
    """fp32 x rounded to dt (to nearest, ties to even), as an fp32 value. bf16 by integer arithmetic on the bits
    (torch's own round_to_nearest_even, NaN kept): the Triton interpreter's fp32 -> bf16 cast truncates, so the
    tests on a CPU would check another rounding than the GPU's cvt.rn; this form is the same on both."""
    if IS_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    else:
        return x.to(dt).to(tl.float32)


@triton.jit
def _rotate_heads(x_ptr, out_ptr, stride_t, stride_h, num_heads, t, c1, c2, s1, s2, d, d_ok,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, IS_BF16: tl.constexpr):
    """Rotate the num_heads heads of token t: x [H, 2 * HALF] (strided) -> out (contiguous [T, H, 2 * HALF])."""
    for h0 in range(0, num_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
        mask = (h < num_heads) & d_ok  # [BLOCK_H, BLOCK_D]
        src = x_ptr + t * stride_t + h * stride_h + d
        f1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        f2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        # torch: x * cos + cat(-x2, x1) * sin, each op rounded to dt (exact products of dt values in fp32)
        dt = out_ptr.dtype.element_ty
        y1 = _rounded(_rounded(f1 * c1, dt, IS_BF16) + _rounded(-f2 * s1, dt, IS_BF16), dt, IS_BF16)
        y2 = _rounded(_rounded(f2 * c2, dt, IS_BF16) + _rounded(f1 * s2, dt, IS_BF16), dt, IS_BF16)
        dst = out_ptr + (t * num_heads + h) * (2 * HALF) + d
        tl.store(dst, y1.to(dt), mask=mask)  # exact: y1 is a dt value
        tl.store(dst + HALF, y2.to(dt), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, stride_qt, stride_qh, stride_kt,
                   stride_kh, stride_ct, stride_st, num_q_heads, num_k_heads, HALF: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, IS_BF16: tl.constexpr):
    """One program per token: its cos/sin row, then every q head and every k head."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D] a position within a half
    d_ok = d < HALF
    c1 = tl.load(cos_ptr + t * stride_ct + d, mask=d_ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_st + d, mask=d_ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_st + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, stride_qt, stride_qh, num_q_heads, t, c1, c2, s1, s2, d, d_ok, HALF, BLOCK_H,
                  IS_BF16)
    _rotate_heads(k_ptr, k_out_ptr, stride_kt, stride_kh, num_k_heads, t, c1, c2, s1, s2, d, d_ok, HALF, BLOCK_H,
                  IS_BF16)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary_torch's result (the same bits) in one launch: q [T, Hq, D], k [T, Hkv, D] (heads and tokens may be
    strided, D contiguous), cos and sin [T, D] in q's dtype -> new contiguous q, k. A partial rotary (cos narrower
    than a head) or tables of another dtype take rotary_torch."""
    name = "rotary"
    check_tensors(name, q=q, k=k, cos=cos, sin=sin)
    check_shape(name, "q", q, 3)
    check_shape(name, "k", k, 3)
    check_dtype(name, "q", q, FLOAT_DTYPES)
    num_tokens, num_q_heads, head_dim = q.shape
    if (cos.shape[-1] != head_dim or cos.dtype != q.dtype or sin.dtype != q.dtype or k.dtype != q.dtype
            or head_dim % 2 or q.stride(2) != 1 or k.stride(2) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1):
        return rotary_torch(q, k, cos, sin)
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or cos.shape != (num_tokens, head_dim) \
            or sin.shape != cos.shape:
        raise ValueError(f"{name}: q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)} and sin "
                         f"{tuple(sin.shape)} do not agree: [T, Hq, D], [T, Hkv, D], [T, D], [T, D]")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens > 0:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](q, k, cos, sin, q_out, k_out, q.stride(0), q.stride(1), k.stride(0),
                                      k.stride(1), cos.stride(0), sin.stride(0), num_q_heads, k.shape[1],
                                      HALF=half, BLOCK_H=BLOCK_H, BLOCK_D=triton.next_power_of_2(half),
                                      IS_BF16=q.dtype == torch.bfloat16, num_warps=4, enable_fp_fusion=False)
    return q_out, k_out
