"""The CPU kernel library: cpu_gemm.c, cpu_math.c and cpu_attention.c compiled into one shared object, kept in the
kernel cache `$APCSCORE_CACHE/kernels` (default ~/.cache/apcscore/kernels), loaded with ctypes (`library()`, every
entry point's signature in SIGNATURES). The rules and their reasons: docs/decisions.md, "The CPU kernel library";
the warnings: docs/errors.md rows 104b-104d. In short:

- The name hashes the sources, the compiler's `--version`, the flags, the machine's architecture and its C library.
- Trust: nothing is loaded from the cache that someone else could have put there. The cache folders must pass
  `folder_problem` (else the cache is not used at all); the library is opened with O_NOFOLLOW, its descriptor
  checked (`file_problem`) and loaded through that descriptor (/proc/self/fd/N), so the file checked is the file
  loaded. A library another user (not root) built is never loaded: a cache is shared read-only, root-built (0755).
- A sticky folder others can write (as /tmp) is used: they cannot rename or remove our files, and what they add
  under our name fails the file checks (fs.protected_hardlinks, on by default, covers a hard link's later unlink).
- Building: in a private folder (0700) inside the cache folder, loaded from there, then renamed into the cache
  (atomic). Where the cache or our file in it is refused or cannot be used, a private copy is built in a temporary
  folder of the system's (removed once loaded), with one warning that says why and what to do.
- Every other way of not getting a loaded library with all its entry points (no compiler, a failed compile, a build
  that cannot be loaded) is `CpuGemmUnavailable`, never another exception: `available()` is then False and the
  callers run torch's ops (models.ops.select_linear warns).
- `$CC` may be a command line ("ccache gcc"); a compile that fails or takes over BUILD_TIMEOUT s names the reason.
"""

from __future__ import annotations

import ctypes
import errno
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
# The entry points (cpu_gemm.c, cpu_math.c, then cpu_attention.c): name -> (argument types, result type). A library
# without one of them is not ours (or not this version's): not used.
SIGNATURES: dict[str, tuple[list, object]] = {
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
    "apc_map_d": ([_int, _ptr, _ptr, _i64, _int, _int], None),
    "apc_row_sums_f": ([_ptr, _i64, _i64, _i64, _ptr, _int, _int], None),
    "apc_row_sums_d": ([_ptr, _i64, _i64, _i64, _int, _ptr, _int, _int], None),
    "apc_row_logsumexp": ([_ptr, _i64, _i64, _i64, _ptr, _int, _int], None),
    **{name: ([_dbl], _dbl) for name in ("apc_exp_d", "apc_log_d", "apc_sin_d", "apc_cos_d", "apc_erf_d")},
    "apc_attention": ([_i64, _ptr, _ptr, _ptr, _i64, _ptr] + [_i64] * 5 + [ctypes.c_float, _ptr, _ptr, _int]
                      + [_i64] * 4 + [_ptr, _i64, _i64, _int, _int], _int),
}
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_lib: ctypes.CDLL | None = None
# The descriptors libraries were loaded through, kept open (ctypes never unloads; glibc's dlopen returns the object
# already loaded under a name, so a reused /proc/self/fd/N would give the old library).
_held: list[int] = []


class CpuGemmUnavailable(RuntimeError):
    """The fixed-order CPU kernels could not be built or loaded here (no C compiler, a failed build)."""


class _Untrusted(Exception):
    """A library file that must not be loaded (file_problem says why)."""


class _NotUsed(Exception):
    """The kernel cache (or our file in it) is not used: why, and what to do (a private copy is built instead)."""

    def __init__(self, why: str, todo: str) -> None:
        super().__init__(why)
        self.why, self.todo = why, todo


def cache_root() -> Path:
    """$APCSCORE_CACHE, default ~/.cache/apcscore (gguf_cache.cache_root's twin: kernels import no other module)."""
    root = os.environ.get("APCSCORE_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "apcscore"


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


def _foreign(st: os.stat_result) -> str | None:
    """Why st's owner is not trusted: anyone but this user and root (uid 0, who could replace our files anyway)."""
    return None if st.st_uid in (os.getuid(), 0) else f"belongs to another user (uid {st.st_uid})"


def folder_problem(st: os.stat_result) -> str | None:
    """Why a folder of the kernel cache (the root or its kernels folder) must not be trusted, or None: not a folder,
    another user's, or one that its group or other users can write without the sticky bit (they could put a file
    under our library's name in it, or rename ours away)."""
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        return f"can be written by its group or other users and has no sticky bit (mode {stat.filemode(st.st_mode)})"
    return _foreign(st)


def file_problem(st: os.stat_result) -> str | None:
    """Why a library file (fstat of its open descriptor) must not be loaded, or None."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"can be written by its group or other users (mode {stat.filemode(st.st_mode)})"
    if st.st_nlink != 1:
        return f"has {st.st_nlink} names (hard links): it may be another file linked in under this name"
    return _foreign(st)


def build(cc: list[str], out: Path) -> Path:
    """Compile the sources into `out` (in a private folder: see the module doc), mode 0755."""
    names = " and ".join(src.name for src in SOURCES)
    try:
        res = subprocess.run([*cc, *FLAGS, "-o", str(out), *map(str, SOURCES), "-lm"], capture_output=True,
                             text=True, timeout=BUILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise CpuGemmUnavailable(f"compiling {names} with {shlex.join(cc)} took more than {BUILD_TIMEOUT} s; "
                                 "try again on a less loaded machine, or set $CC to a faster compiler") from None
    if res.returncode != 0:
        raise CpuGemmUnavailable(f"compiling {names} with {shlex.join(cc)} failed:\n{res.stderr.strip()[-2000:]}")
    os.chmod(out, 0o755)  # the linker's mode follows the umask (group-writable under 002)
    return out


def _load(fd: int) -> ctypes.CDLL:
    """The library open at fd, checked (file_problem) and loaded through the descriptor, with its entry
    points declared (_Untrusted; OSError: dlopen refused it; AttributeError: an entry point is missing). fd is
    closed, or held where the library was loaded (see _held)."""
    try:
        problem = file_problem(os.fstat(fd))
        if problem:
            raise _Untrusted(problem)
        fds = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
        lib = ctypes.CDLL(f"{fds}/{fd}")
    except BaseException:
        os.close(fd)
        raise
    _held.append(fd)
    _declare(lib)
    return lib


def _open_folder(name: str | Path, dir_fd: int | None, shown: Path, follow: bool) -> int:
    """A descriptor of a folder of the cache, checked (folder_problem; _NotUsed); FileNotFoundError where absent."""
    flags = os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno in (errno.ENOTDIR, errno.ELOOP) and not follow and shown.is_symlink():
            raise _NotUsed(f"is not used: {shown} is a symbolic link (not followed)",
                           "replace it with a folder, or set APCSCORE_CACHE to a folder only you can write") from None
        raise _NotUsed(f"cannot be used ({shown}: {e.strerror or e})",
                       "set APCSCORE_CACHE to a folder you can write") from None
    st = os.fstat(fd)
    problem = folder_problem(st)
    if problem:
        os.close(fd)
        todo = ("set APCSCORE_CACHE to a folder of your own" if _foreign(st) else
                f"run chmod go-w {shown}, or set APCSCORE_CACHE to a folder only you can write")
        raise _NotUsed(f"is not used: {shown} {problem}", todo)
    return fd


def _open_cache() -> int:
    """A descriptor of the kernel cache folder, checked with the cache root; the folders made (mode 0755) where
    missing. _NotUsed where one is refused or cannot be made."""
    root = cache_root()
    try:
        return _open_kernels(root)
    except FileNotFoundError:
        pass
    try:
        root.mkdir(mode=0o755, parents=True, exist_ok=True)
        (root / "kernels").mkdir(mode=0o755, exist_ok=True)
    except OSError as e:  # read-only, under a file, no space: the cache is only a cache
        raise _NotUsed(f"cannot be written ({e.strerror or e})", "set APCSCORE_CACHE to a folder you can write") \
            from None
    return _open_kernels(root)


def _open_kernels(root: Path) -> int:
    """root/kernels opened through root, both checked (FileNotFoundError where one is missing)."""
    root_fd = _open_folder(root, None, root, follow=True)  # the root may be a link (~/.cache on another disk)
    try:
        return _open_folder("kernels", root_fd, root / "kernels", follow=False)
    finally:
        os.close(root_fd)


def _from_cache(cc: list[str], name: str) -> ctypes.CDLL:
    """The library from the cache, built into it where absent (see the module doc). _NotUsed where the cache or the
    file under our name is not used."""
    folder = cache_root() / "kernels"
    todo = f"remove {folder / name} (the next run builds it there), or set APCSCORE_CACHE to a folder of your own"
    folder_fd = _open_cache()
    try:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | _CLOEXEC, dir_fd=folder_fd)
        except FileNotFoundError:
            fd = None
        except OSError as e:
            why = "is a symbolic link (not followed)" if e.errno == errno.ELOOP else f"cannot be read ({e.strerror})"
            raise _NotUsed(f"has {name}, but it {why}", todo) from None
        if fd is not None:
            try:
                return _load(fd)
            except _Untrusted as e:
                raise _NotUsed(f"has {name}, but it {e}", todo) from None
            except (OSError, AttributeError) as e:  # damaged, another machine's, or without our entry points
                raise _NotUsed(f"has {name}, which could not be loaded ({e})", todo) from None
        return _build_in_cache(cc, name, folder, folder_fd)
    finally:
        os.close(folder_fd)


def _build_in_cache(cc: list[str], name: str, folder: Path, folder_fd: int) -> ctypes.CDLL:
    """Build in a private folder inside the cache folder, load that copy, then rename it into the cache (atomic).
    The path is safe to use here: the cache root was checked, so only this user or root can move the folder."""
    try:
        tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=folder))
    except OSError as e:  # a read-only (shared) cache without this build
        raise _NotUsed(f"cannot be written ({e.strerror or e})", "set APCSCORE_CACHE to a folder you can write") \
            from None
    try:
        lib = _load_built(build(cc, tmp / name))
        try:
            os.replace(tmp / name, name, dst_dir_fd=folder_fd)
        except OSError as e:  # the process has its library; the next one builds again
            warnings.warn(f"the CPU kernel cache {folder} cannot keep the library just built ({e.strerror or e}); "
                          "the next process builds it again", stacklevel=4)
        return lib
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_built(path: Path) -> ctypes.CDLL:
    """Load a library we have just built (in a private folder): CpuGemmUnavailable where that fails."""
    try:
        return _load(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | _CLOEXEC))
    except (OSError, _Untrusted, AttributeError) as e:
        raise CpuGemmUnavailable(f"the CPU kernels just built ({path.name}) cannot be loaded: {e}") from None


def _private(cc: list[str], name: str) -> ctypes.CDLL:
    """Build and load a copy for this process alone, in a temporary folder removed once it is loaded."""
    with tempfile.TemporaryDirectory(prefix="apcscore-kernels-") as tmp:
        return _load_built(build(cc, Path(tmp) / name))


def library() -> ctypes.CDLL:
    """The loaded kernel library (compiled on first use; see the module doc): CpuGemmUnavailable where there is
    none, never another exception."""
    global _lib
    if _lib is None:
        try:
            cc = compiler()
            name = library_name(cc)
            try:
                lib = _from_cache(cc, name)
            except _NotUsed as e:
                warnings.warn(f"the CPU kernel cache {cache_root() / 'kernels'} {e.why}; building a private copy for "
                              f"this process — {e.todo}", stacklevel=2)
                lib = _private(cc, name)
        except OSError as e:  # no temporary folder, an unreadable source, ...
            raise CpuGemmUnavailable(f"cannot build or load the compiled CPU kernels: {e}") from None
        _lib = lib
    return _lib


def _declare(lib: ctypes.CDLL) -> None:
    """The ctypes signatures of the entry points (SIGNATURES); AttributeError where one is missing."""
    for name, (args, res) in SIGNATURES.items():
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
