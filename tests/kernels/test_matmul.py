"""Batch-invariant linear layers in Triton (apcscore.kernels.matmul), and the pad-16 torch fallback's plumbing
(apcscore.kernels.matmul_torch): a row's bits must not depend on how many rows share the GEMM, nor on where the
row sits among them. The CPU's construction, our fixed-order GEMM, is tested in tests/kernels/test_cpu_gemm.py; the
pad-16 fallback is a measured property of some CPUs only (not of MKL on an Intel Xeon), which the engine's
start-up probe checks where it runs (tests/engine/test_gemm_probe.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from apcscore.kernels.matmul_torch import ROW_TILE, invariant_linear_torch, padded_rows, plain_linear

# SmolLM2-135M: qkv, o, gate_up, down, LM head ([in, out])
DEFAULT_MODEL_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]
ROW_COUNTS = (1, 2, 7, 15, 16, 17, 31, 57, 64, 100, 128, 191, 257, 1000)
SHIFTS = (0, 5, 16, 37)  # where the rows sit inside the reference call


def rows_differing(linear, x: torch.Tensor, weight: torch.Tensor, reference: torch.Tensor,
                   counts: tuple[int, ...] = ROW_COUNTS) -> list[tuple[int, int]]:
    """(M, shift) pairs where linear(x[shift:shift + M]) is not bitwise reference[shift:shift + M]."""
    bad = []
    for m in counts:
        for shift in SHIFTS:
            if shift + m <= reference.shape[0] and not torch.equal(linear(x[shift:shift + m], weight),
                                                                    reference[shift:shift + m]):
                bad.append((m, shift))
    return bad


def test_padded_rows() -> None:
    assert [padded_rows(m) for m in (0, 1, 15, 16, 17, 32, 33)] == [16, 16, 16, 16, 32, 32, 48]
    assert ROW_TILE == 16


def test_plain_cpu_linear_is_not_batch_invariant() -> None:
    """What a construction is for: the library GEMM of a few fp32 rows rounds them otherwise (so the invariance
    tests of tests/kernels/test_cpu_gemm.py are not vacuous on this machine's BLAS)."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(576, 1536, generator=gen) * 1536 ** -0.5
    x = torch.randn(256, 1536, generator=gen)
    reference = plain_linear(x, weight)
    assert rows_differing(plain_linear, x, weight, reference, counts=(1, 2, 7)) != []


def test_cpu_linear_writes_into_a_reused_buffer() -> None:
    gen = torch.Generator().manual_seed(2)
    weight, x = torch.randn(96, 64, generator=gen), torch.randn(40, 64, generator=gen)
    out = torch.full((padded_rows(40), 96), float("nan"))
    got = invariant_linear_torch(x, weight, out=out)
    assert got.shape == (40, 96) and got.data_ptr() == out.data_ptr()
    assert torch.equal(got, invariant_linear_torch(x, weight))


def _triton_device() -> str | None:
    """Where the Triton kernel can run: CUDA, or the CPU under TRITON_INTERPRET=1; None: nowhere here."""
    from apcscore.kernels._checks import interpreting

    if interpreting():
        return "cpu"
    return "cuda" if torch.cuda.is_available() else None


@pytest.mark.triton
@pytest.mark.skipif(_triton_device() is None, reason="Triton kernels need CUDA, or TRITON_INTERPRET=1 on a CPU")
def test_triton_linear_matches_torch_and_is_batch_invariant() -> None:
    """The fixed-configuration Triton matmul (CUDA's invariant linear), fp32 (IEEE products on CUDA)."""
    from apcscore.kernels.matmul import invariant_linear

    gen = torch.Generator().manual_seed(3)
    device = _triton_device()
    weight = (torch.randn(200, 96, generator=gen) * 0.1).to(device)  # N = 200: two column tiles, one partial
    bias = torch.randn(200, generator=gen).to(device)
    x = torch.randn(300, 96, generator=gen).to(device)  # K = 96: two K steps, the second partial
    reference = invariant_linear(x, weight)
    torch.testing.assert_close(reference, x @ weight.t(), rtol=1e-5, atol=1e-5)
    assert rows_differing(invariant_linear, x, weight, reference, counts=(1, 7, 57, 129, 257)) == []
    assert torch.equal(invariant_linear(x[5:70], weight, bias), reference[5:70] + bias)
    out = torch.empty(128, 200, device=device)
    got = invariant_linear(x[:100], weight, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, reference[:100])
    half = invariant_linear(x[:40].half(), weight.half(), out_dtype=torch.float32)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, reference[:40], rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="x is torch.float16 but weight is torch.float32"):
        invariant_linear(x.half(), weight)


def test_matmul_configs_are_keyed_without_the_row_count() -> None:
    """The table's key and its lookup have no M in them: a configuration is chosen by the weight's shape."""
    import inspect

    from apcscore.kernels import matmul_configs

    assert list(inspect.signature(matmul_configs.config_for).parameters) == ["capability", "dtype", "n", "k"]
    for key, config in matmul_configs.TABLE.items():
        capability, dtype, n, k = key  # a 4-tuple: nothing else to key on
        assert isinstance(capability, str) and dtype in ("bfloat16", "float16", "float32"), key
        assert isinstance(n, int) and isinstance(k, int) and isinstance(config, matmul_configs.MatmulConfig)
    kernel_source = (Path(matmul_configs.__file__).parent / "matmul.py").read_text()
    assert '@triton.jit(do_not_specialize=["M"])' in kernel_source  # never compiled for a particular M


@pytest.mark.triton
@pytest.mark.skipif(_triton_device() is None, reason="Triton kernels need CUDA, or TRITON_INTERPRET=1 on a CPU")
def test_table_config_is_used_for_its_shape_and_rows_stay_invariant(monkeypatch, matmul_launches) -> None:
    """An entry of matmul_configs.TABLE for (device, dtype, N, K) is what invariant_linear launches for that
    weight shape (the launch's block sizes, warps and stages are the entry's, and its bits those of an explicit
    launch with it), each row's bits still do not depend on M, and another (N, K) keeps DEFAULT. The launch is
    watched rather than the bits compared with DEFAULT's: on a GPU an fp32 IEEE dot is one fma chain along K
    whatever BLOCK_K, so two configurations can give the same bits."""
    from apcscore.kernels import matmul_configs
    from apcscore.kernels.matmul import capability_of, invariant_linear

    launched = matmul_launches
    device = _triton_device()
    gen = torch.Generator().manual_seed(4)
    weight = (torch.randn(72, 160, generator=gen) * 0.1).to(device)  # [N=72, K=160]
    other = (torch.randn(40, 160, generator=gen) * 0.1).to(device)  # [N=40, K=160]: not in the table
    x = torch.randn(150, 160, generator=gen).to(device)  # [M=150, K]
    special = matmul_configs.MatmulConfig(block_m=32, block_n=32, block_k=32, group_m=2, num_warps=4,
                                          num_stages=2)  # 5 K steps of 32 instead of 64 + 64 + 32
    invariant_linear(x, weight)
    assert launched[-1] == matmul_configs.DEFAULT  # the table has no such entry yet
    cap = capability_of(x.device)
    monkeypatch.setitem(matmul_configs.TABLE, (cap, "float32", 72, 160), special)
    assert matmul_configs.config_for(cap, "float32", 72, 160) is special
    reference = invariant_linear(x, weight)  # [150, 72] through the table
    assert launched[-1] == special
    assert torch.equal(reference, invariant_linear(x, weight, config=special))
    torch.testing.assert_close(reference, x @ weight.t(), rtol=1e-5, atol=1e-5)
    assert rows_differing(invariant_linear, x, weight, reference, counts=(1, 7, 33, 64, 100)) == []
    assert launched[-1] == special
    assert torch.equal(invariant_linear(x[:50], other), invariant_linear(x[:50], other,
                                                                         config=matmul_configs.DEFAULT))
    assert launched[-2] == matmul_configs.DEFAULT


@pytest.mark.triton
@pytest.mark.skipif(_triton_device() is None, reason="Triton kernels need CUDA, or TRITON_INTERPRET=1 on a CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tma_persistent_config_is_batch_invariant_and_refuses_unaligned_rows(dtype: torch.dtype) -> None:
    """A TMA persistent configuration (tiles fetched through tensor descriptors, zero-filled past the edges;
    programs walking several tiles each): the product, each row's bits whatever M and wherever the rows sit,
    `out` and the bias as the plain kernel honours them, fp32 logits from bf16, and a row stride TMA cannot
    address refused with a message rather than summed another way."""
    from apcscore.kernels import matmul
    from apcscore.kernels.matmul_configs import MatmulConfig

    device = _triton_device()
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("the interpreter multiplies bf16 bit patterns in tl.dot (tests/kernels/test_kernels.py)")
    tma = MatmulConfig(block_m=32, block_n=64, block_k=32, group_m=2, num_warps=4, num_stages=2,
                       tma_persistent=True)
    gen = torch.Generator().manual_seed(5)
    weight = (torch.randn(200, 96, generator=gen) * 0.1).to(device, dtype)  # [N=200, K=96]: edge tiles in N, K
    bias = torch.randn(200, generator=gen).to(device, dtype)
    x = torch.randn(300, 96, generator=gen).to(device, dtype)  # [M=300, K]: 10 row tiles x 4 column tiles
    reference = matmul.invariant_linear(x, weight, config=tma)  # [300, 200]
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(reference.float(), x.float() @ weight.float().t(), rtol=tolerance, atol=tolerance)
    linear = lambda rows, w: matmul.invariant_linear(rows, w, config=tma)  # noqa: E731
    assert rows_differing(linear, x, weight, reference, counts=(1, 7, 33, 57, 129, 257)) == []
    assert torch.equal(matmul.invariant_linear(x[5:70], weight, bias, config=tma), reference[5:70] + bias)
    out = torch.empty(128, 200, device=device, dtype=torch.float32)
    logits = matmul.invariant_linear(x[:100], weight, out=out, out_dtype=torch.float32, config=tma)
    assert logits.data_ptr() == out.data_ptr() and logits.dtype == torch.float32
    assert torch.equal(logits.to(dtype), reference[:100])  # fp32 written; rounded, the bits of dtype's output
    odd = torch.randn(40, 97, generator=gen).to(device, dtype)[:, :96]  # rows 97 elements apart
    with pytest.raises(ValueError, match="TMA configuration needs 16-byte aligned rows"):
        matmul.invariant_linear(odd, weight, config=tma)
