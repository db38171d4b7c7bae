"""Microbenchmark: the torch backend's CPU paged attention against two candidate rewrites (evidence only).

    .venv/bin/python benchmarks/attention_cpu.py [--threads 1]

SmolLM2-135M shapes (9 query heads, 3 KV heads, head_dim 64, block_size 16), times per engine step of 30
layers, best of 5 interleaved repeats. Candidates:

- "skip": exact. Query rows ordered position-major, so the rows that can see key tile t form a suffix;
  only that suffix (at least 16 rows, as today) is multiplied with the tile (causal tile skipping), the
  mask is applied only to tiles that cross the diagonal or the end, exp/sub run in place, and K/V are
  gathered straight into one zero-padded buffer. Must be bitwise equal to today's output.
- "sdpa": torch's fused scaled_dot_product_attention per sequence, keys zero-padded to a multiple of 512,
  query rows padded to 16. Faster, but checked here for the design's bitwise chunk invariance.

The rewrites live here, not in apcscore/, until the engine's owner adopts one (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import math
import random
import time

import torch
import torch.nn.functional as F

from apcscore.attention import torch_backend as tb
from apcscore.attention.metadata import AttentionMetadata

HQ, HKV, D, BS = 9, 3, 64, 16


def make_meta(items: list[tuple[int, int]], tables: list[list[int]]) -> AttentionMetadata:
    """items: (q_len, seq_len) per sequence; tables: block ids per sequence."""
    cu, lens = [0], []
    for q, length in items:
        cu.append(cu[-1] + q)
        lens.append(length)
    bt = torch.zeros(len(items), max(map(len, tables)), dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t)
    return AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.int64), block_tables=bt,
                             cu_seqlens_q=torch.tensor(cu), seq_lens=torch.tensor(lens),
                             max_seqlen_q=max(q for q, _ in items), max_seqlen_k=max(lens),
                             cu_seqlens_q_list=cu, seq_lens_list=lens, block_size=BS)


def random_batch(items: list[tuple[int, int]], seed: int):
    g = torch.Generator().manual_seed(seed)
    nblocks = sum(-(-n // BS) for _, n in items) + 4
    k_cache = torch.randn(nblocks, BS, HKV, D, generator=g)  # [num_blocks, block_size, Hkv, D]
    v_cache = torch.randn(nblocks, BS, HKV, D, generator=g)
    perm = torch.randperm(nblocks, generator=g).tolist()
    tables, p = [], 0
    for _, n in items:
        tables.append(perm[p:p + -(-n // BS)])
        p += -(-n // BS)
    query = torch.randn(sum(q for q, _ in items), HQ, D, generator=g)  # [T, Hq, D]
    return query, k_cache, v_cache, make_meta(items, tables)


def _gather_padded(cache: torch.Tensor, table: torch.Tensor, seq_len: int, padded: int) -> torch.Tensor:
    """[Hkv, padded, D]: the sequence's keys (or values), zeros past seq_len, one copy."""
    blocks = table[:-(-seq_len // cache.shape[1])].long()
    out = cache.new_zeros(cache.shape[2], padded, cache.shape[3])
    out[:, :seq_len] = cache[blocks].flatten(0, 1)[:seq_len].transpose(0, 1)
    return out


def paged_attention_skip(query, k_cache, v_cache, meta, scale):
    """Exact rewrite of tb.paged_attention with causal tile skipping (see the module docstring)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    hkv = k_cache.shape[2]
    group = num_heads // hkv
    out = torch.zeros_like(query)
    cu, lens = meta.cu_seqlens_q_list, meta.seq_lens_list
    for i, seq_len in enumerate(lens):
        start, end = cu[i], cu[i + 1]
        q_len = end - start
        padded = -(-seq_len // tb.KV_TILE) * tb.KV_TILE
        k = _gather_padded(k_cache, meta.block_tables[i], seq_len, padded)  # [Hkv, padded, D]
        v = _gather_padded(v_cache, meta.block_tables[i], seq_len, padded)
        # position-major rows: row j * G + g is query position j of the group's head g
        q = query[start:end].view(q_len, hkv, group, head_dim).permute(1, 0, 2, 3).reshape(
            hkv, q_len * group, head_dim).float()
        q_pos = torch.arange(seq_len - q_len, seq_len).repeat_interleave(group)
        rows = q.shape[1]
        if rows < tb.MIN_QUERY_ROWS:
            q = F.pad(q, (0, 0, 0, tb.MIN_QUERY_ROWS - rows))
            q_pos = F.pad(q_pos, (0, tb.MIN_QUERY_ROWS - rows), value=seq_len - 1)
        q = q * scale
        n_rows = q.shape[1]
        m = torch.full((hkv, n_rows), float("-inf"))
        s = torch.zeros(hkv, n_rows)
        acc = torch.zeros_like(q)  # [Hkv, R, D]
        first = seq_len - q_len
        for t0 in range(0, seq_len, tb.KV_TILE):
            t1 = t0 + tb.KV_TILE
            r0 = max(0, min(group * max(0, t0 - first), n_rows - tb.MIN_QUERY_ROWS))  # rows < r0 see no key here
            qp = q_pos[r0:]
            scores = q[:, r0:] @ k[:, t0:t1].transpose(1, 2)  # [Hkv, R - r0, tile]
            if t1 - 1 > int(qp[0]) or t1 > seq_len:  # the tile crosses the diagonal or the end
                scores.masked_fill_(torch.arange(t0, t1)[None, None, :] > qp[None, :, None], float("-inf"))
            m_old = m[:, r0:]
            m_new = torch.maximum(m_old, scores.amax(-1))
            alpha = torch.exp(m_old - m_new)
            p = scores.sub_(m_new[..., None]).exp_()
            s[:, r0:] = s[:, r0:] * alpha + p.sum(-1)
            acc[:, r0:] = acc[:, r0:] * alpha[..., None] + p @ v[:, t0:t1]
            m[:, r0:] = m_new
        o = (acc / s[..., None])[:, :rows]  # [Hkv, q_len * G, D]
        out[start:end] = o.view(hkv, q_len, group, head_dim).permute(1, 0, 2, 3).reshape(
            q_len, num_heads, head_dim).to(query.dtype)
    return out


def paged_attention_sdpa(query, k_cache, v_cache, meta, scale, min_rows: int = 16, kv_pad: int = 512):
    """torch's fused SDPA per sequence over zero-padded keys (see the module docstring)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    out = torch.zeros_like(query)
    cu, lens = meta.cu_seqlens_q_list, meta.seq_lens_list
    for i, seq_len in enumerate(lens):
        start, end = cu[i], cu[i + 1]
        q_len = end - start
        padded = -(-seq_len // kv_pad) * kv_pad
        k = _gather_padded(k_cache, meta.block_tables[i], seq_len, padded)
        v = _gather_padded(v_cache, meta.block_tables[i], seq_len, padded)
        rows = max(q_len, min_rows)
        q = query.new_zeros(rows, num_heads, head_dim)
        q[:q_len] = query[start:end]
        q_pos = F.pad(torch.arange(seq_len - q_len, seq_len), (0, rows - q_len), value=seq_len - 1)
        mask = torch.arange(padded)[None, :] <= q_pos[:, None]  # [rows, padded]
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask[None, None],
                                           scale=scale, enable_gqa=True)  # [1, Hq, rows, D]
        out[start:end] = o[0, :, :q_len].transpose(0, 1)
    return out


def chunk_invariance(fn, length: int = 300, trials: int = 20) -> tuple[int, int]:
    """(equal, total): rows of one sequence computed as chunks next to another sequence vs one whole prefill."""
    g = torch.Generator().manual_seed(5)
    k_cache = torch.randn(64, BS, HKV, D, generator=g)
    v_cache = torch.randn(64, BS, HKV, D, generator=g)
    table, other = list(range(10, 10 + -(-length // BS))), list(range(40, 50))
    q_all = torch.randn(length, HQ, D, generator=g)
    q_other = torch.randn(8, HQ, D, generator=g)
    scale = D ** -0.5
    whole = fn(q_all, k_cache, v_cache, make_meta([(length, length)], [table]), scale)
    rng = random.Random(0)
    cases = [(0, 1), (0, 33), (0, 129), (100, 229), (171, 300), (299, 300)]
    cases += [(a, a + rng.randint(1, length - a)) for a in (rng.randrange(length) for _ in range(trials))]
    equal = 0
    for a, b in cases:
        q = torch.cat([q_other[:7], q_all[a:b]])
        got = fn(q, k_cache, v_cache, make_meta([(7, 100), (b - a, b)], [other, table]), scale)[7:]
        equal += torch.equal(got, whole[a:b])
    return equal, len(cases)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    scale = D ** -0.5
    lens = torch.randint(20, 401, (8,), generator=torch.Generator().manual_seed(1)).tolist()
    cases = {
        "prefill 8 seqs of 20..400 (a scoring step)": [(n, n) for n in lens],
        "prefill 1 seq of 400": [(400, 400)],
        "chunk 200 of 700 + 2 decodes": [(200, 700), (1, 50), (1, 300)],
        "decode 16 seqs, context ~350": [(1, 340 + i) for i in range(16)],
    }
    fns = {"current": tb.paged_attention, "skip": paged_attention_skip, "sdpa": paged_attention_sdpa}
    for name, items in cases.items():
        batch = random_batch(items, 0)
        ref = tb.paged_attention(*batch, scale)
        skip_equal = torch.equal(paged_attention_skip(*batch, scale), ref)
        sdpa_diff = (paged_attention_sdpa(*batch, scale) - ref).abs().max().item()
        best = dict.fromkeys(fns, math.inf)
        for _ in range(5):
            for key, fn in fns.items():
                t = time.perf_counter()
                for _layer in range(6):
                    fn(*batch, scale)
                best[key] = min(best[key], (time.perf_counter() - t) * 5)  # per 30 layers
        cur = best["current"]
        print(f"{name}: current {cur:.3f} s | skip {best['skip']:.3f} s ({cur / best['skip']:.2f}x, bitwise equal: "
              f"{skip_equal}) | sdpa {best['sdpa']:.3f} s ({cur / best['sdpa']:.2f}x, max|diff| {sdpa_diff:.1e})",
              flush=True)
    for key in ("current", "skip", "sdpa"):
        equal, total = chunk_invariance(fns[key])
        print(f"chunk invariance, {key}: {equal}/{total} chunkings bitwise equal to the whole prefill")


if __name__ == "__main__":
    main()
