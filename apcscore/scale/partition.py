"""Prefix-aware partitioning of a dataset's records into N parts (shards or Ray replicas), deterministically:
records whose first KV blocks are equal go to one part, so one engine computes a shared prefix once, and the load
is otherwise balanced (docs/scale-out.md, "Prefix-aware partitioning"). `random` partitioning exists to measure
what prefix-awareness buys."""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from apcscore.errors import ApcscoreError
from apcscore.options.resolve import PARTITION_METHODS as METHODS

MAX_DEPTH = 8  # blocks of a record's prefix that can decide its group


@dataclass(frozen=True)
class Item:
    """One record as the partitioner sees it."""

    index: int  # the record's position in the dataset
    digests: tuple[bytes, ...]  # chained digests of its first full blocks (at most MAX_DEPTH)
    load: int  # prompt tokens of its requests plus the tokens it may generate (at least 1)


def block_digests(ids: Sequence[int], block_size: int, depth: int = MAX_DEPTH) -> tuple[bytes, ...]:
    """The chained digests of the first `depth` full blocks of `ids` (fewer when `ids` is shorter)."""
    digests, parent = [], b""
    for d in range(min(depth, len(ids) // block_size)):
        block = ids[d * block_size:(d + 1) * block_size]
        parent = hashlib.blake2b(parent + b"".join(int(t).to_bytes(8, "little", signed=True) for t in block),
                                 digest_size=16).digest()
        digests.append(parent)
    return tuple(digests)


def record_items(job: Any, records: Iterable[Any], invalid: Iterable[Any], block_size: int) -> list[Item]:
    """The partitioner's view of every record (valid and invalid), from the requests `job` would send (a job
    is pure: building requests here changes nothing in it; the plans are dropped)."""
    items = []
    for record in records:
        try:
            requests, _plan = job.requests(record)
        except ApcscoreError:  # it becomes an error row wherever it runs
            requests = []
        if not requests:
            items.append(Item(record.index, (), 1))
            continue
        load = sum(len(r.prompt_token_ids) + (int(r.sampling.max_tokens) if r.sampling is not None else 0)
                   for r in requests)
        items.append(Item(record.index, block_digests(requests[0].prompt_token_ids, block_size), max(load, 1)))
    items.extend(Item(r.index, (), 1) for r in invalid)
    items.sort(key=lambda it: it.index)
    return items


def _groups(items: list[Item], cap: int, depth: int) -> list[tuple[int, list[Item]]]:
    """(load, items) of the groups of `items` by their first `depth` blocks; heavy groups split deeper, then cut
    (see module doc). Linear in len(items) at each depth."""
    buckets: dict[Any, list[Item]] = {}
    for it in items:  # dicts keep insertion order: buckets come in order of their first record
        key = it.digests[depth - 1] if len(it.digests) >= depth else ("alone", it.index)
        buckets.setdefault(key, []).append(it)
    out: list[tuple[int, list[Item]]] = []
    for bucket in buckets.values():
        load = sum(it.load for it in bucket)
        if load <= cap or len(bucket) == 1:
            out.append((load, bucket))
        elif depth < MAX_DEPTH and any(len(it.digests) > depth for it in bucket):
            out.extend(_groups(bucket, cap, depth + 1))
        else:
            run: list[Item] = []
            run_load = 0  # a running sum: summing the run again for each item is quadratic in a group's size
            for it in bucket:
                if run and run_load + it.load > cap:
                    out.append((run_load, run))
                    run, run_load = [], 0
                run.append(it)
                run_load += it.load
            out.append((run_load, run))
    return out


def assign(items: list[Item], parts: int, method: str = "prefix") -> list[int]:
    """The part (0..parts-1) of every item, in the order of `items`."""
    if method not in METHODS:
        raise ValueError(f"unknown partitioning {method!r}; choose from {METHODS}")
    if method == "random":
        return [int.from_bytes(hashlib.blake2b(str(it.index).encode(), digest_size=8).digest(), "little") % parts
                for it in items]
    total = sum(it.load for it in items)
    cap = max(1, -(-total // parts))
    weighed = _groups(items, cap, 1)
    weighed.sort(key=lambda lg: (-lg[0], lg[1][0].index))
    heap = [(0, p) for p in range(parts)]  # (load, part): the least-loaded part, ties to the lowest number
    part_of: dict[int, int] = {}
    for load, group in weighed:
        least, target = heapq.heappop(heap)
        heapq.heappush(heap, (least + load, target))
        for it in group:
            part_of[it.index] = target
    return [part_of[it.index] for it in items]


def assign_prompts(prompts: Sequence[Sequence[int]], loads: Sequence[int], parts: int, block_size: int,
                   method: str = "prefix") -> list[int]:
    """The part of each prompt (token ids, with its load: prompt plus generated tokens): `assign` over requests
    rather than records (`--ray`'s routing, run/ray_engine.py, and `eval --shard`'s mask, run/eval.shard_split)."""
    items = [Item(i, block_digests(p, block_size), max(1, n)) for i, (p, n) in enumerate(zip(prompts, loads))]
    return assign(items, parts, method)


def fingerprint(items: list[Item], parts: list[int]) -> str:
    """SHA-256 of the assignment (record index -> part): equal for every task that split the same dataset
    the same way."""
    h = hashlib.sha256()
    for it, p in zip(items, parts):
        h.update(f"{it.index}:{p};".encode())
    return h.hexdigest()
