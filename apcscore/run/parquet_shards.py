"""`apcscore merge OUT SHARD...`: join the files of `--shard I/N` runs into the file one run would have written.

Refused before anything is written (exit 2): a file that is not a finished shard file, shards of another dataset,
split or configuration (io/identity.py's MERGE view), a shard twice or missing. The output is the rows in dataset
order without `record_index`, with shard 0's metadata without `shard`, plus `merged` and the summed `timings`."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from apcscore.errors import ApcscoreError
from apcscore.io.identity import MERGE, code_changed, differing
from apcscore.io.result_tables import METADATA_KEY, dumps_metadata, read_run_metadata
from apcscore.run.metadata import add_timings
from apcscore.run.preflight import check_file_path, check_out_format
from apcscore.scale.shard import SHARD_COLUMN

_SPLIT_KEYS = ("count", "partition", "block_size", "fingerprint")
ROW_GROUP_SIZE = 256


def _probe_failure(meta: dict) -> str | None:
    """The reason a shard's engine found batch invariance broken at start-up (None: it held, or was not asked)."""
    numerics = meta.get("numerics") or {}
    probe = numerics.get("probe") or {}
    return numerics.get("reason") if probe and not probe.get("passed", True) else None


def check_shards(paths: list[Path]) -> list[dict]:
    """The shards' metadata, ordered by shard index; ApcscoreError when they are not one complete split."""
    if not paths:
        raise ApcscoreError("merge needs the shard files to join: apcscore merge OUT SHARD...")
    metas = []
    folders = [p for p in paths if p.is_dir()]
    if folders:  # the cli sends all-folder merges to eval's; a mix is refused here
        raise ApcscoreError(f"{folders[0]} is a folder (an eval shard?) and "
                            f"{next(p for p in paths if p not in folders)} is not: merge joins the shard files of "
                            "one score, generate or perplexity run, or the shard folders of one eval run — give "
                            "shards of one kind")
    for path in paths:
        if not path.is_file():
            partial = path.with_name(path.name + ".partial")
            hint = f" ({partial} holds an unfinished shard: finish it with --resume)" if partial.exists() else ""
            raise ApcscoreError(f"{path}: no such shard file{hint}")
        meta = read_run_metadata(path)
        if "shard" not in meta or SHARD_COLUMN not in pq.read_schema(path).names:
            raise ApcscoreError(f"{path} is not a shard file (written without --shard I/N); merge joins the files "
                                "of one --shard 0/N .. N-1/N run")
        failed = _probe_failure(meta)
        if failed:
            raise ApcscoreError(f"{path} was computed where batch invariance does not hold ({failed}), so the "
                                "merged file would not be what one process writes; rerun that shard on a machine "
                                "whose start-up probe passes")
        metas.append(meta)
    first, first_path = metas[0], paths[0]
    for path, meta in zip(paths[1:], metas[1:]):
        differ = differing(first, meta, MERGE)
        if differ:
            fix = ("rerun every shard with one apcscore (the same version and numerics code), or start afresh "
                   "with a new --out per shard" if code_changed(differ) else "rerun the odd shard with the "
                   "others' settings")
            raise ApcscoreError(f"{path} and {first_path} are not shards of one dataset under one configuration "
                                f"({first_path.name} vs {path.name}: {'; '.join(differ)}); {fix}")
        a, b = first["shard"], meta["shard"]
        split = [f"{k}: {a.get(k)} vs {b.get(k)}" for k in _SPLIT_KEYS if a.get(k) != b.get(k)]
        if split:
            raise ApcscoreError(f"{path} and {first_path} split the dataset differently ({'; '.join(split)}); every "
                                "shard must come from the same --shard I/N split")
    by_index: dict[int, Path] = {}
    for path, meta in zip(paths, metas):
        i = meta["shard"]["index"]
        if i in by_index:
            raise ApcscoreError(f"overlap: {by_index[i]} and {path} are both shard {i}/{meta['shard']['count']}; "
                                "give each shard once")
        by_index[i] = path
    count = first["shard"]["count"]
    missing = sorted(set(range(count)) - set(by_index))
    if missing:
        raise ApcscoreError(f"gap: shard{'s' if len(missing) > 1 else ''} "
                            f"{', '.join(f'{i}/{count}' for i in missing)} of {count} "
                            f"{'are' if len(missing) > 1 else 'is'} missing; run "
                            f"{'them' if len(missing) > 1 else 'it'} and pass every shard file")
    order = sorted(range(len(metas)), key=lambda k: metas[k]["shard"]["index"])
    return [dict(metas[k], _path=str(paths[k])) for k in order]


def merge_shards(out: Path, paths: list[Path], overwrite: bool = False) -> tuple[Path, int]:
    """Check the shards and write `out`; return (out, rows)."""
    check_file_path(out, "OUT")  # as score's --out: not a folder, not under a file, somewhere writable
    check_out_format(out, "OUT", "the merged file is")  # nor named .csv, .jsonl.gz, ... (it is parquet)
    if out.exists() and not overwrite:
        raise ApcscoreError(f"{out} exists — pass --overwrite to replace it, or choose another OUT")
    if any(out.resolve() == p.resolve() for p in paths):
        raise ApcscoreError(f"OUT {out} is one of the shard files; choose another OUT")
    metas = check_shards(paths)
    total = metas[0]["dataset"]["num_records"]
    tables = [pq.read_table(m["_path"]) for m in metas]
    table = pa.concat_tables(tables).sort_by(SHARD_COLUMN)
    got = table.column(SHARD_COLUMN).to_numpy()
    if len(got) != total or (total and (got[0] != 0 or (got[1:] - got[:-1] != 1).any())):
        seen = set(got.tolist())
        dup = len(got) - len(seen)
        absent = sorted(set(range(total)) - seen)
        raise ApcscoreError(f"the shards' rows do not cover the dataset's {total} records exactly once ("
                            f"{dup} rows twice, {len(absent)} missing, e.g. {absent[:5]}); rerun the shards")
    timings = None
    for m in metas:
        if m.get("timings"):
            timings = add_timings(timings, m["timings"])
    meta = {k: v for k, v in metas[0].items() if k not in ("shard", "_path")}
    meta.update({"timings": timings, "merged": {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "shards": [{"file": m["_path"], "index": m["shard"]["index"], "num_rows": m["shard"]["num_rows"],
                    "load": m["shard"]["loads"][m["shard"]["index"]], "timings": m.get("timings")} for m in metas],
        "partition": {k: metas[0]["shard"][k] for k in _SPLIT_KEYS}}})
    table = table.drop_columns([SHARD_COLUMN])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".merge.tmp")
    try:
        pq.write_table(table.replace_schema_metadata({METADATA_KEY: dumps_metadata(meta).encode()}), tmp,
                       row_group_size=ROW_GROUP_SIZE)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out, table.num_rows
