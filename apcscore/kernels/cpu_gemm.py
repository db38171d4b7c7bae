"""The CPU's batch-invariant linear layer: our own GEMM (cpu_gemm.c), whose reduction order is fixed by design.

Why our own: a BLAS library picks its kernel, blocking and threading from the shape of the call, and where it
does so depends on the CPU (MKL on an Intel Xeon changes a row's bits at M = 64..192 of the down projection,
even for multiples of 16; on AMD EPYC it did not). No BLAS documents that a row's bits do not depend on the
row count. cpu_gemm.c computes every output element in one fixed order: an fma chain over each block of 64
consecutive k, the blocks' sums added in ascending order (its header says why that makes the bits a function of
the row of x, the row of w and K alone, on any x86 or other CPU, and why blocks: accuracy),
so the guarantee is our code's, not an observation of one machine; `apcscore.engine.gemm_probe` checks it
when an engine starts.

The C files are compiled on first use into one library, loaded with ctypes after torch, so that its OpenMP calls
run on torch's own OpenMP runtime (apcscore.kernels.cpu_library). The workspaces the kernels write are per thread
(kernels/buffers.py). `APCSCORE_SIMD` (scalar, avx2, avx512) caps the instruction set of every kernel in it, so
that tests compare them on one machine (the bits are the same).

Weights are packed once per weight into the kernel's panel layout (kept in their own dtype: fp32, bf16 or
fp16; re-packed when the weight changes in place), activations per call. Outputs are fp32, cast to x's dtype
afterwards (round to nearest even, element by element); a bias is added afterwards, element by element.
"""

from __future__ import annotations

import torch

from apcscore.kernels.buffers import reused_buffer
from apcscore.kernels.cpu_library import forced_simd, library

PARALLEL_MIN_MACS = 1 << 20  # multiply-adds below which one thread computes the whole product
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # cpu_vec.h's DT_*

SIMD_NAMES = {2: "avx512-fma", 1: "avx2-fma", 0: "scalar-fma"}


def simd_level() -> str:
    """The micro-kernel that runs: "avx512-fma", "avx2-fma" or "scalar-fma" (the same bits on each): the best this
    CPU has, or less where APCSCORE_SIMD says."""
    best = library().apc_simd_level()
    forced = forced_simd()
    return SIMD_NAMES[best if forced < 0 else min(forced, best)]


def order_version() -> int:
    """The version of the GEMM's summation order (cpu_gemm.c's header): it decides bits, so runs record it."""
    return library().apc_order_version()


def _code(t: torch.Tensor, name: str) -> int:
    code = DTYPE_CODES.get(t.dtype)
    if code is None:
        raise ValueError(f"fixed-order GEMM: {name} is {t.dtype}; one of float32, bfloat16, float16")
    if t.device.type != "cpu":
        raise ValueError(f"fixed-order GEMM: {name} is on {t.device}, not the CPU")
    return code


class FixedOrderLinear:
    """linear(x [M, K], weight [N, K], bias=None, out=None) -> [M, N] in x's dtype: every element in the fixed
    order (blocked fma chains).

    `out` (a reused buffer with >= M rows, contiguous rows) receives the result when it is fp32 (the logits);
    the result is then a view of it. Packed weights are kept per weight (keyed by storage, shape, strides and
    dtype; its in-place version counter invalidates an entry), for the life of this object (one model's).
    Any M works (no padding rows: a row's bits cannot depend on M).
    """

    # x and weight may differ in dtype (fp32 rows x a bf16 LM head): each is converted exactly to fp32 in the kernel
    mixed_dtypes = True
    # the same bits on every CPU, by construction (with the portable row math: models/ops.portable_construction)
    portable = True

    def __init__(self, simd: int | None = None) -> None:
        # -1: the best micro-kernel of this CPU; 0 scalar, 1 AVX2, 2 AVX-512 (at most the CPU's); None: APCSCORE_SIMD
        self.simd = forced_simd() if simd is None else simd
        # key -> (the weight's version it copies, the weight, its packed bytes); the weight is held so that no other
        # tensor can get its memory (and so this entry's key) while the entry lives: a freed temporary's address
        # would otherwise serve the next temporary of its shape the old packing
        self._packed: dict[tuple, tuple[int, torch.Tensor, torch.Tensor]] = {}

    @property
    def construction(self) -> str:
        """How the reduction order is fixed, as the run metadata records it (numerics.linear)."""
        return f"apcscore fixed-order GEMM, order {order_version()} (blocked fma chains)"

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` [N, K] in the kernel's panel layout, in its own dtype, as bytes (packed now if new or changed
        since)."""
        key = (weight.data_ptr(), tuple(weight.shape), tuple(weight.stride()), weight.dtype)
        entry = self._packed.get(key)
        if entry is None or entry[0] != weight._version:
            lib, code, (n, k) = library(), _code(weight, "weight"), weight.shape
            data = torch.empty(lib.apc_packed_b_bytes(n, k, code), dtype=torch.uint8)
            lib.apc_pack_b(weight.data_ptr(), code, n, k, weight.stride(0), weight.stride(1), data.data_ptr(),
                           torch.get_num_threads())
            entry = self._packed[key] = (weight._version, weight, data)
        return entry[2]

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
            raise ValueError(f"fixed-order GEMM: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not "
                             "multiply as x @ weight.T")
        lib = library()
        code, w_code = _code(x, "x"), _code(weight, "weight")
        packed = self.pack(weight)
        (m, k), n = x.shape, weight.shape[0]
        direct = (out is not None and out.dtype == torch.float32 and out.dim() == 2 and out.shape[0] >= m
                  and out.shape[1] == n and (n <= 1 or out.stride(1) == 1))
        y = out[:m] if direct else torch.empty(m, n, dtype=torch.float32)
        if m:
            # small products run on one thread (a parallel region costs more than they do); bits are the same
            threads = torch.get_num_threads() if m * n * k >= PARALLEL_MIN_MACS else 1
            workspace = reused_buffer("gemm", (lib.apc_workspace_bytes(k, threads),))
            lib.apc_gemm(m, n, k, x.data_ptr(), code, x.stride(0), x.stride(1), packed.data_ptr(), w_code,
                         y.data_ptr(), y.stride(0), workspace.data_ptr(), threads, self.simd)
        if not direct:
            y = y.to(x.dtype)
            if out is not None:
                y = out[:m].copy_(y)
        return y if bias is None else y + bias


def fixed_order_bmm(a: torch.Tensor, b: torch.Tensor, simd: int | None = None) -> torch.Tensor:
    """a [*lead, M, K] @ b[*lead, N, K].T -> fp32 [*lead, M, N] (up to two leading dims, any strides: pass
    `v.transpose(-1, -2)` for a @ v), every element in the linear layer's fixed order (one fma chain per block of
    64 k: attention's head_dim and key tiles are one block).

    Attention's products: a row's scores and weighted values then cannot depend on how many rows or keys the
    call holds. Each product runs on one thread; the products are spread over torch's threads.
    """
    simd = forced_simd() if simd is None else simd
    if a.dim() != b.dim() or not 2 <= a.dim() <= 4 or a.shape[:-2] != b.shape[:-2] or a.shape[-1] != b.shape[-1]:
        raise ValueError(f"fixed-order bmm: a {tuple(a.shape)} and b {tuple(b.shape)} do not multiply as a @ b.T")
    lib = library()
    lead = a.shape[:-2]
    a4, b4 = (x[(None,) * (4 - x.dim())] for x in (a, b))  # two leading dims: size 1 where absent
    (b0, b1, m, k), n = a4.shape, b4.shape[-2]
    c = torch.empty(b0, b1, m, n, dtype=torch.float32)
    if c.numel():
        threads = torch.get_num_threads()
        workspace = reused_buffer("bmm", (lib.apc_bmm_workspace_bytes(n, k, _code(b, "b"), threads),))
        lib.apc_bmm(b0, b1, m, n, k, a4.data_ptr(), _code(a, "a"), *a4.stride(), b4.data_ptr(), _code(b, "b"),
                    *b4.stride(), c.data_ptr(), *c.stride()[:3], workspace.data_ptr(), threads, simd)
    return c.view(*lead, m, n)


def paged_bmm(a: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor, first: int,
              num_keys: int | None = None, simd: int | None = None) -> torch.Tensor:
    """fixed_order_bmm with b read in place from a paged KV cache (decode attention: no gathered copy).

    cache: [num_blocks, block_size, H, D] (D contiguous; fp32, bf16 or fp16); tables: [S, max_blocks] int32
    block ids per sequence; seq_lens: [S] int32. Sequence s's row at position pos (head h) is
    cache[tables[s, pos // block_size], pos % block_size, h]; positions at or past seq_lens[s] read its position
    0 (they are masked; the gathering path pads them the same way).
    - num_keys given (scores): a [H, S, M, D] @ key(first + n).T for n < num_keys -> [H, S, M, num_keys];
    - num_keys None (weighted values): a [H, S, T, M, KT] @ V of tile t, the KT keys from first + t * KT,
      -> [H, S, T, M, D].
    Every element is the same fma chain, on the same values, as fixed_order_bmm of the gathered copy: the same bits.
    """
    simd = forced_simd() if simd is None else simd
    values = num_keys is None
    a5 = a if values else a.unsqueeze(2)
    heads, seqs, tiles, m, k = a5.shape
    n = cache.shape[3] if values else num_keys
    if (cache.dim() != 4 or cache.shape[2] != heads or cache.stride(3) != 1 or (not values and k != cache.shape[3])
            or tables.dtype != torch.int32 or seq_lens.dtype != torch.int32 or tables.shape[0] != seqs
            or not tables.is_contiguous() or not seq_lens.is_contiguous() or seq_lens.shape != (seqs,)):
        raise ValueError(f"paged bmm: a {tuple(a.shape)}, cache {tuple(cache.shape)}, tables {tuple(tables.shape)} "
                         f"{tables.dtype}, seq_lens {tuple(seq_lens.shape)} {seq_lens.dtype} do not fit together")
    lib = library()
    c = torch.empty(heads, seqs, tiles, m, n, dtype=torch.float32)
    if c.numel():
        threads = torch.get_num_threads()
        code = _code(cache, "cache")
        workspace = reused_buffer("bmm", (lib.apc_bmm_paged_workspace_bytes(n, k, code, threads),))
        lib.apc_bmm_paged(heads, seqs, tiles, m, n, k, a5.data_ptr(), _code(a, "a"), *a5.stride(), cache.data_ptr(),
                          code, *cache.stride()[:3], tables.data_ptr(), tables.stride(0), seq_lens.data_ptr(),
                          cache.shape[1], first, int(values), c.data_ptr(), *c.stride()[:4], workspace.data_ptr(),
                          threads, simd)
    return c if values else c.squeeze(2)
