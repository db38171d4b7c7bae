"""`eval --shard I/N` joined by `apcscore merge OUT SHARD_DIR...` (docs/eval_jobs.md).

A shard process builds every task's requests, computes only its share of each request call (run/eval.shard_split),
journals those responses and writes `shard.json`, no results. A merge checks the shards (one run and configuration,
every shard once, each finished) and runs lm-eval once more with every response read from their journals, on a
stand-in engine without weights (`RecordedEngine`): the results are one process's, bitwise."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from apcscore.engine.counters import EngineCounters
from apcscore.errors import ApcscoreError
from apcscore.lmeval.store import identity_differences
from apcscore.options.commands import EvalOptions
from apcscore.run import eval_folder


def read_shards(paths: list[Path]) -> list[dict[str, Any]]:
    """The shard records of `paths`, in shard order, after checking they are the finished shards of one run."""
    records = []
    for path in paths:
        if not (path / eval_folder.SHARD_FILE).exists():
            why = ("a finished eval run without --shard: there is nothing to merge, its results are in "
                   f"{path / 'results.json'}") if (path / "results.json").exists() else \
                "unfinished: rerun it with --resume" if (path / eval_folder.RUN_FILE).exists() else \
                "not the folder of an `apcscore eval --shard` run"
            raise ApcscoreError(f"{path}: no {eval_folder.SHARD_FILE} ({why})")
        records.append({**eval_folder.read_json(path / eval_folder.SHARD_FILE, "an eval shard record"), "_path": path})
    first = records[0]
    base = {k: v for k, v in first["run"]["run"].items() if k != "shard"}
    for rec in records[1:]:
        run = {k: v for k, v in rec["run"]["run"].items() if k != "shard"}
        diffs = sorted(k for k in base.keys() | run.keys() if base.get(k) != run.get(k))
        if diffs:
            raise ApcscoreError(f"{rec['_path']} and {first['_path']} are shards of different runs (they differ in "
                                f"{', '.join(diffs)})")
        if rec["run"]["identity"] != first["run"]["identity"]:
            diffs = identity_differences(first["run"]["identity"], rec["run"]["identity"])
            raise ApcscoreError(f"{rec['_path']} and {first['_path']} ran under different configurations "
                                f"({'; '.join(diffs)}): their responses cannot make one run; rerun the odd shard "
                                "with the others' apcscore and settings")
    n = int(first["shard"].split("/")[1])
    index = {}
    for rec in records:
        i, m = (int(x) for x in rec["shard"].split("/"))
        if m != n:
            raise ApcscoreError(f"{rec['_path']} is shard {rec['shard']}, {first['_path']} one of {n}")
        if i in index:
            raise ApcscoreError(f"shard {i}/{n} given twice: {index[i]['_path']} and {rec['_path']}")
        index[i] = rec
    missing = [f"{i}/{n}" for i in range(n) if i not in index]
    if missing:
        raise ApcscoreError(f"shards missing: {', '.join(missing)} (every shard 0/{n} .. {n - 1}/{n} is needed)")
    return [index[i] for i in range(n)]


class RecordedEngine:
    """What lm-eval's side of a merge asks of an engine, without weights: the tokenizer, the model facts and
    settings the shards recorded (`config`: lmeval/results.config_sections). It runs nothing."""

    def __init__(self, tokenizer: Any, config: dict[str, Any]) -> None:
        model = config["model"]
        self.tokenizer = tokenizer
        self.sections = config
        self.info = SimpleNamespace(name=model["name"], path=model["path"], num_parameters=model["num_parameters"],
                                    fingerprint=model["fingerprint"], max_model_len=model["max_model_len"])
        self.dtype = getattr(torch, config["dtype"])  # what get_model_info shows: as the engine's

    def run(self, requests: Any, on_step: Any = None) -> Any:
        raise RuntimeError("a merge computes nothing: every response comes from the shards")

    def counters(self) -> EngineCounters:
        return EngineCounters()  # it computed nothing (the shards' counters are in their shard.json)


def prepare_merge(out: Path, paths: list[Path], overwrite: bool) -> tuple[EvalOptions, RecordedEngine]:
    """`apcscore merge` of eval shards: check them and OUT; return the options of the run that writes OUT (the shards',
    with OUT) and the engine stand-in that answers it (run/eval.merge_eval runs it)."""
    from apcscore.models.loaded import load_parts
    from apcscore.models.locate import resolve_model

    if any(out.resolve() == p.resolve() for p in paths):
        raise ApcscoreError(f"OUT {out} is one of the shard folders; choose another OUT")
    records = read_shards(paths)
    values = {**records[0]["run"]["options"], "out": str(out), "shard": None, "overwrite": overwrite,
              "resume": not overwrite, "cache": None, "ray": None, "replicas": 1, "cpus_per_replica": None,
              "gpus_per_replica": None}
    opts = EvalOptions.from_values(values)
    eval_folder.check_out(out, opts)
    tokenizer = load_parts(opts.model, *resolve_model(opts.model)).tokenizer
    return opts, RecordedEngine(tokenizer, records[0]["config"])
