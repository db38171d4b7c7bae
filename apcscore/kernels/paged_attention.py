"""Triton kernel: causal paged attention for prefill and decode alike, batch-invariant by construction.

One program owns one query tile of one sequence and one KV head. The rows of the tile are (token, query head)
pairs: BLOCK_Q consecutive query tokens times the GROUP query heads that share the KV head, so a decode
step still fills the tl.dot M dimension and each key tile is loaded once per KV-head group. Every query reads
all keys of its sequence, cached or new, from the paged cache through its block table, in key tiles of
BLOCK_N positions counted from position 0, with an online softmax in fp32, and stops at the causal limit.
A query's reduction therefore runs over the same tiles in the same order whatever the batch holds, however
its prompt was chunked and whatever was cached: the result is bitwise the same for fixed BLOCK_M/BLOCK_N.
There is no split-K: one program reduces a query's whole context.

Two optional masks for Gemma 2/3, each behind a constexpr flag (off: the compiled code is the causal kernel's):
- a sliding window (WINDOW): a query at position p sees keys k with p - window < k <= p (transformers' rule).
  Keys outside are masked to -inf inside the same fixed key tiles; the loop starts at the tile holding the
  tile's first query's first visible key. A row's running max stays -inf until its first visible tile, and
  the exponent then subtracts 0 instead (no -inf - -inf = NaN), so its state stays exactly the initial one
  (-inf, 0, 0): how many wholly masked tiles a row's program walks first (which depends on the chunking)
  changes no bit.
- soft-capping (SOFTCAP): scores become tanh(s / c) * c before masking, tanh written with exp2
  (tanh |x| = (1 - e) / (1 + e), e = 2^(-2 |x| log2 e)): neither tl.math nor the interpreter has a tanh.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from apcscore.kernels._checks import INDEX_DTYPES, check_dtype, check_float_input, check_shape, check_tensors

# (block_m, block_n, num_warps) by head_dim. They depend on the model only, never on the batch, because the
# reduction order, and so the bits of the result, depend on them. block_m: rows of a query tile, block_m //
# group tokens x group query heads (raised to the group size); block_n: keys per tile. Chosen so that the
# sm_90 build uses no local-memory spills (ptxas resource usage); not timed on a GPU yet.
TILE_CONFIGS = {64: (64, 64, 4), 128: (64, 32, 8), 256: (32, 32, 8)}
MAX_HEAD_DIM = 256


def tile_config(head_dim: int, group: int) -> tuple[int, int, int]:
    """Default (block_m, block_n, num_warps) of a model with this head_dim and query-head group size."""
    block_m, block_n, num_warps = next(cfg for d, cfg in sorted(TILE_CONFIGS.items()) if head_dim <= d)
    return max(block_m, triton.next_power_of_2(group)), block_n, num_warps


@triton.jit
def _find_seq_idx(cu_seqlens_q_ptr, q_tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning global query tile q_tile; sequence i's tiles start at cu_seqlens_q[i] // BLOCK_Q + i."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if first_tile <= q_tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


LOG2E = 1.4426950408889634  # log2(e): scores are kept in base 2


@triton.jit
def _soft_cap(s, softcap_log2):
    """tanh(s / c) * c of base-2 scores s (softcap_log2 = c * log2(e)), the tanh made of exp2."""
    e = tl.exp2(tl.abs(s) * (-2.0 * 1.4426950408889634 / softcap_log2))  # exp(-2 |s / c|) in (0, 1]
    t = (1.0 - e) / (1.0 + e)  # tanh |s / c|
    return tl.where(s < 0, -t, t) * softcap_log2


@triton.jit
def _tile_scores(q, k_cache_ptr, table_ptr, n, n_ok, kv_head, d, d_ok, scale_log2, softcap_log2, stride_kb, stride_ks,
                 stride_kh, BLOCK_SIZE: tl.constexpr, IEEE_DOT: tl.constexpr, SOFTCAP: tl.constexpr):
    """The base-2 scores [BLOCK_M, BLOCK_N] of queries q against the keys at positions n ([BLOCK_N]; n_ok: inside
    the sequence, whose block table row is at table_ptr), soft-capped with SOFTCAP, and where those keys lie
    (block, offset: _tile_update reads the values there)."""
    block = tl.load(table_ptr + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
    offset = n % BLOCK_SIZE
    k_off = block * stride_kb + offset * stride_ks + kv_head * stride_kh  # [BLOCK_N]
    k = tl.load(k_cache_ptr + k_off[None, :] + d[:, None], mask=n_ok[None, :] & d_ok[:, None],
                other=0.0)  # [BLOCK_D, BLOCK_N]
    if IEEE_DOT:
        s = tl.dot(q, k, input_precision="ieee")
    else:
        s = tl.dot(q, k)
    s = s * scale_log2  # [BLOCK_M, BLOCK_N] fp32
    if SOFTCAP:
        s = _soft_cap(s, softcap_log2)
    return s, block, offset


@triton.jit
def _tile_update(s, m_i, l_i, acc, v_cache_ptr, block, offset, n_ok, kv_head, d, d_ok, stride_vb, stride_vs,
                 stride_vh, IEEE_DOT: tl.constexpr, WINDOW: tl.constexpr):
    """The online softmax's step over one key tile, from its masked scores s (_tile_scores', -inf where a row does
    not see a key): the rows' new running max, running sum of exp2 and accumulator [BLOCK_M, BLOCK_D]."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if WINDOW:  # -inf until a row's first visible key: subtract 0 then (p = 0, alpha = 0, no NaN)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(s - m_sub[:, None])
    else:
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
    l_new = l_i * alpha + tl.sum(p, 1)
    v_off = block * stride_vb + offset * stride_vs + kv_head * stride_vh
    v = tl.load(v_cache_ptr + v_off[:, None] + d[None, :], mask=n_ok[:, None] & d_ok[None, :],
                other=0.0)  # [BLOCK_N, BLOCK_D]
    if IEEE_DOT:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_new, acc * alpha[:, None] + pv


# Triton compiles a variant per integer argument's value class (== 1, divisible by 16, other) unless told not
# to. The arguments that change with the batch (num_seqs; stride_bt, the block table's width: the longest
# sequence's blocks) are exempt, so every batch runs one compiled kernel, and none compiles in the middle of a
# run (window: one compile per model, not per value). The others are fixed by the model and the KV pool.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt", "window"])
def _paged_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, seq_lens_ptr,
        skip_ptr,  # [B] int32: 1 = a sequence the shared-prefix decode kernel computes (read only with SKIP)
        scale_log2,  # softmax scale * log2(e): scores are kept in base 2
        num_seqs,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,  # cache strides (head_dim contiguous)
        stride_bt,  # block_tables row stride
        softcap_log2,  # soft-cap c * log2(e), read only with SOFTCAP (last: the other arguments keep their slots)
        window,  # a query at p sees keys > p - window (read only with WINDOW)
        BLOCK_SIZE: tl.constexpr,  # tokens per cache block
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, IEEE_DOT: tl.constexpr,
        WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False, SKIP: tl.constexpr = False):
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq_idx(cu_seqlens_q_ptr, q_tile, num_seqs, BLOCK_Q)
    if SKIP:
        if tl.load(skip_ptr + seq) != 0:  # its decode group's program writes it
            return
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    tile = q_tile - (q_start // BLOCK_Q + seq)  # this program's tile within the sequence
    if tile * BLOCK_Q >= q_len:  # spare program (the grid is an upper bound) or an empty sequence
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # position of the sequence's first query

    rows = tl.arange(0, BLOCK_M)
    tok = tile * BLOCK_Q + rows // GROUP  # [BLOCK_M] query index within the sequence
    head = kv_head * GROUP + rows % GROUP  # [BLOCK_M] query head
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = context_len + tok  # [BLOCK_M] absolute position (rows that are not ok see every key: no NaN)
    if WINDOW:  # ... and with a window, the tile's last key (they would see none past the sequence's end)
        q_pos = tl.where(row_ok, q_pos, context_len + tl.minimum((tile + 1) * BLOCK_Q, q_len) - 1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_row = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh  # [BLOCK_M]
    q = tl.load(q_ptr + q_row[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (base-2 scores)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Causal limit of the tile's last query; key tiles past a row's own limit are exact no-ops for that row.
    kv_end = context_len + tl.minimum((tile + 1) * BLOCK_Q, q_len)
    kv_start = 0
    if WINDOW:  # tiles wholly before the tile's first query's window: exact no-ops for every row, skipped
        kv_start = tl.maximum(context_len + tile * BLOCK_Q - window + 1, 0) // BLOCK_N * BLOCK_N
    for start_n in range(kv_start, kv_end, BLOCK_N):
        n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        n_ok = n < kv_end
        s, block, offset = _tile_scores(q, k_cache_ptr, block_tables_ptr + seq * stride_bt, n, n_ok, kv_head, d, d_ok,
                                        scale_log2, softcap_log2, stride_kb, stride_ks, stride_kh, BLOCK_SIZE, IEEE_DOT,
                                        SOFTCAP)
        causal = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        if WINDOW:
            causal = causal & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(causal, s, float("-inf"))
        # causal only, the running max is finite (key 0 is in every row's first tile)
        m_i, l_i, acc = _tile_update(s, m_i, l_i, acc, v_cache_ptr, block, offset, n_ok, kv_head, d, d_ok, stride_vb,
                                     stride_vs, stride_vh, IEEE_DOT, WINDOW)
    acc = acc / l_i[:, None]
    o_row = (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_ptr + o_row[:, None] + d[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float | None = None, *,
                    window: int | None = None, softcap: float | None = None,
                    block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                    out: torch.Tensor | None = None, skip: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of every query over its sequence's keys in the paged cache (torch_backend semantics).

    query: [T, num_heads, head_dim] (head_dim contiguous); k_cache, v_cache: [num_blocks, block_size,
    num_kv_heads, head_dim], contiguous, same dtype as query; block_tables [B, max_blocks], cu_seqlens_q
    [B + 1], seq_lens [B] (the step's AttentionMetadata fields) on the query's device. Returns [T, num_heads,
    head_dim] in query.dtype (into `out` if given, contiguous, query's shape and dtype); rows past cu_seqlens_q[-1]
    are padding and not written (no zero-fill: the caller drops them). Query head h reads KV head
    h // (num_heads // num_kv_heads).
    scale defaults to 1 / sqrt(head_dim). block_m (query rows = tokens x group heads per program, >= the
    group size) and block_n (keys per tile) set the reduction order; their defaults (tile_config) depend on
    the model only, never on the batch, which keeps results batch-invariant.
    window: a query at position p sees only keys > p - window (sliding-window layers); softcap: scores become
    tanh(scores / softcap) * softcap before masking (Gemma 2). None (the default): plain causal attention,
    the same compiled kernel as without these arguments.
    skip: [B] int32 on the device, 1 for the sequences another kernel writes (a decode group's,
    paged_decode_shared): they are left unwritten. None: every sequence.
    """
    name = "paged_attention"
    check_tensors(name, query=query, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                  cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens)
    check_float_input(name, "query", query, 3)
    for arg, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_shape(name, arg, t, 4)
        if not t.is_contiguous():
            raise ValueError(f"{name}: {arg} must be contiguous, got strides {t.stride()}")
        if t.dtype != query.dtype:
            raise ValueError(f"{name}: {arg} has dtype {t.dtype} but query has {query.dtype}; they must match")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"{name}: k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    for arg, t, ndim in (("block_tables", block_tables, 2), ("cu_seqlens_q", cu_seqlens_q, 1),
                         ("seq_lens", seq_lens, 1)):
        check_shape(name, arg, t, ndim)
        check_dtype(name, arg, t, INDEX_DTYPES)
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
        raise ValueError(f"{name}: block_tables rows must be contiguous, got strides {block_tables.stride()}")
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    num_seqs = seq_lens.shape[0]
    if cache_head_dim != head_dim:
        raise ValueError(f"{name}: query head_dim {head_dim} differs from the cache's {cache_head_dim}")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"{name}: head_dim {head_dim} is above the supported {MAX_HEAD_DIM}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{name}: {num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if cu_seqlens_q.shape[0] != num_seqs + 1 or block_tables.shape[0] < num_seqs:
        raise ValueError(f"{name}: cu_seqlens_q {tuple(cu_seqlens_q.shape)}, block_tables "
                         f"{tuple(block_tables.shape)} for {num_seqs} sequences; want [B + 1] and [B, *]")
    group = num_heads // num_kv_heads
    block_m, block_n, num_warps = (given if given is not None else default for given, default
                                   in zip((block_m, block_n, num_warps), tile_config(head_dim, group)))
    if block_m < max(16, group) or block_m & (block_m - 1) or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"{name}: block_m ({block_m}) and block_n ({block_n}) must be powers of two >= 16, "
                         f"and block_m >= the query-head group ({group})")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"{name}: window must be a positive int or None, got {window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{name}: softcap must be positive or None, got {softcap!r}")
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # padding rows: never written
    elif out.shape != query.shape or out.dtype != query.dtype or not out.is_contiguous():
        raise ValueError(f"{name}: out must be contiguous {tuple(query.shape)} {query.dtype}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    if num_seqs == 0 or num_tokens == 0:
        return out
    scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    block_q = block_m // group
    # Sequence i needs ceil(q_len_i / block_q) tiles, all inside [cu_i // block_q + i, cu_{i+1} // block_q + i + 1).
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    if skip is not None and (skip.shape != (num_seqs,) or skip.dtype != torch.int32 or skip.device != query.device):
        raise ValueError(f"{name}: skip must be [{num_seqs}] int32 on {query.device}, got {tuple(skip.shape)} "
                         f"{skip.dtype} on {skip.device}")
    _paged_attention_kernel[grid](
        out, query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, skip if skip is not None else seq_lens,
        scale * LOG2E, num_seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0), (softcap or 1.0) * LOG2E, window or 0,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
        IEEE_DOT=query.dtype == torch.float32, WINDOW=window is not None, SOFTCAP=softcap is not None,
        SKIP=skip is not None, num_warps=num_warps,
    )
    return out
