"""What in a run's metadata fixes its bits: the part `--resume`, `merge` and `--ray`'s replicas compare.

A file is one configuration: every session of a resumed run, every shard of a merge and every Ray replica must
agree on it. The `engine` and `numerics` sections are compared whole (so fields added to them later are covered)
except the fields that differ between runs of one configuration without changing a bit: the KV pool size
(`engine.num_kv_blocks`, auto-sized from free memory), the thread count (`numerics.torch_threads`), the machine's
description and the start-up probe's details (`numerics.hardware`, `blas`, `probe`, `reason`), under batch
invariance the schedule's budget and width (docs/architecture.md, "The batch-invariance contract"), and with
portable bits the CPU's capability and SIMD level (docs/architecture.md, "Portable bits").
"""

from __future__ import annotations

import json
from typing import Any, Iterable

# metadata section -> its fields that do not change bits (left out of every comparison)
NOT_BITS: dict[str, frozenset[str]] = {"engine": frozenset({"num_kv_blocks", "kv_cache_memory_fraction"}),
                                       # the machine's description and the probe's timing: the bits follow
                                       # the construction and the capabilities (apcscore.engine.numerics)
                                       "numerics": frozenset({"torch_threads", "hardware", "blas", "probe",
                                                              "reason"})}
# numerics fields that change no bit where the run's bits are portable (numerics.portable: the same on every CPU)
PORTABLE = frozenset({"cpu_capability", "simd"})
# engine fields that only shape the schedule: with batch invariance they do not change bits either (the contract:
# any budget, any batch), so a resumed or sharded run may change them; without it they are compared
SCHEDULE = frozenset({"max_batch_tokens", "max_num_seqs"})


def bits_of(key: str, value: Any) -> Any:
    """The metadata section `key` as compared: without its NOT_BITS fields (and SCHEDULE of a batch-invariant
    engine)."""
    drop = NOT_BITS.get(key)
    if drop and isinstance(value, dict):
        if key == "engine" and value.get("batch_invariant", False):
            drop = drop | SCHEDULE
        if key == "numerics" and value.get("portable", False):
            drop = drop | PORTABLE
        return {k: v for k, v in value.items() if k not in drop}
    return value


def same_bits(key: str) -> Any:
    """A comparison of the section `key` for the results writer's `resume_compare`."""
    return lambda old, new: bits_of(key, old) == bits_of(key, new)


def short(value: Any, width: int = 100) -> str:
    """`value` as compact JSON, cut to `width` characters."""
    text = json.dumps(value, ensure_ascii=False, sort_keys=True)
    return text if len(text) <= width else text[:width - 3] + "..."


def differing(a: dict, b: dict, keys: Iterable[str]) -> list[str]:
    """The sections of `keys` in which metadata `a` and `b` differ in a way that changes bits, each as
    `key: A, B` (the first differing fields of a dict section named)."""
    out = []
    for key in keys:
        x, y = bits_of(key, a.get(key)), bits_of(key, b.get(key))
        if x == y:
            continue
        if isinstance(x, dict) and isinstance(y, dict):
            fields = sorted(k for k in x.keys() | y.keys() if x.get(k) != y.get(k))
            out.append("; ".join(f"{key}.{k}: {short(x.get(k))} vs {short(y.get(k))}" for k in fields))
        else:
            out.append(f"{key}: {short(x)} vs {short(y)}")
    return out


def same_dataset(old: dict, new: dict) -> bool:
    """One dataset: equal content (sha256), records read and --columns mapping, wherever the path points or
    however it is spelled."""
    return (old.get("sha256") == new.get("sha256") and old.get("num_records") == new.get("num_records")
            and (old.get("columns") or {}) == (new.get("columns") or {}))


# what a resumed run must share with its partial (engine and numerics without the fields that do not change bits)
RESUME_KEYS = ["command", "model", "dtype", "device", "attention_backend", "job", "dataset", "shard", "engine",
               "numerics", "versions"]
RESUME_COMPARE = {"dataset": same_dataset, "engine": same_bits("engine"), "numerics": same_bits("numerics")}
