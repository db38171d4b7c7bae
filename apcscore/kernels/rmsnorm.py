"""Triton kernel: RMSNorm with Hugging Face LlamaRMSNorm semantics, optionally fused with the residual add.

    h = x.float(); h = h * rsqrt(mean(h^2) + eps); out = weight * h.to(x.dtype)

With a residual, x = x + residual first (in x's dtype, like the decoder layer does) and that sum is also
returned as the new residual, like vLLM's fused_add_rms_norm (but out of place).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from apcscore.kernels._checks import check_float_input, check_tensors

MAX_HIDDEN = 65536  # one row lives in one program


@triton.jit
def _rms_norm_kernel(out_ptr, res_out_ptr, x_ptr, res_ptr, w_ptr, stride_x, stride_r, stride_o, stride_ro,
                     hidden, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # rounded like torch's x + r
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, 0) / hidden
    h = h * tl.math.rsqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    # weight * h.to(x.dtype), in the promoted dtype: one product of two exact values, rounded once.
    y = h.to(x_ptr.dtype.element_ty).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of each row of x: [T, H] -> [T, H] in promote(x.dtype, weight.dtype), fp32 statistics.

    weight: [H]. With residual ([T, H], x's dtype): returns (rms_norm(x + residual), x + residual); the
    inputs are not modified. Rows may be strided; the hidden dimension must be contiguous.
    """
    name = "rms_norm"
    tensors = {"x": x, "weight": weight} | ({"residual": residual} if residual is not None else {})
    check_tensors(name, **tensors)
    for arg, t in tensors.items():
        check_float_input(name, arg, t, 1 if arg == "weight" else 2)
    num_rows, hidden = x.shape
    if weight.shape[0] != hidden:
        raise ValueError(f"{name}: weight has {weight.shape[0]} entries for rows of {hidden}")
    if hidden > MAX_HIDDEN:
        raise ValueError(f"{name}: hidden size {hidden} is above the supported {MAX_HIDDEN}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"{name}: residual {tuple(residual.shape)} {residual.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype}")
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    new_residual = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    if num_rows > 0:
        block = triton.next_power_of_2(hidden)
        res = residual if residual is not None else x
        res_out = new_residual if new_residual is not None else out
        _rms_norm_kernel[(num_rows,)](
            out, res_out, x, res, weight, x.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
            hidden, float(eps), HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=min(max(block // 256, 1), 16),
        )
    return (out, new_residual) if new_residual is not None else out
