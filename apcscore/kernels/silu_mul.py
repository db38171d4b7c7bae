"""Triton kernel: the Llama MLP's `silu(gate) * up` in one launch, with the bits of torch's two CUDA kernels.

torch computes F.silu(gate) * up on CUDA as two elementwise kernels (0.054 s of the 1B shape's 0.386 s of scoring
kernels on the H200, docs/gpu.md): SiLU reads gate and writes s, the product reads s and up. This kernel reads gate
and up where they lie (the two halves of the fused gate/up projection, strided rows) and writes the product once.

It rounds where torch does (PyTorch's source, read for this kernel):
- aten/src/ATen/native/cuda/ActivationSiluKernel.cu, silu_kernel: `x_acc / (opmath_t(1) +
  c10::cuda::compat::exp(-x_acc))` with opmath_t = float for half, bfloat16 and float, returned as scalar_t (the
  SiLU rounded to the tensor's dtype); c10/cuda/CUDAMathCompat.h: compat::exp(float) is `::expf`, CUDA's accurate
  expf (libdevice's __nv_expf), and PyTorch is built without fast math, so `/` is the IEEE division.
- aten/src/ATen/native/cuda/BinaryMulKernel.cu, mul_kernel_cuda: opmath_symmetric_gpu_kernel_with_scalars with
  MulFunctor<opmath_t>: both operands to float, one product, rounded once to the dtype.
- c10/util/BFloat16-inl.h: float -> bfloat16 on CUDA is __float2bfloat16 (round to nearest even).
nvcc contracts multiply-adds by default, but none can change these bits: libdevice's __nv_expf (read in Triton's
libdevice.10.bc) ends with a product by a power of two (exact unless subnormal, and then 1 + it rounds to 1), which
is the only product a `1 +` could fuse with; its other steps are explicit fma intrinsics.
So: fp32 loads, libdevice's exp (not tl.exp: ex2.approx on NVIDIA), tl.math.div_rn (llvm.nvvm.div.rn.f, the
IEEE division; `/` would be the approximate div.full.f32), the SiLU rounded to the dtype, the product in fp32,
rounded to the dtype. Launched with enable_fp_fusion=False and, where this Triton has the option,
enable_reflect_ftz=False (libdevice without flush-to-zero, as nvcc builds torch's kernels).

Under TRITON_INTERPRET=1 there is no libdevice: the kernel takes tl.exp (numpy's exp), so a CPU test checks the
rounding points against silu_mul_reference with the same exp; the CUDA tests check torch's own bits.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from apcscore.kernels._checks import check_float_input, check_tensors, interpreting
from apcscore.kernels.rotary import _rounded

BLOCK = 1024  # columns per program: 8 per thread at 4 warps (16-byte loads of bf16)
MAX_COLUMN_BLOCKS = 65535  # the grid's second dimension


@triton.jit
def _load_f32(ptrs, mask, IS_BF16: tl.constexpr):
    """The fp32 values of the elements at ptrs. bf16 by its bits (exact, as the GPU's conversion): the Triton
    interpreter's bf16 -> fp32 flushes subnormals to zero."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if IS_BF16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def _store_rounded(ptrs, y, mask, IS_BF16: tl.constexpr):
    """fp32 y rounded to nearest even into ptrs' dtype. bf16 by its bits (kernels/rotary._rounded; the
    interpreter's fp32 -> bf16 mishandles subnormals), a NaN as the GPU's cvt.rn.bf16.f32 writes it (0x7FFF)."""
    dt = ptrs.dtype.element_ty
    if IS_BF16:
        r = _rounded(y, dt, IS_BF16)  # a bf16 value, as fp32
        bits = tl.where(r != r, 0x7FFF, r.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16)
        tl.store(ptrs, bits.to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptrs, y.to(dt), mask=mask)


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n_cols, stride_g, stride_u, stride_o, BLOCK: tl.constexpr,
                     IS_BF16: tl.constexpr, LIBDEVICE_EXP: tl.constexpr):
    """One program per (row, block of BLOCK columns): out = round(round(silu(gate)) * up), torch's rounding."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = _load_f32(gate_ptr + row * stride_g + cols, mask, IS_BF16)
    u = _load_f32(up_ptr + row * stride_u + cols, mask, IS_BF16)
    if LIBDEVICE_EXP:
        e = libdevice.exp(-g)  # __nv_expf: CUDA's expf, as torch's SiLU
    else:
        e = tl.exp(-g)  # the interpreter (numpy's exp)
    s = _rounded(tl.math.div_rn(g, 1.0 + e), out_ptr.dtype.element_ty, IS_BF16)  # F.silu's output, in the dtype
    # the fp32 product rounded once (for fp16 LLVM narrows it to mul.rn.f16: the same value, as a product of two
    # halves is exact in fp32)
    _store_rounded(out_ptr + row * stride_o + cols, s * u, mask, IS_BF16)


@functools.lru_cache(maxsize=1)
def launch_options() -> dict[str, bool]:
    """Compile options: no fp contraction, and libdevice without flush-to-zero where this Triton can say so
    (CUDAOptions.enable_reflect_ftz; an unknown launch option is an error)."""
    options = {"enable_fp_fusion": False}
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # no NVIDIA backend: the interpreter ignores options
        return options
    if "enable_reflect_ftz" in CUDAOptions.__dataclass_fields__:
        options["enable_reflect_ftz"] = False
    return options


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up with torch's CUDA bits, in one launch: gate and up [T, I] of one dtype (fp32, fp16 or
    bf16; rows may be strided, columns contiguous) -> a new contiguous [T, I] tensor of that dtype."""
    name = "silu_mul"
    check_tensors(name, gate=gate, up=up)
    for arg, t in (("gate", gate), ("up", up)):
        check_float_input(name, arg, t, 2)
    if up.shape != gate.shape or up.dtype != gate.dtype:
        raise ValueError(f"{name}: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} "
                         "must have one shape and one dtype")
    rows, cols = gate.shape
    column_blocks = triton.cdiv(cols, BLOCK)
    if column_blocks > MAX_COLUMN_BLOCKS:
        raise ValueError(f"{name}: rows of {cols} columns are above the supported {MAX_COLUMN_BLOCKS * BLOCK}")
    out = torch.empty((rows, cols), dtype=gate.dtype, device=gate.device)
    if rows and cols:
        _silu_mul_kernel[(rows, column_blocks)](
            gate, up, out, cols, gate.stride(0), up.stride(0), out.stride(0), BLOCK=BLOCK,
            IS_BF16=gate.dtype == torch.bfloat16, LIBDEVICE_EXP=not interpreting(), num_warps=4,
            **launch_options())
    return out
