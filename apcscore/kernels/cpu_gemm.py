"""The CPU's batch-invariant linear layer: our own GEMM (cpu_gemm.c), whose reduction order is fixed by design.

Why our own: a BLAS library picks its kernel, blocking and threading from the shape of the call, and where it
does so depends on the CPU (MKL on an Intel Xeon changes a row's bits at M = 64..192 of the down projection,
even for multiples of 16; on AMD EPYC it did not). No BLAS documents that a row's bits do not depend on the
row count. cpu_gemm.c computes every output element as one fma chain over k in ascending order (its header
says why that makes the bits a function of the row of x, the row of w and K alone, on any x86 or other CPU),
so the guarantee is our code's, not an observation of one machine; `apcscore.engine.gemm_probe` checks it
when an engine starts.

The C file is compiled once per machine with the C compiler (`$CC`, else `cc` / `gcc`; Triton needs one too)
into the kernel cache (`$APCSCORE_CACHE/kernels`, default ~/.cache/apcscore/kernels), named by a hash of
the source, the compiler and its flags, and loaded with ctypes after torch, so its OpenMP calls run on
torch's own OpenMP runtime. `CpuGemmUnavailable` says why when it cannot be built.

Weights are packed once per weight into the kernel's panel layout (kept in their own dtype: fp32, bf16 or
fp16; re-packed when the weight changes in place), activations per call. Outputs are fp32, cast to x's dtype
afterwards (round to nearest even, element by element); a bias is added afterwards, element by element.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_gemm.c")
FLAGS = ["-O2", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off", "-fno-fast-math", "-std=gnu11"]
PARALLEL_MIN_MACS = 1 << 20  # multiply-adds below which one thread computes the whole product
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_lib: ctypes.CDLL | None = None


class CpuGemmUnavailable(RuntimeError):
    """The fixed-order CPU GEMM could not be built or loaded here (no C compiler, a failed build)."""


def kernel_cache_dir() -> Path:
    """Where compiled kernels are kept: $APCSCORE_CACHE/kernels, default ~/.cache/apcscore/kernels."""
    root = os.environ.get("APCSCORE_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "apcscore") / "kernels"


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise CpuGemmUnavailable("no C compiler found (set $CC, or install gcc); the batch-invariant CPU GEMM is "
                             "compiled from apcscore/kernels/cpu_gemm.c on first use")


def library_path() -> Path:
    """The compiled library for this source, compiler and flags (built if missing); see the module doc."""
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise CpuGemmUnavailable(f"the C compiler {cc!r} does not run: {e}") from None
    key = hashlib.sha256(SOURCE.read_bytes() + version.encode() + " ".join(FLAGS).encode()).hexdigest()[:16]
    path = kernel_cache_dir() / f"cpu_gemm-{key}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)  # built aside, renamed into place: atomic
    os.close(fd)
    try:
        res = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            raise CpuGemmUnavailable(f"compiling {SOURCE.name} with {cc} failed:\n{res.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def library() -> ctypes.CDLL:
    """The loaded kernel library (compiled on first use)."""
    global _lib
    if _lib is None:
        try:
            lib = ctypes.CDLL(str(library_path()))
        except OSError as e:
            raise CpuGemmUnavailable(f"cannot load the compiled CPU GEMM: {e}") from None
        lib.apc_packed_b_bytes.argtypes, lib.apc_packed_b_bytes.restype = [_i64, _i64, _int], _i64
        lib.apc_workspace_bytes.argtypes, lib.apc_workspace_bytes.restype = [_i64, _int], _i64
        lib.apc_simd_level.argtypes, lib.apc_simd_level.restype = [], _int
        lib.apc_pack_b.argtypes, lib.apc_pack_b.restype = [_ptr, _int, _i64, _i64, _i64, _i64, _ptr, _int], None
        lib.apc_gemm.argtypes = [_i64, _i64, _i64, _ptr, _int, _i64, _i64, _ptr, _int, _ptr, _i64, _ptr, _int, _int]
        lib.apc_gemm.restype = None
        lib.apc_bmm_workspace_bytes.argtypes, lib.apc_bmm_workspace_bytes.restype = [_i64, _i64, _int, _int], _i64
        lib.apc_bmm.argtypes = [_i64] * 5 + [_ptr, _int] + [_i64] * 4 + [_ptr, _int] + [_i64] * 4 + \
            [_ptr, _i64, _i64, _i64, _ptr, _int, _int]
        lib.apc_bmm.restype = None
        _lib = lib
    return _lib


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether the kernel builds and loads here (asked once per process; library() says why not)."""
    try:
        library()
        return True
    except CpuGemmUnavailable:
        return False


SIMD_NAMES = {2: "avx512-fma", 1: "avx2-fma", 0: "scalar-fma"}


def simd_level() -> str:
    """The micro-kernel this CPU runs: "avx512-fma", "avx2-fma" or "scalar-fma" (the same bits on each)."""
    return SIMD_NAMES[library().apc_simd_level()]


def _code(t: torch.Tensor, name: str) -> int:
    code = DTYPE_CODES.get(t.dtype)
    if code is None:
        raise ValueError(f"fixed-order GEMM: {name} is {t.dtype}; one of float32, bfloat16, float16")
    if t.device.type != "cpu":
        raise ValueError(f"fixed-order GEMM: {name} is on {t.device}, not the CPU")
    return code


class PackedWeight:
    """A weight [N, K] in the kernel's panel layout (its own dtype), and the version of the weight it copies."""

    def __init__(self, weight: torch.Tensor, nthreads: int) -> None:
        lib = library()
        self.code = _code(weight, "weight")
        self.n, self.k = weight.shape
        self.version = weight._version
        # held, so that no other tensor can get this memory (and so this entry's key) while the entry lives: a
        # freed temporary's address would otherwise serve the next temporary of its shape the old packing
        self.weight = weight
        self.data = torch.empty(lib.apc_packed_b_bytes(self.n, self.k, self.code), dtype=torch.uint8)
        lib.apc_pack_b(weight.data_ptr(), self.code, self.n, self.k, weight.stride(0), weight.stride(1),
                       self.data.data_ptr(), nthreads)


class FixedOrderLinear:
    """linear(x [M, K], weight [N, K], bias=None, out=None) -> [M, N] in x's dtype: every element one fma chain.

    `out` (a reused buffer with >= M rows, contiguous rows) receives the result when it is fp32 (the logits);
    the result is then a view of it. Packed weights are kept per weight (keyed by storage, shape, strides and
    dtype; its in-place version counter invalidates an entry), for the life of this object (one model's).
    Any M works (no padding rows: a row's bits cannot depend on M).
    """

    # x and weight may differ in dtype (fp32 rows x a bf16 LM head): each is converted exactly to fp32 in the kernel
    mixed_dtypes = True

    def __init__(self, simd: int = -1) -> None:
        self.simd = simd  # -1: the best micro-kernel of this CPU; 0 scalar, 1 AVX2 (tests; at most the CPU's)
        self._packed: dict[tuple, PackedWeight] = {}
        self._workspace = torch.empty(0, dtype=torch.uint8)

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        """The packed form of `weight` (packed now if new or changed since)."""
        key = (weight.data_ptr(), tuple(weight.shape), tuple(weight.stride()), weight.dtype)
        packed = self._packed.get(key)
        if packed is None or packed.version != weight._version:
            packed = self._packed[key] = PackedWeight(weight, torch.get_num_threads())
        return packed

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
            raise ValueError(f"fixed-order GEMM: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not "
                             "multiply as x @ weight.T")
        lib = library()
        code = _code(x, "x")
        w = self.pack(weight)
        m, k = x.shape
        n = w.n
        direct = (out is not None and out.dtype == torch.float32 and out.dim() == 2 and out.shape[0] >= m
                  and out.shape[1] == n and (n <= 1 or out.stride(1) == 1))
        y = out[:m] if direct else torch.empty(m, n, dtype=torch.float32)
        if m:
            # small products run on one thread (a parallel region costs more than they do); bits are the same
            threads = torch.get_num_threads() if m * n * k >= PARALLEL_MIN_MACS else 1
            need = lib.apc_workspace_bytes(k, threads)
            if self._workspace.numel() < need:
                self._workspace = torch.empty(need, dtype=torch.uint8)
            lib.apc_gemm(m, n, k, x.data_ptr(), code, x.stride(0), x.stride(1), w.data.data_ptr(), w.code,
                         y.data_ptr(), y.stride(0), self._workspace.data_ptr(), threads, self.simd)
        if not direct:
            y = y.to(x.dtype)
            if out is not None:
                out[:m].copy_(y)
                y = out[:m]
        return y if bias is None else y + bias


_bmm_workspace = torch.empty(0, dtype=torch.uint8)


def fixed_order_bmm(a: torch.Tensor, b: torch.Tensor, simd: int = -1) -> torch.Tensor:
    """a [*lead, M, K] @ b[*lead, N, K].T -> fp32 [*lead, M, N] (up to two leading dims, any strides: pass
    `v.transpose(-1, -2)` for a @ v), every element one fma chain over k (the linear layer's construction).

    Attention's products: a row's scores and weighted values then cannot depend on how many rows or keys the
    call holds. Each product runs on one thread; the products are spread over torch's threads.
    """
    global _bmm_workspace
    if a.dim() != b.dim() or not 2 <= a.dim() <= 4 or a.shape[:-2] != b.shape[:-2] or a.shape[-1] != b.shape[-1]:
        raise ValueError(f"fixed-order bmm: a {tuple(a.shape)} and b {tuple(b.shape)} do not multiply as a @ b.T")
    lib = library()
    lead = a.shape[:-2]
    a4, b4 = a.reshape(1, 1, *a.shape[-2:]) if not lead else a, b.reshape(1, 1, *b.shape[-2:]) if not lead else b
    if len(lead) == 1:
        a4, b4 = a.unsqueeze(0), b.unsqueeze(0)
    (b0, b1, m, k), n = a4.shape, b4.shape[-2]
    c = torch.empty(b0, b1, m, n, dtype=torch.float32)
    if c.numel():
        threads = torch.get_num_threads()
        need = lib.apc_bmm_workspace_bytes(n, k, _code(b, "b"), threads)
        if _bmm_workspace.numel() < need:
            _bmm_workspace = torch.empty(need, dtype=torch.uint8)
        lib.apc_bmm(b0, b1, m, n, k, a4.data_ptr(), _code(a, "a"), *a4.stride(), b4.data_ptr(), _code(b, "b"),
                    *b4.stride(), c.data_ptr(), *c.stride()[:3], _bmm_workspace.data_ptr(), threads, simd)
    return c.view(*lead, m, n)
