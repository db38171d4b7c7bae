"""The double exp of cpu_math.map_double (the exact KL's exps, issue 55): its vector copies (baseline, AVX2, AVX-512)
and its threads give apc_exp_d's bits, element by element, on random doubles, the range the KL path sees (x <= 0 down
to -1e4 and -inf), the edges of apc_exp_d's special paths and subnormal results, and every length's tail."""

from __future__ import annotations

import math

import pytest
import torch

from apcscore.kernels import cpu_math
from apcscore.kernels.cpu_library import library
from tests.engine.test_portable_bits import each_setting, levels, pytestmark  # noqa: F401  (the SIMD settings; skipped without C)


def inputs() -> torch.Tensor:
    """[N] float64: random and edge arguments (N > cpu_math.PARALLEL_MIN_ELEMENTS, so 2 threads split them)."""
    g = torch.Generator().manual_seed(55)
    up, down = 709.8, -745.2
    edges = [0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, up, math.nextafter(up, math.inf),
             math.nextafter(up, 0.0), down, math.nextafter(down, -math.inf), math.nextafter(down, 0.0),
             5e-324, -5e-324, 2.2250738585072014e-308, 1e-300, -1e-300, 709.782712893384, 709.7827128933841,
             -708.3964185322641, -708.39641853226, -744.44007192138, -744.4400719213812, 1e4, -1e4, 1e300, -1e300]
    payload_nan = torch.tensor([0x7FF0000000000123, -0x000FFFFFFFFFFFFF], dtype=torch.int64).view(torch.float64)
    parts = [torch.tensor(edges, dtype=torch.float64), payload_nan,
             torch.rand(60_000, generator=g, dtype=torch.float64) * 1600 - 800,  # random over [-800, 800]
             -torch.rand(30_000, generator=g, dtype=torch.float64) * 1e4,  # the KL path's x - max <= 0
             -torch.randn(30_000, generator=g, dtype=torch.float64).abs() * 20,
             torch.linspace(709.78, 709.8, 5_001, dtype=torch.float64),  # up to the overflow threshold
             torch.linspace(-708.0, -745.2, 20_001, dtype=torch.float64),  # subnormal results, then underflow
             torch.full((7,), -math.inf, dtype=torch.float64)]
    x = torch.cat(parts)
    return x[torch.randperm(x.numel(), generator=g)]  # specials spread over vectors and threads' shares


def scalar_exp(x: torch.Tensor) -> torch.Tensor:
    """apc_exp_d of each element, one call each (the scalar function the vector copies must equal)."""
    lib = library()
    return torch.tensor([lib.apc_exp_d(v) for v in x.tolist()], dtype=torch.float64)


def bits(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.int64).tolist()


def test_every_simd_level_and_thread_count_gives_apc_exp_ds_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    x = inputs()
    want = bits(scalar_exp(x))
    for setting in each_setting(monkeypatch):
        got = bits(cpu_math.map_double(cpu_math.D_EXP, x))
        bad = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
        assert not bad, (setting, [(x[i].item(), got[i], want[i]) for i in bad[:5]])


def test_every_length_and_offset_gives_apc_exp_ds_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lengths 1..40 at offsets 0..8 (tails shorter than a vector, unaligned starts) in every copy."""
    x = inputs()[:64]
    want = bits(scalar_exp(x))
    for level in levels():
        monkeypatch.setenv("APCSCORE_SIMD", level)
        for start in range(9):
            for length in range(1, 41):
                got = bits(cpu_math.map_double(cpu_math.D_EXP, x[start:start + length]))
                assert got == want[start:start + length], (level, start, length)


def test_special_values_are_apc_exp_ds() -> None:
    x = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 709.81, -745.3, 1.0] * 2, dtype=torch.float64)
    e = cpu_math.map_double(cpu_math.D_EXP, x)
    assert math.isnan(e[0]) and e[1:7].tolist() == [math.inf, 0.0, 1.0, 1.0, math.inf, 0.0]
    assert e[7].item() == cpu_math.scalar(cpu_math.D_EXP, 1.0) and bits(e[:8]) == bits(e[8:])
