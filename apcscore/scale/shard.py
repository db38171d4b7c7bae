"""`--shard I/N`: run one prefix-aware part of a dataset (an array task), no Ray needed.

Every task builds every record's requests to compute the same assignment (scale/partition.py) and runs its own
records, which keep their dataset position (and so their seeds). A shard file adds the column `record_index` and
metadata `shard`; `apcscore merge` (run/parquet_shards.py) joins the shards."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pyarrow as pa

from apcscore.io.reader import LoadedDataset
from apcscore.io.writer import ResultsWriter
from apcscore.options.resolve import parse_shard
from apcscore.scale.partition import assign, fingerprint, record_items

SHARD_COLUMN = "record_index"


@dataclass(frozen=True)
class Split:
    """A dataset's assignment to `count` parts."""

    count: int
    method: str
    block_size: int
    part_of: dict[int, int]  # record index -> part
    loads: list[int]  # per part
    records: list[int]  # records per part
    fingerprint: str

    def indices(self, part: int) -> list[int]:
        """The dataset positions of part `part`'s records, ascending."""
        return sorted(i for i, p in self.part_of.items() if p == part)

    def metadata(self) -> dict:
        return {"count": self.count, "partition": self.method, "block_size": self.block_size,
                "fingerprint": self.fingerprint, "loads": self.loads, "records": self.records}


def split_dataset(job: Any, data: LoadedDataset, count: int, block_size: int, method: str = "prefix") -> Split:
    """Assign every record of `data` (valid and invalid) to one of `count` parts; `job` builds the requests."""
    items = record_items(job, data.records, data.invalid, block_size)
    parts = assign(items, count, method)
    loads, records = [0] * count, [0] * count
    for it, p in zip(items, parts):
        loads[p] += it.load
        records[p] += 1
    return Split(count, method, block_size, {it.index: p for it, p in zip(items, parts)}, loads, records,
                 fingerprint(items, parts))


def part_of_dataset(data: LoadedDataset, keep: set[int]) -> LoadedDataset:
    """`data` with only the records (valid and invalid) at positions `keep`."""
    return replace(data, records=[r for r in data.records if r.index in keep],
                   invalid=[r for r in data.invalid if r.index in keep])


def select_shard(job: Any, data: LoadedDataset, shard: str, block_size: int,
                 method: str = "prefix") -> tuple[LoadedDataset, dict, list[int]]:
    """(this shard's records, the `shard` metadata, their dataset positions) for `--shard I/N`; `job` (the
    run's own: jobs are pure) builds the requests."""
    index, count = parse_shard(shard)
    split = split_dataset(job, data, count, block_size, method)
    indices = split.indices(index)
    meta = {"index": index, **split.metadata(), "num_rows": len(indices)}
    return part_of_dataset(data, set(indices)), meta, indices


def shard_schema(schema: pa.Schema) -> pa.Schema:
    """A shard file's schema: the command's columns plus `record_index`."""
    return schema.append(pa.field(SHARD_COLUMN, pa.int64(), nullable=False))


class ShardWriter:
    """A ResultsWriter for one shard: rows are added by dataset position (as the runner does) and stored at their
    position within the shard, with the `record_index` column; everything else is the ResultsWriter's."""

    def __init__(self, out_path: str | Path, schema: pa.Schema, metadata: dict, indices: list[int],
                 **kwargs: Any) -> None:
        self._global = list(indices)
        self._local = {g: i for i, g in enumerate(self._global)}
        self._inner = ResultsWriter(out_path, shard_schema(schema), metadata, num_rows=len(self._global), **kwargs)

    @property
    def done_indices(self) -> set[int]:
        """Dataset positions of the rows already written (also those of a resumed partial)."""
        return {self._global[i] for i in self._inner.done_indices}

    def add(self, index: int, row: dict) -> None:
        self._inner.add(self._local[index], {**row, SHARD_COLUMN: index})

    def __getattr__(self, name: str) -> Any:  # flush, close, update_metadata, partial_path, schema, ...
        return getattr(self._inner, name)
