"""The Triton rotary kernel (apcscore.kernels.rotary) gives the torch form's bits (kernels/rotary_torch.rotary_torch,
transformers' `x * cos + rotate_half(x) * sin`): each product and the sum rounded to the inputs' dtype, no fma, on
the strided q and k views the model passes (splits of the fused qkv projection)."""

from __future__ import annotations

import pytest
import torch

from apcscore.kernels.rotary_torch import rotary_torch
from test_kernels import DEVICE, HAS_CUDA, INTERPRET

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(not INTERPRET and not HAS_CUDA,
                       reason="Triton kernels need CUDA; on a CPU set TRITON_INTERPRET=1 (make test does)"),
]


def qkv_views(tokens: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int):
    """q [T, Hq, D] and k [T, Hkv, D] as the model has them (views into one [T, (Hq + 2 Hkv) D] projection), and
    cos/sin [T, D] tables of real rope values (llama's duplicated halves) in that dtype."""
    g = torch.Generator().manual_seed(seed)
    qkv = (3 * torch.randn(tokens, (hq + 2 * hkv) * d, generator=g)).to(dtype).to(DEVICE)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    positions = torch.randint(0, 100_000, (tokens,), generator=g).double()
    inv_freq = 500000.0 ** (-torch.arange(0, d, 2).double() / d)
    angles = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)  # [T, D]
    cos, sin = (f(angles).to(dtype).to(DEVICE) for f in (torch.cos, torch.sin))
    return q.reshape(tokens, hq, d), k.reshape(tokens, hkv, d), cos, sin


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 64), (9, 3, 64), (4, 4, 128), (6, 2, 10)])
def test_rotary_kernel_gives_the_torch_form_s_bits(dtype: torch.dtype, hq: int, hkv: int, d: int) -> None:
    from apcscore.kernels.rotary import rotary

    q, k, cos, sin = qkv_views(37, hq, hkv, d, dtype, seed=hq * d)
    want_q, want_k = rotary_torch(q, k, cos, sin)
    got_q, got_k = rotary(q, k, cos, sin)
    assert got_q.is_contiguous() and got_k.is_contiguous() and got_q.dtype == dtype
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)  # bitwise
    # row by row: a token's result does not depend on the others in the call
    one_q, one_k = rotary(q[5:6], k[5:6], cos[5:6], sin[5:6])
    assert torch.equal(one_q, want_q[5:6]) and torch.equal(one_k, want_k[5:6])


def test_partial_rotary_and_other_table_dtypes_take_the_torch_form() -> None:
    from apcscore.kernels.rotary import rotary

    q, k, cos, sin = qkv_views(5, 4, 2, 32, torch.float32, seed=1)
    for c, s in ((cos[:, :16], sin[:, :16]), (cos.double(), sin.double())):  # partial rotary; fp64 tables
        want = rotary_torch(q, k, c, s)
        got = rotary(q, k, c, s)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="do not agree"):
        rotary(q, k[:4], cos, sin)
