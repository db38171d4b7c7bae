"""models/ops.py: the attention backends are a registry (`BACKENDS`), and each linear layer says how it fixes its
reduction order (`construction`, recorded as the run metadata's numerics.linear and compared by --resume, merge and
Ray, so the words must not change) and whether that order is the same on every CPU (`portable`)."""

from __future__ import annotations

import pytest

from apcscore.kernels import rowmath
from apcscore.kernels.cpu_gemm import FixedOrderLinear, order_version
from apcscore.kernels.matmul_torch import invariant_linear_torch, plain_linear
from apcscore.models.ops import BACKENDS, Ops, backend, linear_construction, portable_construction, select_ops


def test_each_linear_describes_its_construction_in_the_metadata_words() -> None:
    assert linear_construction(plain_linear) == "library GEMM (not batch-invariant)"
    assert linear_construction(invariant_linear_torch) == \
        "library GEMM on rows padded to 16 (probed, not by construction)"
    assert linear_construction(FixedOrderLinear()) == \
        f"apcscore fixed-order GEMM, order {order_version()} (blocked fma chains)"
    assert portable_construction(FixedOrderLinear()) == rowmath.portable()
    assert not portable_construction(plain_linear) and not portable_construction(invariant_linear_torch)


def test_the_triton_matmul_describes_its_construction() -> None:
    pytest.importorskip("triton")
    from apcscore.kernels.matmul import invariant_linear

    assert linear_construction(invariant_linear) == "Triton matmul, one fixed configuration"
    assert not portable_construction(invariant_linear)


def test_select_ops_builds_the_registered_backend_of_that_name() -> None:
    assert list(BACKENDS) == ["torch", "triton"]
    assert select_ops("torch").name == select_ops("auto").name == "torch"
    assert select_ops("torch").attention.name == "torch"
    assert linear_construction(select_ops("torch", batch_invariant=False).linear) == \
        "library GEMM (not batch-invariant)"
    with pytest.raises(ValueError, match="unknown backend 'flash'; one of auto, torch, triton"):
        select_ops("flash")


def test_select_ops_builds_the_triton_backend() -> None:
    pytest.importorskip("triton")
    ops = select_ops("auto", "cuda")
    assert ops.name == ops.attention.name == "triton"
    assert linear_construction(ops.linear) == "Triton matmul, one fixed configuration"


def test_a_new_linear_or_backend_is_described_and_registered_without_editing_ops(monkeypatch) -> None:
    class TestLinear:
        construction = "the test's construction"
        portable = True

    assert linear_construction(TestLinear()) == "the test's construction"
    assert portable_construction(TestLinear()) == rowmath.portable()
    monkeypatch.setitem(BACKENDS, "mine", None)  # (undone after the test: no backend "mine" is left behind)

    @backend("mine")
    def mine(linear, batch_invariant: bool) -> Ops:
        return Ops("mine", linear, batch_invariant, None, None, None)

    ops = select_ops("mine", batch_invariant=False)
    assert ops.name == "mine" and linear_construction(ops.linear) == "library GEMM (not batch-invariant)"
