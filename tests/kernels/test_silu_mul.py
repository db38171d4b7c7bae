"""The fused SiLU-and-multiply kernel (apcscore.kernels.silu_mul) rounds where torch's CUDA `F.silu(gate) * up` does.

Under TRITON_INTERPRET=1 the kernel's exp is numpy's (there is no libdevice on the CPU), so the interpreter tests
hold it bitwise to silu_mul_reference called with numpy's exp: they check the rounding points (the fp32 SiLU with
IEEE add and division, its rounding to the dtype, the fp32 product rounded once), not CUDA's expf. The CUDA test
(marked gpu) checks torch's own bits: `F.silu(g) * u` on the GPU, every bf16 and fp16 gate value included.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from apcscore.kernels._checks import interpreting
from apcscore.kernels.silu_mul_torch import silu_mul_reference, silu_mul_torch

HAS_CUDA = torch.cuda.is_available()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]



def interpreted(test):
    """A test of the kernel under TRITON_INTERPRET=1 (skipped elsewhere: on CUDA the gpu test checks more)."""
    test = pytest.mark.skipif(not interpreting(), reason="set TRITON_INTERPRET=1 (make test does)")(test)
    return pytest.mark.triton(test)


def on_cuda(test):
    """A test of the kernel on a GPU against torch's own kernels."""
    test = pytest.mark.skipif(not HAS_CUDA or interpreting(),
                              reason="needs a CUDA device (and TRITON_INTERPRET unset)")(test)
    return pytest.mark.gpu(test)


def numpy_exp(x: torch.Tensor) -> torch.Tensor:
    """The interpreter's exp of an fp32 tensor: numpy's."""
    with np.errstate(over="ignore"):
        return torch.from_numpy(np.exp(x.numpy()))


def edge_values(dtype: torch.dtype) -> torch.Tensor:
    """Zeros, subnormals, the extremes, infinities, NaN and the points where exp(-x) overflows (x < -88.72) or
    underflows to a subnormal (x > 87.34) and to zero (x > 103.97) in fp32, in `dtype` (rounded there)."""
    info = torch.finfo(dtype)
    tiny = info.smallest_normal
    values = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 1e-3, -1e-3, tiny, -tiny, tiny / 2, -tiny / 2, tiny / 8, -tiny / 8,
              info.max, -info.max, info.max / 3, -info.max / 3, float("inf"), float("-inf"), float("nan"),
              -88.0, -88.5, -88.72, -88.73, -89.0, -100.0, 87.0, 87.34, 88.0, 100.0, 103.9, 104.0, 150.0, -150.0,
              8.0, -8.0, 17.0, -17.0, 30.0, -30.0]
    if dtype == torch.float32:
        values += [1e-45, -1e-45, 1e-40, -1e-40, 3e38, -3e38]
    return torch.tensor(values, dtype=torch.float32).to(dtype)


def every_value(dtype: torch.dtype) -> torch.Tensor:
    """Every bit pattern of a 16-bit dtype, as a [256, 256] tensor of it."""
    return torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype).reshape(256, 256)


def halves(rows: int, cols: int, dtype: torch.dtype, seed: int, device: str = "cpu") -> tuple:
    """gate and up as the MLP has them: the two halves of one [rows, 2 cols] projection (strided rows)."""
    g = torch.Generator().manual_seed(seed)
    fused = (torch.randn(rows, 2 * cols, generator=g) * 4).to(dtype).to(device)
    return fused.split(cols, dim=-1)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (-0 differs from 0), NaN where the other has NaN: a NaN's sign and payload are the
    arithmetic's (x86 makes -inf / inf a negative NaN, a GPU its canonical one), not a rounding point."""
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.isnan(), b.isnan()):
        return False
    keep = ~a.isnan()
    return torch.equal(a[keep].view(ints), b[keep].view(ints))


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 7), (17, 1023), (5, 1024), (2, 1025), (4, 2500)])
def test_the_kernel_rounds_as_the_reference_on_random_strided_halves(dtype, rows: int, cols: int) -> None:
    from apcscore.kernels.silu_mul import silu_mul

    gate, up = halves(rows, cols, dtype, seed=rows * cols)
    got = silu_mul(gate, up)
    assert got.is_contiguous() and got.dtype == dtype
    assert same_bits(got, silu_mul_reference(gate, up, numpy_exp))


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernel_rounds_as_the_reference_on_edge_values(dtype) -> None:
    """Each edge value as gate against each as up (NaN, inf, 0 * inf, subnormal products), and for the 16-bit
    dtypes every gate value against random up values."""
    from apcscore.kernels.silu_mul import silu_mul

    edges = edge_values(dtype)
    gate = edges[:, None].expand(len(edges), len(edges)).contiguous()
    up = edges[None, :].expand(len(edges), len(edges)).contiguous()
    got = silu_mul(gate, up)
    assert same_bits(got, silu_mul_reference(gate, up, numpy_exp))
    assert torch.isnan(got).any() and (got == 0).any() and torch.isinf(got).any()  # the edges were reached
    if dtype != torch.float32:
        gate = every_value(dtype)
        up = (torch.randn(gate.shape, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
        assert same_bits(silu_mul(gate, up), silu_mul_reference(gate, up, numpy_exp))


@interpreted
def test_bad_arguments_are_refused_by_name() -> None:
    from apcscore.kernels.silu_mul import silu_mul

    gate, up = halves(3, 8, torch.float32, seed=1)
    with pytest.raises(ValueError, match="one shape and one dtype"):
        silu_mul(gate, up[:2])
    with pytest.raises(ValueError, match="one shape and one dtype"):
        silu_mul(gate, up.to(torch.bfloat16))
    with pytest.raises(ValueError, match="up must have 2 dimensions"):
        silu_mul(gate, up[None])
    with pytest.raises(ValueError, match="last dimension of gate must be contiguous"):
        silu_mul(gate.t(), up.t())
    with pytest.raises(ValueError, match="gate must have dtype"):
        silu_mul(gate.double(), up.double())
    assert silu_mul(gate[:0], up[:0]).shape == (0, 8)


@pytest.mark.triton
def test_the_triton_ops_fuse_and_the_torch_ops_keep_two_kernels() -> None:
    """select_ops: the Triton backend's MLP calls the kernel; the torch backend's (the CPU engine's) stays
    rowmath.silu(gate) * up, so the CPU's bits do not move; MLP.forward goes through ops.silu_mul."""
    from apcscore.kernels import rowmath
    from apcscore.kernels.silu_mul import silu_mul
    from apcscore.models.llama import MLP
    from apcscore.models.ops import select_ops

    assert select_ops("torch").silu_mul is silu_mul_torch
    assert select_ops("triton", "cuda").silu_mul is silu_mul
    gate, up = halves(4, 16, torch.float32, seed=3)
    assert same_bits(silu_mul_torch(gate, up), rowmath.silu(gate) * up)
    calls = []

    def recording(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        calls.append((g.shape, u.shape))
        return silu_mul_torch(g, u)

    cfg = SimpleNamespace(hidden_size=8, intermediate_size=16, hidden_act="silu")
    linear = lambda x, w, b=None: x @ w.T  # noqa: E731
    mlp = MLP(cfg, linear, silu_mul=recording)
    mlp.gate_up_proj.weight.data.normal_()
    mlp.down_proj.weight.data.normal_()
    x = torch.randn(5, 8)
    gate_up = x @ mlp.gate_up_proj.weight.T
    want = (rowmath.silu(gate_up[:, :16]) * gate_up[:, 16:]) @ mlp.down_proj.weight.T  # the forward before
    assert same_bits(mlp(x), want) and calls == [((5, 16), (5, 16))]


@on_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_on_cuda_the_kernel_gives_torch_s_own_bits(dtype) -> None:
    """Bitwise `F.silu(gate) * up` on the GPU: random strided halves of several widths (the 1B shape's 8192
    among them), the edge values crossed, and every bf16 / fp16 gate value."""
    from apcscore.kernels.silu_mul import silu_mul

    def torch_form(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(g) * u

    for rows, cols in ((1, 1), (17, 1025), (64, 8192), (3, 14336)):
        gate, up = halves(rows, cols, dtype, seed=cols, device="cuda")
        assert same_bits(silu_mul(gate, up), torch_form(gate, up)), (rows, cols)
    edges = edge_values(dtype).cuda()
    gate = edges[:, None].expand(len(edges), len(edges)).contiguous()
    up = edges[None, :].expand(len(edges), len(edges)).contiguous()
    assert same_bits(silu_mul(gate, up), torch_form(gate, up))
    if dtype != torch.float32:
        gate = every_value(dtype).cuda()
        up = (torch.randn(gate.shape, generator=torch.Generator().manual_seed(2)) * 3).to(dtype).cuda()
        assert same_bits(silu_mul(gate, up), torch_form(gate, up))


AOT_SCRIPT = """
import re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from apcscore.kernels import silu_mul as m

fn = m._silu_mul_kernel
for dt, bf16 in (("bf16", True), ("fp16", False), ("fp32", False)):
    consts = dict(BLOCK=m.BLOCK, IS_BF16=bf16, LIBDEVICE_EXP=True)
    sig = {a: "constexpr" if a in consts else "*" + dt if a.endswith("_ptr") else "i32" for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if a.endswith("_ptr") or a.startswith("stride")}
    out = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4, **m.launch_options()})
    ptx = out.asm["ptx"]
    ops = sorted(set(re.findall(r"^\\s*((?:div|ex2|fma|rcp|cvt|mul|add)\\.[\\w.]+)", ptx, re.M)))
    print(dt, " ".join(ops))
"""


@pytest.mark.slow
@pytest.mark.triton
def test_the_cuda_build_has_the_ieee_division_and_libdevice_s_expf(tmp_path) -> None:
    """What the interpreter cannot see: compiled for sm_90 (Hopper) with Triton's bundled ptxas, no GPU needed,
    the kernel divides with div.rn.f32 (no div.full / approximate reciprocal), takes __nv_expf (its round-down
    fma.rm.f32 step; tl.exp would be a bare ex2.approx), without flush-to-zero in libdevice (non-ftz fma) and
    with no fma contraction of its own (mul.rn / add.rn)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(root), TRITON_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", AOT_SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ops = {line.split()[0]: set(line.split()[1:]) for line in proc.stdout.splitlines()}
    assert set(ops) == {"bf16", "fp16", "fp32"}, proc.stdout
    for dt, used in ops.items():
        assert {"div.rn.f32", "fma.rm.f32", "ex2.approx.ftz.f32", "add.rn.f32"} <= used, (dt, used)
        assert not any(op.startswith(("div.full", "div.approx", "rcp.")) or ".ftz" in op and op.startswith("fma")
                       for op in used), (dt, used)
    assert "cvt.rn.f16.f32" in ops["fp16"]  # the SiLU rounded to half (the product: mul.rn.f16, the same value)
