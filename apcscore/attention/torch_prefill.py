"""Prefill chunks of the torch attention backend (queries of a sequence at several positions).

Two paths with the same bits for every query (tests/attention/test_torch_attention.py compares them):
- `attend_prefill`, one chunk on its own: a loop over key tiles that skips what the causal mask would zero (for
  long chunks, where that halves the work);
- `attend_prefill_batched`, short chunks of several sequences together: each chunk's rows padded to one row
  count and its keys to one key count, and one `tiled_softmax` for all (a step of many short prompts runs a
  few dozen torch ops per layer instead of a dozen per tile and sequence).
Both are the online softmax over the same fixed tiles of 64 keys from position 0; a tile fully masked for a row
(past its position or before its window) leaves the row's state exactly unchanged, and on the CPU the products
are the fixed-order kernel (a row's bits do not depend on the rows or keys of the call): so which path a chunk
takes, and which chunks share a call, changes no bit. Batching is used only where that kernel runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from apcscore.attention.metadata import AttentionMetadata
from apcscore.attention.products import fixed_order, products
from apcscore.attention.tiles import (KV_TILE, gather, head_rows, pad_slots, query_row_tile, sequence_slots,
                                      tiled_softmax)
from apcscore.kernels import rowmath

# Chunks of at most this many queries (one key tile's worth) are batched; longer ones take the per-chunk path,
# whose causal skipping saves more than batching does there (docs/benchmarks.md, "Short prefill chunks batched").
MAX_BATCHED_QUERIES = 64
# A batch of chunks is closed when its padded area (rows x keys, summed over chunks) would exceed this many
# times the chunks' own area, or its score tensor these many elements per KV head: ~3 MB for 3 KV heads, about
# one core's L2; the score passes of a larger batch run from memory (benchmarks/attention_cpu.py, per 30 layers:
# 32 questions of 20 after a 600-token prefix 0.52 s, against 1.04 s with 1 << 24 and 0.83 s with 1 << 16).
MAX_PADDING_FACTOR = 2.0
MAX_BATCH_SCORES = 1 << 18


def batched_prefill_groups(meta: AttentionMetadata, group: int, device: torch.device) -> tuple[list[list[int]],
                                                                                                list[int]]:
    """The step's prefill chunks split into batches for `attend_prefill_batched` and chunks to run alone.

    group: query heads per KV head. Worked out once per step (every layer has the same chunks). Chunks are
    sorted by key length, so that a batch holds chunks of similar size.
    """
    key = ("prefill_groups", group)
    if key in meta.plans:
        return meta.plans[key]
    cu, lens = meta.cu_seqlens_q_list, meta.seq_lens_list
    prefill = [i for i in range(len(lens)) if cu[i + 1] - cu[i] > 1]
    if not fixed_order(device):  # torch.matmul may round a row by its call's shape
        meta.plans[key] = ([], prefill)
        return meta.plans[key]
    alone = [i for i in prefill if cu[i + 1] - cu[i] > MAX_BATCHED_QUERIES]

    def area(i: int) -> tuple[int, int]:  # (padded key count, row count) of chunk i (rows unpadded: the CPU's)
        return -(-lens[i] // KV_TILE) * KV_TILE, (cu[i + 1] - cu[i]) * group

    batches: list[list[int]] = []
    own = max_rows = 0  # the current batch's own area and its largest row count
    for i in sorted((i for i in prefill if cu[i + 1] - cu[i] <= MAX_BATCHED_QUERIES), key=lambda i: (area(i), i)):
        keys, rows = area(i)
        if batches:
            padded = (len(batches[-1]) + 1) * keys * max(max_rows, rows)  # keys: the largest (sorted)
            if padded <= MAX_PADDING_FACTOR * (own + keys * rows) and padded <= MAX_BATCH_SCORES:
                batches[-1].append(i)
                own, max_rows = own + keys * rows, max(max_rows, rows)
                continue
        batches.append([i])
        own, max_rows = keys * rows, rows
    meta.plans[key] = (batches, alone)
    return batches, alone


@dataclass
class _BatchPlan:
    """Where a batch's queries and keys are, worked out once per step and batch (every layer reuses it)."""

    token: torch.Tensor  # [Hkv, B, R] query row (token) of each padded row; padding rows repeat a real one
    head: torch.Tensor  # [Hkv, B, R] its query head
    real: torch.Tensor  # [Hkv, B, R] bool, False on padding rows
    kv_rows: torch.Tensor  # head_rows of each chunk's keys, padded to L with its own first slot
    q_pos: torch.Tensor  # [B, R] each row's position (padding rows: the chunk's last)
    num_keys: int  # L, a multiple of KV_TILE
    masks: dict = field(default_factory=dict)  # window -> [1, B, R, L] bool, True where a key is not seen


def _batch_plan(meta: AttentionMetadata, seqs: list[int], hkv: int, group: int, cache: torch.Tensor) -> _BatchPlan:
    device, cu, lens = cache.device, meta.cu_seqlens_q_list, meta.seq_lens_list
    q_lens = [cu[i + 1] - cu[i] for i in seqs]
    num_rows = max(n * group for n in q_lens)  # (batched only on the CPU's fixed-order kernel: rows unpadded)
    num_keys = max(-(-lens[i] // KV_TILE) * KV_TILE for i in seqs)
    r = torch.arange(num_rows, device=device)
    q_len = torch.tensor(q_lens, device=device)[:, None]  # [B, 1]
    real = r[None, :] < q_len * group  # [B, R]
    pos = torch.where(real, r[None, :] // group, q_len - 1)  # [B, R] index within the chunk
    token = torch.tensor([cu[i] for i in seqs], device=device)[:, None] + pos
    g = torch.where(real, r[None, :] % group, group - 1)
    head = torch.arange(hkv, device=device)[:, None, None] * group + g[None]  # [Hkv, B, R]
    first = torch.tensor([lens[i] for i in seqs], device=device)[:, None] - q_len  # [B, 1]
    slots = torch.stack([pad_slots(sequence_slots(meta.block_tables[i], lens[i], cache.shape[1]), num_keys)
                         for i in seqs])  # [B, L]
    return _BatchPlan(token=token[None].expand(hkv, -1, -1), head=head, real=real[None].expand(hkv, -1, -1),
                      kv_rows=head_rows(slots, cache), q_pos=first + pos, num_keys=num_keys)


def attend_prefill_batched(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, seqs: list[int], scale: float, out: torch.Tensor,
                           window: int | None = None, softcap: float | None = None) -> None:
    """Attention of the prefill chunks of sequences `seqs` (a batch of `batched_prefill_groups`) in one call.

    Each chunk's query rows are laid out as attend_prefill's (row j * G + g: position j, head g of the KV head's
    group), padded to the batch's row count; its keys are padded to the batch's key count with its own first
    slot (see pad_slots) and masked. Writes the chunks' rows of `out`.
    """
    hkv = k_cache.shape[2]
    key = ("prefill_batch", tuple(seqs))
    plan = meta.plans.get(key)
    if plan is None:
        plan = meta.plans[key] = _batch_plan(meta, seqs, hkv, query.shape[1] // hkv, k_cache)
    masked = plan.masks.get(window)
    if masked is None:  # the same in every layer with this window
        k_pos = torch.arange(plan.num_keys, device=query.device)
        masked = k_pos[None, None, :] > plan.q_pos[:, :, None]  # [B, R, L]
        if window:
            masked |= k_pos[None, None, :] <= plan.q_pos[:, :, None] - window
        masked = plan.masks[window] = masked[None]
    q = query[plan.token, plan.head].float() * scale  # [Hkv, B, R, D]
    k, v = (gather(c, plan.kv_rows, len(seqs), plan.num_keys) for c in (k_cache, v_cache))  # [Hkv, B, L, D]
    _, s, acc = tiled_softmax(q, k, v, masked, 0, plan.num_keys, None, softcap, bool(window))
    o = acc / s[..., None]  # [Hkv, B, R, D]
    out[plan.token[plan.real], plan.head[plan.real]] = o[plan.real].to(out.dtype)


def attend_prefill(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                   i: int, scale: float, out: torch.Tensor, window: int | None = None,
                   softcap: float | None = None) -> None:
    """Attention of one sequence's prefill chunk, skipping the work the causal mask would zero.

    Query rows are ordered by position, so for each key tile only the rows that can see some key of it are
    multiplied (rounded out to whole blocks of query_row_tile rows), and only tiles that cross the diagonal are
    masked. Skipped rows would have had their running state left exactly unchanged: the bits are the same.
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    hkv = k_cache.shape[2]
    group = num_heads // hkv
    start, end = meta.cu_seqlens_q_list[i], meta.cu_seqlens_q_list[i + 1]
    seq_len = meta.seq_lens_list[i]
    q_len = end - start
    padded = -(-seq_len // KV_TILE) * KV_TILE
    rows = meta.plans.get(("prefill", i))
    if rows is None:
        slots = pad_slots(sequence_slots(meta.block_tables[i], seq_len, k_cache.shape[1]), padded)
        rows = meta.plans[("prefill", i)] = head_rows(slots, k_cache)
    k, v = (gather(c, rows, padded) for c in (k_cache, v_cache))  # [Hkv, padded, D]
    # position-major rows: row j * G + g is query position j of the group's head g
    q = query[start:end].view(q_len, hkv, group, head_dim).permute(1, 0, 2, 3).reshape(
        hkv, q_len * group, head_dim).float()
    q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).repeat_interleave(group)
    num_real = q.shape[1]
    row_tile = query_row_tile(query.device)
    num_pad = max(row_tile, -(-num_real // row_tile) * row_tile) - num_real
    if num_pad:
        q = torch.nn.functional.pad(q, (0, 0, 0, num_pad))
        q_pos = torch.nn.functional.pad(q_pos, (0, num_pad), value=seq_len - 1)
    q = q * scale
    n_rows = q.shape[1]
    first = seq_len - q_len
    # tiles wholly before every row's window are skipped: they would leave each row's state as it was
    t_start = max(0, first - window + 1) // KV_TILE * KV_TILE if window else 0
    before = 0 if window else first // KV_TILE * KV_TILE  # tiles every row sees whole (a cached prefix)
    if before:  # all at once: tiled_softmax is this loop's arithmetic, tile by tile (the batched path's too)
        m, s, acc = tiled_softmax(q, k, v, None, 0, before, None, softcap)
        t_start = before
    else:
        m = torch.full((hkv, n_rows), float("-inf"), device=query.device)  # running max
        s = torch.zeros(hkv, n_rows, device=query.device)  # running sum of exp
        acc = torch.zeros_like(q)  # [Hkv, R, D]
    for t0 in range(t_start, seq_len, KV_TILE):
        t1 = t0 + KV_TILE
        r0 = group * max(0, t0 - first)  # rows < r0 see no key here
        r0 = min(r0 - r0 % row_tile, n_rows - row_tile)  # whole row tiles (n_rows is a multiple)
        scores = products(q[:, r0:], k[:, t0:t1])  # [Hkv, R - r0, tile]
        if softcap:
            rowmath.softcap(scores, softcap, inplace=True)
        # rows [r0, r_end) have a position below t1 - 1: they cannot see every key of the tile (the padding
        # rows sit at seq_len - 1, after the real ones); the rows after them see it all, unmasked
        r_end = group * min(max(t1 - 1 - first, 0), q_len) + (n_rows - num_real) * (seq_len < t1)
        if window and t0 + window <= seq_len - 1:  # some rows have keys of this tile outside their window
            r_end = n_rows
        if r_end > r0:
            mask = meta.plans.get(("mask", i, t0, window))
            if mask is None:  # the same in every layer
                k_pos = torch.arange(t0, t1, device=query.device)
                mask = k_pos[None, None, :] > q_pos[None, r0:r_end, None]
                if window:
                    mask |= k_pos[None, None, :] <= q_pos[None, r0:r_end, None] - window
                meta.plans[("mask", i, t0, window)] = mask
            scores[:, :r_end - r0].masked_fill_(mask, float("-inf"))
        m_old, s_old, acc_old = m[:, r0:], s[:, r0:], acc[:, r0:]  # views: updated in place
        m_new = torch.maximum(m_old, scores.amax(-1))
        m_sub = m_new.masked_fill(m_new == float("-inf"), 0.0) if window else m_new  # no -inf - -inf = NaN
        alpha = rowmath.exp(m_old - m_sub)
        p = rowmath.exp_(scores.sub_(m_sub[..., None]))
        s_old.mul_(alpha).add_(rowmath.row_sum(p))
        acc_old.mul_(alpha[..., None]).add_(products(p, v[:, t0:t1].transpose(1, 2)))
        m_old.copy_(m_new)
    o = (acc / s[..., None])[:, :num_real]  # [Hkv, q_len * G, D]
    out[start:end] = o.view(hkv, q_len, group, head_dim).permute(1, 0, 2, 3).reshape(
        q_len, num_heads, head_dim).to(query.dtype)

