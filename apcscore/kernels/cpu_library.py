"""The CPU kernel library: cpu_gemm.c, cpu_math.c and cpu_attention.c compiled into one shared object, kept in the kernel cache
(safely), loaded with ctypes (`library()`, every entry point's signature declared here).

- The cache is `$APCSCORE_CACHE/kernels` (default ~/.cache/apcscore/kernels); a library is named by a hash of the
  sources, the compiler's `--version`, the flags, the machine's architecture and its C library, so a shared home
  seen from an amd64 and an arm64 machine (or two libcs) keeps one library for each.
- A library is built aside and renamed into place (atomic), with mode 0755: other users of a shared cache can
  load it. One found in the cache is loaded only when its owner is this user or root and neither its group nor
  others can write it (a library planted under the predictable name would otherwise run in our process);
  otherwise, and where the cache cannot be written (read-only) or the cached file cannot be loaded, it is built
  into a private temporary folder instead, with a warning saying why.
- `$CC` may be a command line ("ccache gcc"); a compile that fails or takes more than BUILD_TIMEOUT seconds is a
  `CpuGemmUnavailable` naming the reason.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
import warnings
from pathlib import Path

KERNELS = Path(__file__).resolve().parent
SOURCES = (KERNELS / "cpu_gemm.c", KERNELS / "cpu_math.c", KERNELS / "cpu_attention.c")  # compiled into one library
HEADERS = (KERNELS / "cpu_vec.h",)  # included by them: part of the library's name too
FLAGS = ["-O2", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off", "-fno-fast-math", "-std=gnu11", "-Wno-psabi"]
BUILD_TIMEOUT = 300
SIMD_SETTINGS = {"scalar": 0, "avx2": 1, "avx512": 2}  # APCSCORE_SIMD: the most a kernel may use

_i64, _int, _ptr, _dbl = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_double
_lib: ctypes.CDLL | None = None


class CpuGemmUnavailable(RuntimeError):
    """The fixed-order CPU kernels could not be built or loaded here (no C compiler, a failed build)."""


def kernel_cache_dir() -> Path:
    """Where compiled kernels are kept: $APCSCORE_CACHE/kernels, default ~/.cache/apcscore/kernels."""
    root = os.environ.get("APCSCORE_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "apcscore") / "kernels"


def compiler() -> list[str]:
    """The C compiler's command line: $CC (split as a shell would: "ccache gcc"), else cc, gcc or clang."""
    env = os.environ.get("CC", "").strip()
    candidates = [shlex.split(env)] if env else [["cc"], ["gcc"], ["clang"]]
    for argv in candidates:
        if argv and shutil.which(argv[0]):
            return argv
    where = f"$CC={env!r} is not a command" if env else "no C compiler found (set $CC, or install gcc)"
    raise CpuGemmUnavailable(f"{where}; the batch-invariant CPU kernels are compiled from apcscore/kernels/*.c on "
                             "first use")


def library_name(cc: list[str]) -> str:
    """The library's file name: a hash of everything that makes one build differ from another."""
    try:
        version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise CpuGemmUnavailable(f"the C compiler {shlex.join(cc)!r} does not run: {e}") from None
    machine = f"{platform.machine()} {' '.join(platform.libc_ver())}"
    key = hashlib.sha256(b"".join(src.read_bytes() for src in (*SOURCES, *HEADERS)) + version.encode()
                         + " ".join(FLAGS).encode() + machine.encode()).hexdigest()[:16]
    return f"cpu_gemm-{key}.so"


def unsafe(path: Path) -> str | None:
    """Why a cached library must not be loaded (another user's, or writable by others), or None."""
    st = path.stat()
    if st.st_uid not in (os.getuid(), 0):
        return f"it belongs to another user (uid {st.st_uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"its group or other users can write it (mode {stat.filemode(st.st_mode)})"
    return None


def build(cc: list[str], path: Path) -> Path:
    """Compile the sources into `path` (built aside in its folder, then renamed: atomic); mode 0755."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    names = " and ".join(src.name for src in SOURCES)
    try:
        try:
            res = subprocess.run([*cc, *FLAGS, "-o", tmp, *map(str, SOURCES), "-lm"], capture_output=True,
                                 text=True, timeout=BUILD_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise CpuGemmUnavailable(f"compiling {names} with {shlex.join(cc)} took more than {BUILD_TIMEOUT} s; "
                                     "try again on a less loaded machine, or set $CC to a faster compiler") from None
        if res.returncode != 0:
            raise CpuGemmUnavailable(f"compiling {names} with {shlex.join(cc)} failed:\n"
                                     f"{res.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def private_build(cc: list[str], name: str, why: str) -> Path:
    """Build into a fresh private temporary folder (mode 0700), warning why the cache was not used."""
    warnings.warn(f"the CPU kernel cache {kernel_cache_dir()} {why}; building a private copy for this process",
                  stacklevel=3)
    return build(cc, Path(tempfile.mkdtemp(prefix="apcscore-kernels-")) / name)


def library_path(fresh: bool = False) -> Path:
    """The compiled library for this source, compiler, flags and machine (built if missing, see the module doc);
    fresh: build a private copy whatever the cache holds (the cached one could not be loaded)."""
    cc = compiler()
    name = library_name(cc)
    path = kernel_cache_dir() / name
    if fresh:
        return private_build(cc, name, f"has {name}, which could not be loaded")
    if path.exists():
        problem = unsafe(path)
        return path if problem is None else private_build(cc, name, f"has {name}, but {problem}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return build(cc, path)
    except OSError as e:  # read-only, not a folder, no space: the cache is only a cache
        return private_build(cc, name, f"cannot be written ({e.strerror or e})")


def library() -> ctypes.CDLL:
    """The loaded kernel library (compiled on first use)."""
    global _lib
    if _lib is None:
        try:
            lib = ctypes.CDLL(str(library_path()))
        except OSError:  # a cached file of another machine, or unreadable: build this process its own
            try:
                lib = ctypes.CDLL(str(library_path(fresh=True)))
            except OSError as e:
                raise CpuGemmUnavailable(f"cannot load the compiled CPU kernels: {e}") from None
        _declare(lib)
        _lib = lib
    return _lib


def _declare(lib: ctypes.CDLL) -> None:
    """The ctypes signatures of the entry points (cpu_gemm.c, cpu_math.c, then cpu_attention.c)."""
    signatures = {
        "apc_packed_b_bytes": ([_i64, _i64, _int], _i64), "apc_workspace_bytes": ([_i64, _int], _i64),
        "apc_simd_level": ([], _int), "apc_order_version": ([], _int),
        "apc_pack_b": ([_ptr, _int, _i64, _i64, _i64, _i64, _ptr, _int], None),
        "apc_gemm": ([_i64, _i64, _i64, _ptr, _int, _i64, _i64, _ptr, _int, _ptr, _i64, _ptr, _int, _int], None),
        "apc_bmm_workspace_bytes": ([_i64, _i64, _int, _int], _i64),
        "apc_bmm": ([_i64] * 5 + [_ptr, _int] + [_i64] * 4 + [_ptr, _int] + [_i64] * 4
                    + [_ptr, _i64, _i64, _i64, _ptr, _int, _int], None),
        "apc_bmm_paged_workspace_bytes": ([_i64, _i64, _int, _int], _i64),
        "apc_bmm_paged": ([_i64] * 6 + [_ptr, _int] + [_i64] * 5 + [_ptr, _int] + [_i64] * 3 + [_ptr, _i64, _ptr]
                          + [_i64, _i64, _int, _ptr] + [_i64] * 4 + [_ptr, _int, _int], None),
        "apc_math_level": ([], _int), "apc_map_f": ([_int, _ptr, _ptr, _i64, _int, _int], None),
        "apc_map_d": ([_int, _ptr, _ptr, _i64], None),
        "apc_row_sums_f": ([_ptr, _i64, _i64, _i64, _ptr, _int, _int], None),
        "apc_row_sums_d": ([_ptr, _i64, _i64, _i64, _int, _ptr, _int, _int], None),
        "apc_row_logsumexp": ([_ptr, _i64, _i64, _i64, _ptr, _int, _int], None),
        **{name: ([_dbl], _dbl) for name in ("apc_exp_d", "apc_log_d", "apc_sin_d", "apc_cos_d", "apc_erf_d")},
        "apc_attention": ([_i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr] + [_i64] * 5 + [ctypes.c_float, _ptr, _ptr, _int]
                          + [_i64] * 4 + [_ptr, _i64, _i64, _int, _int], _int),
    }
    for name, (args, res) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether the library builds and loads here (asked once per process; library() says why not)."""
    try:
        library()
        return True
    except CpuGemmUnavailable:
        return False


def forced_simd() -> int:
    """The instruction-set cap APCSCORE_SIMD sets (0 scalar, 1 AVX2, 2 AVX-512), or -1 (the best this CPU has)."""
    value = os.environ.get("APCSCORE_SIMD", "").strip().lower()
    if not value:
        return -1
    if value not in SIMD_SETTINGS:
        raise ValueError(f"APCSCORE_SIMD={value!r}: one of {', '.join(SIMD_SETTINGS)} (or unset: the best this CPU "
                         "has)")
    return SIMD_SETTINGS[value]
