"""`--shard I/N`: run one prefix-aware part of a dataset (an array task), no Ray needed.

Every task builds every record's requests to compute the same assignment (scale/partition.py) and runs its own
records, which keep their dataset position (and so their seeds). A shard file adds the column `record_index` and
metadata `shard`; `apcscore merge` (run/parquet_shards.py) joins the shards."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa

from apcscore.io.reader import LoadedDataset
from apcscore.io.writer import ResultsWriter
from apcscore.options.resolve import parse_shard
from apcscore.scale.partition import assign, fingerprint, record_items

SHARD_COLUMN = "record_index"


def select_shard(job: Any, data: LoadedDataset, shard: str, block_size: int,
                 method: str = "prefix") -> tuple[LoadedDataset, dict, list[int]]:
    """(this shard's records, the `shard` metadata, their dataset positions) for `--shard I/N`: every record of
    `data` (valid and invalid) is assigned to one of N parts; `job` (the run's own: jobs are pure) builds the
    requests."""
    index, count = parse_shard(shard)
    items = record_items(job, data.records, data.invalid, block_size)  # in dataset order
    parts = assign(items, count, method)
    loads, records = [0] * count, [0] * count
    for it, p in zip(items, parts):
        loads[p] += it.load
        records[p] += 1
    indices = [it.index for it, p in zip(items, parts) if p == index]
    meta = {"index": index, "count": count, "partition": method, "block_size": block_size,
            "fingerprint": fingerprint(items, parts), "loads": loads, "records": records, "num_rows": len(indices)}
    keep = set(indices)
    mine = replace(data, records=[r for r in data.records if r.index in keep],
                   invalid=[r for r in data.invalid if r.index in keep])
    return mine, meta, indices


class ShardWriter:
    """A ResultsWriter for one shard: rows are added by dataset position (as the runner does) and stored at their
    position within the shard, with the `record_index` column; everything else is the ResultsWriter's."""

    def __init__(self, out_path: str | Path, schema: pa.Schema, metadata: dict, indices: list[int],
                 **kwargs: Any) -> None:
        self._global = list(indices)
        self._local = {g: i for i, g in enumerate(self._global)}
        schema = schema.append(pa.field(SHARD_COLUMN, pa.int64(), nullable=False))
        self._inner = ResultsWriter(out_path, schema, metadata, num_rows=len(self._global), **kwargs)

    @property
    def done_indices(self) -> set[int]:
        """Dataset positions of the rows already written (also those of a resumed partial)."""
        return {self._global[i] for i in self._inner.done_indices}

    def add(self, index: int, row: dict) -> None:
        self._inner.add(self._local[index], {**row, SHARD_COLUMN: index})

    def __getattr__(self, name: str) -> Any:  # flush, close, update_metadata, partial_path, schema, ...
        return getattr(self._inner, name)
