"""The CPU kernel library's build and cache (apcscore.kernels.cpu_library) and the GEMM's edges (issue 42, items 1-6):
a cached library others can load, none loaded that another user owns or can write, one name per machine kind,
build failures as clear errors, a cache that cannot be written, $CC as a command line, per-thread workspaces,
K = 0, and the floating-point environment. The builds here compile a one-line C file (fast)."""

from __future__ import annotations

import math
import os
import stat
import threading
from pathlib import Path

import pytest
import torch

from apcscore.kernels import cpu_gemm, cpu_math
from apcscore.kernels import cpu_library as cpu_build
from apcscore.kernels.cpu_library import CpuGemmUnavailable


@pytest.fixture
def tiny_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A one-function C source in place of the kernels, and a fresh cache folder."""
    src = tmp_path / "tiny.c"
    src.write_text("int apc_tiny(void) { return 7; }\n")
    monkeypatch.setattr(cpu_build, "SOURCES", (src,))
    monkeypatch.setenv("APCSCORE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CC", raising=False)
    return tmp_path / "cache" / "kernels"


def test_a_built_library_is_loadable_by_other_users(tiny_sources: Path) -> None:
    path = cpu_build.library_path()
    assert path.parent == tiny_sources
    assert stat.S_IMODE(path.stat().st_mode) == 0o755  # mkstemp's 0600 plus the linker's +x was -rwx--x--x


@pytest.mark.parametrize("problem", ["writable", "foreign"])
def test_a_cached_library_others_can_write_or_own_is_not_loaded(tiny_sources: Path, problem: str) -> None:
    name = cpu_build.library_name(cpu_build.compiler())
    tiny_sources.mkdir(parents=True)
    planted = tiny_sources / name
    planted.write_bytes(b"not a library")
    if problem == "writable":
        planted.chmod(0o777)
    else:
        planted.chmod(0o755)
        if os.getuid() != 0:
            pytest.skip("only root can give a file to another user")
        os.chown(planted, 12345, 12345)
    with pytest.warns(UserWarning, match="another user|can write it"):
        path = cpu_build.library_path()
    assert path != planted and path.name == name and path.read_bytes() != b"not a library"


def test_a_cached_library_that_cannot_be_loaded_is_rebuilt_privately(tiny_sources: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 1's "rebuild what cannot be loaded": a cached file of the right name, owner and mode that dlopen refuses
    (damaged, or another machine's from before the name covered the machine) is not an error: library() builds a
    private copy and loads that."""
    name = cpu_build.library_name(cpu_build.compiler())
    tiny_sources.mkdir(parents=True)
    cached = tiny_sources / name
    cached.write_bytes(b"not a library")
    cached.chmod(0o755)
    assert cpu_build.unsafe(cached) is None
    monkeypatch.setattr(cpu_build, "_lib", None)  # (restored after the test: the real library stays loaded)
    monkeypatch.setattr(cpu_build, "_declare", lambda lib: None)  # the tiny source has none of the entry points
    with pytest.warns(UserWarning, match="could not be loaded"):
        lib = cpu_build.library()
    assert lib.apc_tiny() == 7 and cached.read_bytes() == b"not a library"


def test_the_name_covers_the_machine_and_its_c_library(tiny_sources: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cc = cpu_build.compiler()
    here = cpu_build.library_name(cc)
    monkeypatch.setattr(cpu_build.platform, "machine", lambda: "aarch64")
    assert cpu_build.library_name(cc) != here
    monkeypatch.undo()
    monkeypatch.setattr(cpu_build.platform, "libc_ver", lambda: ("musl", "1.2"))
    assert cpu_build.library_name(cc) != here


def test_a_compile_that_takes_too_long_is_a_clear_error(tiny_sources: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    slow = tmp_path / "slowcc"
    slow.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo slowcc 1; exit 0; fi\nsleep 5\n")
    slow.chmod(0o755)
    monkeypatch.setenv("CC", str(slow))
    monkeypatch.setattr(cpu_build, "BUILD_TIMEOUT", 1)
    with pytest.raises(CpuGemmUnavailable, match="took more than 1 s"):
        cpu_build.library_path()


def test_a_cache_that_cannot_be_written_builds_a_private_copy(tmp_path: Path, tiny_sources: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("APCSCORE_CACHE", str(blocker))  # kernels/ would be a folder under a file
    with pytest.warns(UserWarning, match="cannot be written"):
        path = cpu_build.library_path()
    assert path.exists() and not str(path).startswith(str(blocker))


def test_cc_may_be_a_command_line(tiny_sources: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "env gcc")  # as "ccache gcc" is written
    assert cpu_build.compiler() == ["env", "gcc"]
    assert cpu_build.library_path().exists()
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with pytest.raises(CpuGemmUnavailable, match="is not a command"):
        cpu_build.compiler()


def test_workspaces_are_per_thread() -> None:
    """Two engines in two threads never share a workspace: a regrow in one cannot free the other's under it."""
    seen: dict[str, int] = {}
    both_hold = threading.Barrier(2)  # a finished thread's buffer is freed: its address may be reused after

    def grab(name: str) -> None:
        seen[name] = cpu_gemm._workspace("gemm", 1 << 20).data_ptr()
        both_hold.wait(timeout=30)

    threads = [threading.Thread(target=grab, args=(f"t{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(seen.values())) == 2
    x, w = torch.randn(64, 300), torch.randn(96, 300)
    want = cpu_gemm.FixedOrderLinear()(x, w)
    results: list[bool] = []

    def run() -> None:
        linear = cpu_gemm.FixedOrderLinear()
        for rows in (64, 7, 64, 33, 64):  # other sizes between: workspaces regrow
            got = linear(x[:rows], w)
            results.append(torch.equal(got, want[:rows]))

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(results) and len(results) == 20


def test_k_zero_gives_zeros_not_the_buffers_old_contents() -> None:
    out = torch.full((4, 5), float("nan"))
    got = cpu_gemm.FixedOrderLinear()(torch.zeros(3, 0), torch.zeros(5, 0), out=out)
    assert torch.equal(got, torch.zeros(3, 5))
    products = cpu_gemm.fixed_order_bmm(torch.zeros(2, 3, 0), torch.zeros(2, 4, 0))
    assert torch.equal(products, torch.zeros(2, 3, 4))


def _bits(t: torch.Tensor) -> list[int]:
    """The float32 values' bit patterns (integers compare the same under any MXCSR / FPCR setting)."""
    return t.float().contiguous().view(torch.int32).flatten().tolist()


def test_denormals_are_kept_whatever_torch_flushes() -> None:
    """torch.set_flush_denormal(True) sets MXCSR's FTZ/DAZ (FPCR.FZ on AArch64, where this test runs the same); the
    kernels set their own environment for the call (the GEMM's gemm_panels, cpu_math.c's fp_enter), so a denormal
    product or sum is kept. The results are compared as bits after the flush is turned off again: under DAZ a
    denormal compares equal to 0.0, so a torch.equal inside the flushed section could not fail."""
    x, w = torch.tensor([[1e-20]]), torch.tensor([[1e-20]])  # 1e-40: a denormal float
    row = torch.full((1, 16), 1e-40)  # a row of denormals: their sum is one too

    def results() -> dict[str, list[int]]:
        return {"gemm": _bits(cpu_gemm.FixedOrderLinear()(x, w)), "row sums": _bits(cpu_math.row_sums(row))}

    want = results()
    assert all(b != [0] for b in want.values()), want
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-denormal mode")
    try:
        assert (x * w).item() == 0.0  # torch's own multiply does flush: the setting is on
        got = results()
    finally:
        torch.set_flush_denormal(False)
    assert got == want


def test_the_scalar_functions_keep_denormals_whatever_torch_flushes() -> None:
    """Issue 53 item 8: cpu_math.scalar (exp_scalar / log_scalar) runs in the kernels' floating-point environment, as
    map_double does: under torch.set_flush_denormal(True) log(1e-310) was -inf (the denormal input read as 0) and
    exp(-710) 0. Compared after the flush is off again (under DAZ a denormal compares equal to 0.0)."""
    args = {"log": (cpu_math.D_LOG, 1e-310, math.log), "exp": (cpu_math.D_EXP, -710.0, math.exp)}  # exp: 4.5e-309
    want = {name: ref(v) for name, (_, v, ref) in args.items()}
    assert want["exp"] != 0.0 and cpu_math.scalar(cpu_math.D_EXP, -710.0) == want["exp"]
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-denormal mode")
    try:
        assert torch.tensor([1e-310], dtype=torch.float64).mul(1.0).item() == 0.0  # the setting is on
        got = {name: cpu_math.scalar(fn, v) for name, (fn, v, _) in args.items()}
    finally:
        torch.set_flush_denormal(False)
    # the documented accuracy (tests/engine/test_portable_bits.py): within 4e-16 relative of CPython's libm
    assert abs(got["log"] - want["log"]) <= 4e-16 * abs(want["log"]), got
    assert got["exp"] == want["exp"], got  # exact here: one rounding, at the denormal
    with pytest.raises(ValueError, match="function code 9"):
        cpu_math.scalar(9, 1.0)
