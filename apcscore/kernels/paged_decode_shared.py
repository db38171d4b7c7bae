"""Triton kernel: decode attention of a group of sequences that share their first KV blocks (shared prefix).

One program owns one decode group and one KV head. Its BLOCK_M rows are (member slot, query head) pairs: up to
BLOCK_Q = BLOCK_M // GROUP member sequences of the group times the GROUP query heads of the KV head, the tile
shape of paged_attention's kernel for that model (same BLOCK_M, BLOCK_N, BLOCK_D, num_warps, IEEE_DOT). It
walks the key tiles wholly inside the shared prefix once for every row (each K/V tile loaded once, through the
first member's block table), then each member's remaining tiles in turn (from the first unshared tile to its
seq_len, through its own block table, with paged_attention's masks), updating only that member's rows by exact
selection (tl.where: a row not updated keeps its bits). Every row thus sees the same key tiles, counted from
position 0, in the same order, with the same per-row arithmetic as in paged_attention's kernel: its bits do not
depend on who shares its prefix, provided a tl.dot row depends only on that row of its left operand
(docs/architecture.md, "Shared-prefix decode"). Sliding-window layers are not grouped; soft-capping is.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from apcscore.kernels.paged_attention import LOG2E, _tile_scores, _tile_update, tile_config


@triton.jit(do_not_specialize=["stride_bt"])
def _shared_prefix_decode_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, seq_lens_ptr,
        groups_ptr,  # [G, 2 + BLOCK_Q] int32: members, shared key tiles, member sequence indices
        scale_log2, stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt, softcap_log2,
        BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, IEEE_DOT: tl.constexpr,
        SOFTCAP: tl.constexpr = False):
    group_row = groups_ptr + tl.program_id(0) * (2 + BLOCK_Q)
    kv_head = tl.program_id(1)
    num_members = tl.load(group_row)
    if num_members == 0:  # an empty group (CUDA-graph padding)
        return
    shared_end = tl.load(group_row + 1) * BLOCK_N  # keys [0, shared_end): the same blocks for every member
    first_seq = tl.load(group_row + 2)

    rows = tl.arange(0, BLOCK_M)
    slot = rows // GROUP  # [BLOCK_M] member slot
    head = kv_head * GROUP + rows % GROUP  # [BLOCK_M] query head
    row_ok = (rows < BLOCK_Q * GROUP) & (slot < num_members)
    seq = tl.load(group_row + 2 + slot, mask=row_ok, other=0)  # [BLOCK_M] the row's sequence
    q_tok = tl.load(cu_seqlens_q_ptr + seq, mask=row_ok, other=0)  # its one query row (q_len 1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_row = q_tok.to(tl.int64) * stride_qt + head * stride_qh  # [BLOCK_M]
    q = tl.load(q_ptr + q_row[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # The shared tiles: wholly before every member's last position, so every key is visible to every row
    # (paged_attention's masks are all true there), and the tile is the same for every member.
    for start_n in range(0, shared_end, BLOCK_N):
        n = start_n + tl.arange(0, BLOCK_N)
        n_ok = n < shared_end
        s, block, offset = _tile_scores(q, k_cache_ptr, block_tables_ptr + first_seq * stride_bt, n, n_ok, kv_head, d,
                                        d_ok, scale_log2, softcap_log2, stride_kb, stride_ks, stride_kh, BLOCK_SIZE,
                                        IEEE_DOT, SOFTCAP)
        # all true here, but kept: as in paged_attention, the select keeps the compiler from contracting the scale
        # multiply into the exponent's subtraction (an FMA there would round differently from today's kernel)
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_i, l_i, acc = _tile_update(s, m_i, l_i, acc, v_cache_ptr, block, offset, n_ok, kv_head, d, d_ok, stride_vb,
                                     stride_vs, stride_vh, IEEE_DOT, False)
    # Each member's own tiles, updating only its rows (the other rows' values are computed and dropped).
    for j in range(0, num_members):
        seq_j = tl.load(group_row + 2 + j)
        kv_end = tl.load(seq_lens_ptr + seq_j)
        q_pos = kv_end - 1  # the member's query position (q_len 1)
        active = row_ok & (slot == j)
        for start_n in range(shared_end, kv_end, BLOCK_N):
            n = start_n + tl.arange(0, BLOCK_N)
            n_ok = n < kv_end
            s, block, offset = _tile_scores(q, k_cache_ptr, block_tables_ptr + seq_j * stride_bt, n, n_ok, kv_head,
                                            d, d_ok, scale_log2, softcap_log2, stride_kb, stride_ks, stride_kh,
                                            BLOCK_SIZE, IEEE_DOT, SOFTCAP)
            causal = (n <= q_pos) & n_ok
            s = tl.where(causal[None, :], s, float("-inf"))
            # every row saw the shared tiles (>= 1) first: its running max is finite
            m_new, l_new, acc_new = _tile_update(s, m_i, l_i, acc, v_cache_ptr, block, offset, n_ok, kv_head, d,
                                                 d_ok, stride_vb, stride_vs, stride_vh, IEEE_DOT, False)
            acc = tl.where(active[:, None], acc_new, acc)
            l_i = tl.where(active, l_new, l_i)
            m_i = tl.where(active, m_new, m_i)
    acc = acc / l_i[:, None]
    o_row = q_tok.to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_ptr + o_row[:, None] + d[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def shared_prefix_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                         groups: torch.Tensor, out: torch.Tensor, scale: float | None = None, *,
                         softcap: float | None = None, block_m: int | None = None, block_n: int | None = None,
                         num_warps: int | None = None) -> torch.Tensor:
    """Write into `out` the attention rows of the decode groups' sequences (the others are left as they are).

    The arguments are paged_attention's (which has checked them when run on the same step first), plus
    groups [G, 2 + block_m // group] int32 on the device (apcscore.attention.decode_groups: members, shared key
    tiles, member indices; every member a q_len-1 sequence whose first shared_tiles * block_n keys lie in the
    same blocks as the first member's and before its last position). block_m / block_n / num_warps default to
    tile_config's, as paged_attention's do: a group's rows get that kernel's bits only with the same tiles.
    """
    name = "shared_prefix_decode"
    num_heads, head_dim = query.shape[1:]
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    block_m, block_n, num_warps = (given if given is not None else default for given, default
                                   in zip((block_m, block_n, num_warps), tile_config(head_dim, group)))
    block_q = block_m // group
    if groups.dim() != 2 or groups.shape[1] != 2 + block_q or groups.dtype != torch.int32 \
            or groups.device != query.device:
        raise ValueError(f"{name}: groups must be [G, {2 + block_q}] int32 on {query.device} (block_m {block_m}, "
                         f"{group} query heads per KV head), got {tuple(groups.shape)} {groups.dtype} "
                         f"on {groups.device}")
    if out.shape != query.shape or out.dtype != query.dtype or not out.is_contiguous():
        raise ValueError(f"{name}: out must be contiguous {tuple(query.shape)} {query.dtype}")
    if groups.shape[0] == 0:
        return out
    scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    _shared_prefix_decode_kernel[(groups.shape[0], num_kv_heads)](
        out, query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, groups,
        scale * LOG2E, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0), (softcap or 1.0) * LOG2E,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
        IEEE_DOT=query.dtype == torch.float32, SOFTCAP=softcap is not None, num_warps=num_warps,
    )
    return out
