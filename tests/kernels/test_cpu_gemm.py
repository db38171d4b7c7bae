"""The CPU's batch-invariant linear layer, apcscore.kernels.cpu_gemm: every output element is summed in one fixed
order (an fma chain per block of 64 k, the blocks added in order), so a row's bits cannot depend on the row count,
the row's place in the call, the thread count, the micro-kernel (AVX-512, AVX2 or scalar) or the CPU vendor. Checked
exactly (no tolerance) on the default model's real projection shapes, in every dtype the engine runs; accuracy
against a float64 product.
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest
import torch

from apcscore.kernels.cpu_gemm import FixedOrderLinear, fixed_order_bmm, simd_level

# SmolLM2-135M: qkv, o, gate_up, down, LM head ([in, out]); then odd shapes (edge tiles, K not a block multiple)
DEFAULT_MODEL_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]
ODD_SHAPES = [(1, 1), (5, 17), (257, 33), (700, 100)]
ROW_COUNTS = (1, 2, 5, 6, 7, 15, 16, 17, 31, 57, 64, 96, 97, 100, 128, 191, 257, 1000)
SHIFTS = (0, 5, 16, 37)  # where the rows sit inside the reference call
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rows_differing(linear, x: torch.Tensor, weight: torch.Tensor, reference: torch.Tensor) -> list[tuple[int, int]]:
    """(M, shift) pairs where linear(x[shift:shift + M]) is not bitwise reference[shift:shift + M]."""
    return [(m, s) for m in ROW_COUNTS for s in SHIFTS
            if s + m <= reference.shape[0] and not torch.equal(linear(x[s:s + m], weight), reference[s:s + m])]


def operands(k: int, n: int, rows: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=gen).to(dtype),
            (torch.randn(n, k, generator=gen) * k ** -0.5).to(dtype))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", DEFAULT_MODEL_SHAPES + ODD_SHAPES)
def test_rows_are_batch_invariant(k: int, n: int, dtype: torch.dtype) -> None:
    linear = FixedOrderLinear()
    x, weight = operands(k, n, 1088 if n > 10_000 else 2048, dtype, k * n)
    reference = linear(x, weight)  # [rows, n]
    assert reference.dtype == dtype
    assert rows_differing(linear, x, weight, reference) == []
    bias = torch.randn(n).to(dtype)
    assert torch.equal(linear(x[3:60], weight, bias), reference[3:60] + bias)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", DEFAULT_MODEL_SHAPES + ODD_SHAPES)
def test_scalar_kernel_gives_the_simd_kernels_bits(k: int, n: int, dtype: torch.dtype) -> None:
    """The portable kernel (glibc's fmaf, one element at a time), the AVX2 one and the AVX-512 one agree bit for bit:
    the order is the construction's, not the instruction set's, so another CPU gives these bits too."""
    x, weight = operands(k, n, 100, dtype, k + n)  # 100 rows: past one A block (96)
    if n > 10_000:
        weight = weight[:2048]  # the scalar kernel is slow; the columns are independent anyway
    best = FixedOrderLinear()(x, weight)  # AVX-512 where the CPU has it
    assert torch.equal(FixedOrderLinear(simd=0)(x, weight), best)
    assert torch.equal(FixedOrderLinear(simd=1)(x, weight), best)  # AVX2 (the best kernel again on an AVX2 CPU)


def test_the_machine_runs_the_simd_kernel() -> None:
    """Every x86-64 CPU this project runs on has AVX2 and FMA (the Intel Xeons also AVX-512); a scalar fallback
    here would be a build bug."""
    assert simd_level() in ("avx2-fma", "avx512-fma")


@pytest.mark.parametrize("dtype", DTYPES)
def test_accuracy_against_float64(dtype: torch.dtype) -> None:
    x, weight = operands(1536, 576, 300, dtype, 7)
    got = FixedOrderLinear()(x.float(), weight).double()
    exact = x.double() @ weight.double().T
    # fp32 accumulation over K = 1536 of O(1) terms: errors ~ sqrt(K) * 2^-24 * |sum|
    torch.testing.assert_close(got, exact, rtol=0, atol=2e-4)


def test_threads_do_not_change_bits() -> None:
    x, weight = operands(576, 3072, 200, torch.float32, 3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = FixedOrderLinear()(x, weight)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, FixedOrderLinear()(x, weight))


def test_strided_rows_and_mixed_dtypes() -> None:
    """Rows read through strides (a column slice of a fused projection) and fp32 rows times a bf16 weight (the
    LM head of a bf16 model) give the bits of the contiguous, same-dtype call."""
    x, weight = operands(576, 960, 64, torch.float32, 4)
    wide = torch.cat([x, torch.randn(64, 100)], dim=1)[:, :576]  # non-contiguous rows
    linear = FixedOrderLinear()
    assert torch.equal(linear(wide, weight), linear(x, weight))
    half = weight.bfloat16()
    assert torch.equal(linear(x, half), linear(x, half.float()))


def test_writes_into_a_reused_buffer_and_repacks_a_changed_weight() -> None:
    x, weight = operands(64, 96, 40, torch.float32, 2)
    linear = FixedOrderLinear()
    out = torch.full((48, 96), float("nan"))
    got = linear(x, weight, out=out)
    assert got.shape == (40, 96) and got.data_ptr() == out.data_ptr()
    assert torch.equal(got, linear(x, weight))
    with torch.no_grad():
        weight.mul_(2)  # in place: the packed copy must follow
    assert torch.equal(linear(x, weight), 2 * got)


def test_bad_operands_are_refused() -> None:
    linear = FixedOrderLinear()
    with pytest.raises(ValueError, match="do not multiply"):
        linear(torch.zeros(3, 4), torch.zeros(5, 6))
    with pytest.raises(ValueError, match="float64"):
        linear(torch.zeros(3, 4, dtype=torch.float64), torch.zeros(5, 4))


@pytest.mark.parametrize("lead", [(1,), (3,), (2, 5)])
def test_bmm_products_are_the_linear_layers_chains(lead: tuple[int, ...]) -> None:
    """fixed_order_bmm (attention's products) gives each product bitwise what FixedOrderLinear gives its operands,
    whatever the number of products and threads, and through a transposed operand (p @ v)."""
    g = torch.Generator().manual_seed(len(lead))
    a = torch.randn(*lead, 37, 64, generator=g)
    b = torch.randn(*lead, 200, 64, generator=g)
    v = torch.randn(*lead, 64, 48, generator=g)
    got, pv = fixed_order_bmm(a, b), fixed_order_bmm(a, v.transpose(-1, -2))
    linear = FixedOrderLinear()
    for idx in itertools.product(*map(range, lead)):
        assert torch.equal(got[idx], linear(a[idx], b[idx]))
        assert torch.equal(pv[idx], linear(a[idx], v[idx].T.contiguous()))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(fixed_order_bmm(a, b), got)
    finally:
        torch.set_num_threads(threads)


def test_a_weight_at_a_freed_weights_address_is_packed_anew() -> None:
    """Packed weights are keyed by address and shape: a temporary weight freed and another allocated at its address
    must not be served the first one's packing."""
    linear, x = FixedOrderLinear(), torch.randn(5, 64)
    for seed in range(4):
        weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(linear(x, weight), FixedOrderLinear()(x, weight))
        del weight


def _round_f32(exact: Fraction) -> Fraction:
    """exact rounded to the nearest float32, ties to even (IEEE 754's one rounding), as an exact Fraction."""
    near = np.float32(float(exact))  # within an ulp (float64 then float32 may round twice)
    candidates = [np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf))]
    best = min(candidates, key=lambda c: (abs(Fraction(float(c)) - exact), int(np.array(c).view(np.int32)) & 1))
    return Fraction(float(best))


def _reference(x: torch.Tensor, w: torch.Tensor, block: int) -> torch.Tensor:
    """Each element as the construction defines it, in exact arithmetic rounded once per step: a chain
    p = fma(x[k], w[k], p) from +0 over each block of `block` k, the blocks' sums added to +0 in order."""
    xs, ws = [[Fraction(float(v)) for v in row] for row in x.tolist()], [[Fraction(float(v)) for v in row]
                                                                          for row in w.tolist()]
    out = torch.empty(x.shape[0], w.shape[0])
    for (i, xr), (j, wr) in itertools.product(enumerate(xs), enumerate(ws)):
        c = Fraction(0)
        for b0 in range(0, len(xr), block):
            p = Fraction(0)
            for a, b in zip(xr[b0:b0 + block], wr[b0:b0 + block]):
                p = _round_f32(a * b + p)
            c = _round_f32(c + p)
        out[i, j] = float(c)
    return out


def test_every_element_is_the_blocked_chain_order() -> None:
    """Issue 39 item 0, pinned: every kernel's bits are those of the order written in exact arithmetic (blocks of 64
    k, each one fma chain, blocks added in order), K = 200 (three whole blocks and a part). The same data under one
    chain over all of K differs, so an order change fails here and not only in the golden digests."""
    x, weight = operands(200, 8, 4, torch.float32, 11)
    want = _reference(x, weight, 64)
    assert not torch.equal(want, _reference(x, weight, 200)), "the data cannot tell the blocked order from one chain"
    for simd in (0, 1, 2):  # capped at what the CPU has
        assert torch.equal(FixedOrderLinear(simd=simd)(x, weight), want), simd
