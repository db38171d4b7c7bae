"""The CPU kernel library's build and cache (apcscore.kernels.cpu_library) and the GEMM's edges (issue 42, items 1-6;
issue 53, items 1 and 8): nothing loaded from the cache that someone else could have put there (another user's file,
a writable one, a symbolic link, a hard link, any file in a folder others can write), a library without the entry
points as "unavailable" rather than a crash, no temporary folder left behind, one name per machine kind, build
failures as clear errors, a cache that cannot be written, $CC as a command line, per-thread workspaces, K = 0, and the
floating-point environment. The builds here compile one-line C files (fast)."""

from __future__ import annotations

import ctypes
import math
import os
import stat
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from apcscore.kernels import cpu_gemm, cpu_math
from apcscore.kernels.buffers import reused_buffer
from apcscore.kernels import cpu_library as cpu_build
from apcscore.kernels.cpu_library import CpuGemmUnavailable

# A library someone else put in the cache: its constructor (run by dlopen, before any symbol is looked up) leaves a
# file where $APC_TEST_MARK says, and its apc_tiny answers 8 where ours answers 7.
PLANTED = """#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    const char *p = getenv("APC_TEST_MARK");
    if (p) { FILE *f = fopen(p, "w"); if (f) fclose(f); }
}
int apc_tiny(void) { return 8; }
"""


def _declare_tiny(lib: ctypes.CDLL) -> None:
    """The tiny library's one entry point, looked up as cpu_library._declare looks up the real ones."""
    lib.apc_tiny.restype = ctypes.c_int


@pytest.fixture
def tiny_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A one-function C source in place of the kernels, a fresh cache folder and system temporary folder, no library
    loaded yet (the real one is back after the test: monkeypatch restores _lib) and available() asked afresh."""
    src = tmp_path / "tiny.c"
    src.write_text("int apc_tiny(void) { return 7; }\n")
    monkeypatch.setattr(cpu_build, "SOURCES", (src,))
    monkeypatch.setattr(cpu_build, "_declare", _declare_tiny)
    monkeypatch.setattr(cpu_build, "_lib", None)
    monkeypatch.setenv("APCSCORE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("APC_TEST_MARK", str(tmp_path / "planted-ran"))
    monkeypatch.delenv("CC", raising=False)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    cpu_build.available.cache_clear()
    yield tmp_path / "cache" / "kernels"
    cpu_build.available.cache_clear()


def compile_c(code: str, out: Path) -> Path:
    """A shared library of `code` at `out`, mode 0755 (a file of this user, one name: every file check passes)."""
    src = out.with_name(out.name + ".c")
    src.write_text(code)
    subprocess.run([*cpu_build.compiler(), "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    src.unlink()
    out.chmod(0o755)
    return out


def plant(cache: Path, code: str = PLANTED) -> Path:
    """A library under the name ours would have, in the cache folder (made here)."""
    cache.mkdir(parents=True, exist_ok=True)
    return compile_c(code, cache / cpu_build.library_name(cpu_build.compiler()))


def load_warning(load: Callable[[], object] = cpu_build.library) -> tuple[object, str]:
    """load()'s result and its one warning about the kernel cache (exactly one)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = load()
    about = [str(w.message) for w in caught if "CPU kernel cache" in str(w.message)]
    assert len(about) == 1, about
    return result, about[0]


def left_behind(tmp_path: Path, cache: Path) -> list[str]:
    """Temporary folders a build left: in the system's temporary folder, or beside the library in the cache."""
    return os.listdir(tmp_path / "tmp") + [p for p in (os.listdir(cache) if cache.is_dir() else [])
                                           if not p.startswith("cpu_gemm-")]


def test_a_built_library_is_published_mode_0755_and_nothing_is_left_behind(tiny_sources: Path,
                                                                            tmp_path: Path) -> None:
    """Built in a private folder inside the cache, loaded from there, renamed into the cache; the folder removed."""
    assert cpu_build.library().apc_tiny() == 7
    path = tiny_sources / cpu_build.library_name(cpu_build.compiler())
    assert stat.S_IMODE(path.stat().st_mode) == 0o755  # mkstemp's 0600 plus the linker's +x was -rwx--x--x
    assert left_behind(tmp_path, tiny_sources) == []
    cpu_build._lib = None  # the next process: the published file is loaded, not rebuilt
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_build.library().apc_tiny() == 7


@pytest.mark.parametrize("problem", ["writable", "foreign", "hard link"])
def test_a_cached_library_others_can_write_or_own_is_not_loaded(tiny_sources: Path, tmp_path: Path,
                                                                problem: str) -> None:
    """Issue 53 item 1: a hard link to a root-owned library under our name passed the owner and mode checks."""
    if problem == "hard link":
        elsewhere = compile_c(PLANTED, tmp_path / "root-owned.so")
        tiny_sources.mkdir(parents=True)
        planted = tiny_sources / cpu_build.library_name(cpu_build.compiler())
        os.link(elsewhere, planted)
    else:
        planted = plant(tiny_sources)
    if problem == "writable":
        planted.chmod(0o777)
    elif problem == "foreign":
        if os.getuid() != 0:
            pytest.skip("only root can give a file to another user")
        os.chown(planted, 12345, 12345)
    before = planted.read_bytes()
    lib, message = load_warning()
    assert lib.apc_tiny() == 7 and not (tmp_path / "planted-ran").exists()
    assert {"writable": "can be written by its group or other users", "foreign": "belongs to another user (uid 12345)",
            "hard link": "has 2 names (hard links)"}[problem] in message
    assert f"remove {planted}" in message and "building a private copy" in message
    assert planted.read_bytes() == before and left_behind(tmp_path, tiny_sources) == []


def test_a_symbolic_link_in_the_cache_is_not_followed(tiny_sources: Path, tmp_path: Path) -> None:
    """Issue 53 item 1: a link under our name to a root-owned library (the reproduction's libm.so.6) was stat()ed
    through, found root's, and dlopen'ed: its constructors ran in our process. Now it is not even opened."""
    target = compile_c(PLANTED, tmp_path / "root-owned.so")
    tiny_sources.mkdir(parents=True)
    link = tiny_sources / cpu_build.library_name(cpu_build.compiler())
    link.symlink_to(target)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lib = cpu_build.library()
    assert not (tmp_path / "planted-ran").exists(), "the link's target was loaded"
    assert lib.apc_tiny() == 7
    assert [str(w.message) for w in caught] == [
        f"the CPU kernel cache {tiny_sources} has {link.name}, but it is a symbolic link (not followed); building a "
        f"private copy for this process — remove {link} (the next run builds it there), or set APCSCORE_CACHE to a "
        "folder of your own"]
    assert link.is_symlink() and left_behind(tmp_path, tiny_sources) == []


@pytest.mark.parametrize("folder, change", [("kernels", "0o777"), ("kernels", "0o775"), ("root", "0o757"),
                                            ("kernels", "foreign"), ("root", "foreign"), ("kernels", "link")])
def test_a_cache_folder_others_can_write_or_own_is_not_used(tiny_sources: Path, tmp_path: Path, folder: str,
                                                            change: str) -> None:
    """Issue 53 item 1: in a folder another user can write (or owns) they can put any file under our name, so
    nothing in it is loaded, whatever the file's own owner and mode: a private copy is built, with one warning
    naming the folder and what to do."""
    planted = plant(tiny_sources)  # a file every file check accepts
    path = tiny_sources if folder == "kernels" else tiny_sources.parent
    if change == "foreign":
        if os.getuid() != 0:
            pytest.skip("only root can give a folder to another user")
        os.chown(path, 12345, 12345)
        why, todo = "belongs to another user (uid 12345)", "set APCSCORE_CACHE to a folder of your own"
    elif change == "link":  # the kernels folder a link to a folder elsewhere
        real = tmp_path / "elsewhere"
        tiny_sources.rename(real)
        tiny_sources.symlink_to(real)
        why, todo = "is a symbolic link (not followed)", "replace it with a folder"
    else:
        path.chmod(int(change, 8))
        why, todo = "can be written by its group or other users and has no sticky bit", f"run chmod go-w {path}"
    lib, message = load_warning()
    assert lib.apc_tiny() == 7 and not (tmp_path / "planted-ran").exists()
    assert message.startswith(f"the CPU kernel cache {tiny_sources} is not used: {path} {why}"), message
    assert todo in message and left_behind(tmp_path, real if change == "link" else tiny_sources) == []
    assert planted.exists() or change == "link"


def test_a_sticky_cache_folder_others_can_write_is_used(tiny_sources: Path, tmp_path: Path) -> None:
    """The sticky bit (as /tmp has) keeps others from renaming or removing our files: such a folder is used, and a
    file in it still checked."""
    plant(tiny_sources)
    tiny_sources.chmod(0o1777)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_build.library().apc_tiny() == 8  # the file in the cache: every check passes
    assert (tmp_path / "planted-ran").exists()


def test_a_library_without_the_entry_points_is_unavailable_not_a_crash(tiny_sources: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 53 item 1: a cached library without our symbols made `library()` raise AttributeError ("undefined
    symbol") through `available()`, so every command crashed. Now such a file is not used (a private copy is built,
    which has them); where even that lacks one, the kernels are unavailable (the callers run torch's ops)."""
    plant(tiny_sources, "int apc_other(void) { return 1; }\n")
    lib, message = load_warning(cpu_build.library)
    assert lib.apc_tiny() == 7 and "which could not be loaded" in message and "apc_tiny" in message

    def declare_missing(lib: ctypes.CDLL) -> None:
        lib.apc_missing.restype = ctypes.c_int  # in neither the cached file nor a fresh build

    monkeypatch.setattr(cpu_build, "_declare", declare_missing)
    monkeypatch.setattr(cpu_build, "_lib", None)
    cpu_build.available.cache_clear()
    available, message = load_warning(cpu_build.available)  # the warning: the cached file's problem
    assert available is False and "which could not be loaded" in message and "apc_missing" in message
    with pytest.raises(CpuGemmUnavailable, match="cannot be loaded: .*apc_missing"), pytest.warns(UserWarning):
        cpu_build.library()
    assert left_behind(tmp_path, tiny_sources) == []


def test_no_temporary_folder_is_left_behind(tiny_sources: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 53 item 1: every private build left a /tmp/apcscore-kernels-* folder (one per process). A private copy
    is now removed once loaded (the loaded library stays mapped), as is the build folder inside the cache."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("APCSCORE_CACHE", str(blocker / "under"))  # no cache: a private copy
    with pytest.warns(UserWarning, match="building a private copy"):
        assert cpu_build.library().apc_tiny() == 7
    assert os.listdir(tmp_path / "tmp") == []
    monkeypatch.setenv("APCSCORE_CACHE", str(tiny_sources.parent))  # a cache: built there
    monkeypatch.setattr(cpu_build, "_lib", None)
    assert cpu_build.library().apc_tiny() == 7
    assert os.listdir(tmp_path / "tmp") == [] and os.listdir(tiny_sources) == [
        cpu_build.library_name(cpu_build.compiler())]


def test_a_cached_library_that_cannot_be_loaded_is_rebuilt_privately(tiny_sources: Path) -> None:
    """Item 1's "rebuild what cannot be loaded": a cached file of the right name, owner and mode that dlopen refuses
    (damaged, or another machine's from before the name covered the machine) is not an error: library() builds a
    private copy and loads that."""
    name = cpu_build.library_name(cpu_build.compiler())
    tiny_sources.mkdir(parents=True)
    cached = tiny_sources / name
    cached.write_bytes(b"not a library")
    cached.chmod(0o755)
    assert cpu_build.file_problem(cached.stat()) is None
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
        cpu_build.library()
    assert left_behind(tmp_path, tiny_sources) == []


def test_a_cache_that_cannot_be_written_builds_a_private_copy(tmp_path: Path, tiny_sources: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for root, why in [(blocker, f"cannot be used ({blocker}: Not a directory)"),  # the root a file
                      (blocker / "under", f"cannot be used ({blocker / 'under'}: Not a directory)"),  # under one
                      (Path("/sys/apcscore-test"), "cannot be written (")]:  # even by root
        if root.parent == Path("/sys") and not Path("/sys/kernel").is_dir():
            continue
        monkeypatch.setenv("APCSCORE_CACHE", str(root))
        monkeypatch.setattr(cpu_build, "_lib", None)
        lib, message = load_warning()
        assert lib.apc_tiny() == 7 and why in message, message
        assert "set APCSCORE_CACHE to a folder you can write" in message and os.listdir(tmp_path / "tmp") == []


def test_cc_may_be_a_command_line(tiny_sources: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "env gcc")  # as "ccache gcc" is written
    assert cpu_build.compiler() == ["env", "gcc"]
    assert cpu_build.library().apc_tiny() == 7
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with pytest.raises(CpuGemmUnavailable, match="is not a command"):
        cpu_build.compiler()


def test_workspaces_are_per_thread() -> None:
    """Two engines in two threads never share a workspace: a regrow in one cannot free the other's under it."""
    seen: dict[str, int] = {}
    both_hold = threading.Barrier(2)  # a finished thread's buffer is freed: its address may be reused after

    def grab(name: str) -> None:
        seen[name] = reused_buffer("gemm", (1 << 20,)).data_ptr()
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
