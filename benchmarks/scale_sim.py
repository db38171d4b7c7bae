"""A model of N replicas from a simulation over the real block manager (issue 17, docs/scale-out.md).

Workload: G groups of M records; a group's records share a P-token prefix (a system prompt or few-shot block)
and each has its own S-token suffix and generates T tokens; records are shuffled. For each N and each
partitioning (apcscore.scale.partition.assign: prefix-aware or random), every replica gets its records in
dataset order and runs them through its own `BlockManager` (the engine's, with prefix caching; a pool of
`--blocks` blocks of 16 tokens): look up the cached prefix, allocate, compute, register the full blocks, free.
That is the engine's behaviour for requests that arrive one after another, and also for followers that arrive
together (they wait for the blocks being prefilled).

Cost model (stated, not measured): a replica's time is proportional to the prompt tokens it computes (not
served from its cache) plus DECODE_COST times the tokens it generates; replicas run in parallel, so the run
takes the longest replica's time. Throughput is all tokens (prompt + generated) over that time, relative to
one replica. It ignores batching effects, communication and the driver.

    python benchmarks/scale_sim.py [--groups 64 --per-group 32 --prefix 512 --suffix 64 --tokens 32]
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field

from apcscore.engine.block_manager import BlockManager
from apcscore.scale.partition import Item, assign, block_digests

BLOCK = 16
DECODE_COST = 1.0


@dataclass
class _Seq:
    token_ids: list[int]
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_computed_tokens: int = 0


def workload(groups: int, per_group: int, prefix: int, suffix: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        head = [rng.randrange(3, 50000) for _ in range(prefix)]
        prompts += [head + [rng.randrange(3, 50000) for _ in range(suffix)] for _ in range(per_group)]
    rng.shuffle(prompts)
    return prompts


def simulate(prompts: list[list[int]], tokens: int, n: int, method: str, blocks: int) -> dict:
    items = [Item(i, block_digests(p, BLOCK), len(p) + tokens) for i, p in enumerate(prompts)]
    parts = assign(items, n, method)
    times, hit, queried = [], 0, 0
    for r in range(n):
        bm = BlockManager(blocks, BLOCK)
        computed = generated = 0
        for p, part in zip(prompts, parts):
            if part != r:
                continue
            seq = _Seq(list(p))
            cached = bm.find_cached_prefix(seq)
            assert bm.allocate(seq, len(p) + tokens - len(cached) * BLOCK, cached)
            computed += len(p) - len(cached) * BLOCK
            seq.token_ids += [1] * tokens
            seq.num_computed_tokens = len(seq.token_ids)
            generated += tokens
            bm.cache_full_blocks(seq)
            bm.free(seq)
        hit += bm.stats.hit_tokens
        queried += bm.stats.queried_tokens
        times.append(computed + DECODE_COST * generated)
    total = sum(len(p) for p in prompts) + tokens * len(prompts)
    return {"hit_rate": hit / queried, "makespan": max(times), "throughput": total / max(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--per-group", type=int, default=32)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=4096, help="KV pool of each replica, in blocks of 16 tokens")
    ap.add_argument("--replicas", default="1,2,4,8,16,32,64")
    args = ap.parse_args()
    prompts = workload(args.groups, args.per_group, args.prefix, args.suffix)
    base = simulate(prompts, args.tokens, 1, "prefix", args.blocks)["throughput"]
    print(f"{args.groups} groups x {args.per_group} records, prefix {args.prefix}, suffix {args.suffix}, "
          f"{args.tokens} generated, pool {args.blocks} blocks per replica")
    print("| N | hit rate, prefix-aware | hit rate, random | speed-up, prefix-aware | speed-up, random |")
    print("|---|---|---|---|---|")
    for n in (int(x) for x in args.replicas.split(",")):
        p = simulate(prompts, args.tokens, n, "prefix", args.blocks)
        r = simulate(prompts, args.tokens, n, "random", args.blocks)
        print(f"| {n} | {p['hit_rate']:.3f} | {r['hit_rate']:.3f} | {p['throughput'] / base:.2f}x | "
              f"{r['throughput'] / base:.2f}x |")


if __name__ == "__main__":
    main()
