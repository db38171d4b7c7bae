"""Microbenchmark: the torch backend's CPU paged attention (the fixed-order kernel, apcscore.kernels.cpu_attention)
against the torch ops it replaces and torch's SDPA (evidence only).

    .venv/bin/python benchmarks/attention_cpu.py [--threads 1]

SmolLM2-135M shapes (9 query heads, 3 KV heads, head_dim 64, block_size 16), times per engine step of 30
layers, best of 5 interleaved repeats. "kernel" is what the engine runs on the CPU; "torch ops" the same
arithmetic as torch ops (the batched short chunks, the per-chunk loop and the decode path of torch_prefill.py and
torch_decode.py), checked bitwise equal to it here; "sdpa" torch's fused scaled_dot_product_attention per
sequence, keys zero-padded to a multiple of 512, query rows padded to 16: checked here for the design's bitwise
chunk invariance, which it breaks.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import time

import torch
import torch.nn.functional as F

from apcscore.attention import torch_backend as tb
from apcscore.attention.metadata import AttentionMetadata
from apcscore.kernels import cpu_attention

HQ, HKV, D, BS = 9, 3, 64, 16


def make_meta(items: list[tuple[int, int]], tables: list[list[int]]) -> AttentionMetadata:
    """items: (q_len, seq_len) per sequence; tables: block ids per sequence."""
    return AttentionMetadata.for_attention(items, tables, BS)


def random_batch(items: list[tuple[int, int]], seed: int):
    g = torch.Generator().manual_seed(seed)
    nblocks = sum(-(-n // BS) for _, n in items) + 4
    # [num_blocks, block_size, Hkv, D] in the torch backend's own (heads-major) memory layout
    k_cache, v_cache = tb.allocate_kv_cache(1, nblocks, BS, HKV, D, torch.zeros)[0]
    k_cache.copy_(torch.randn(nblocks, BS, HKV, D, generator=g))
    v_cache.copy_(torch.randn(nblocks, BS, HKV, D, generator=g))
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



def paged_attention_torch_ops(query, k_cache, v_cache, meta, scale):
    """The backend without the kernel: the torch ops of torch_prefill.py and torch_decode.py."""
    own = meta.plans.get("torch ops")  # its own per-step plans (the kernel's are not the torch ops')
    if own is None:
        own = meta.plans["torch ops"] = dataclasses.replace(meta, plans={})
    saved, cpu_attention.supported = cpu_attention.supported, lambda *args: False
    try:
        return tb.paged_attention(query, k_cache, v_cache, own, scale)
    finally:
        cpu_attention.supported = saved


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
        "prefill 64 seqs of 30 (winogrande-like)": [(30, 30)] * 64,
        "prefill 20 seqs of 110 (lambada-like)": [(110, 110)] * 20,
        "32 questions of 20 tokens after a cached 600-token prefix": [(20, 620)] * 32,
        "16 questions of 80 tokens after a cached 430-token prefix (mmlu-like)": [(80, 510)] * 16,
        "prefill 1 seq of 400": [(400, 400)],
        "chunk 200 of 700 + 2 decodes": [(200, 700), (1, 50), (1, 300)],
        "decode 16 seqs, context ~350": [(1, 340 + i) for i in range(16)],
    }
    fns = {"kernel": tb.paged_attention, "torch ops": paged_attention_torch_ops, "sdpa": paged_attention_sdpa}
    for name, items in cases.items():
        batch = random_batch(items, 0)
        ref = tb.paged_attention(*batch, scale)
        sdpa_diff = (paged_attention_sdpa(*batch, scale) - ref).abs().max().item()
        assert torch.equal(paged_attention_torch_ops(*batch, scale), ref), "the kernel's and the torch ops' bits differ"
        best = dict.fromkeys(fns, math.inf)
        for _ in range(5):
            for key, fn in fns.items():
                t = time.perf_counter()
                for _layer in range(6):
                    fn(*batch, scale)
                best[key] = min(best[key], (time.perf_counter() - t) * 5)  # per 30 layers
        cur = best["kernel"]
        print(f"{name}: kernel {cur:.3f} s | torch ops {best['torch ops']:.3f} s ({cur / best['torch ops']:.2f}x) | "
              f"sdpa {best['sdpa']:.3f} s ({cur / best['sdpa']:.2f}x, max|diff| {sdpa_diff:.1e})", flush=True)
    for key in ("kernel", "sdpa"):
        equal, total = chunk_invariance(fns[key])
        print(f"chunk invariance, {key}: {equal}/{total} chunkings bitwise equal to the whole prefill")


if __name__ == "__main__":
    main()
