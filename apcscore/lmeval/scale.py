"""`eval --shard I/N` joined by `apcscore merge OUT SHARD_DIR...`, and `eval --ray`: lm-eval requests split
over processes, results equal to one process's.

A shard process builds every task's requests (lm-eval's task building is deterministic), computes only its
share of each request call (ApcscoreLM.shard_mask: the prefix-aware split of `--shard`, scale/partition.py,
so the requests that share their first KV blocks — a task's few-shot prefix, a context's choices — run in one
engine), appends those responses to its journal (lmeval/store.py) and writes `shard.json` (what it was asked,
its configuration, its counts). It writes no results: its metrics would be computed over placeholders.

A merge checks the shards (the same run and configuration, every shard 0..N-1 once, each finished), then runs
lm-eval once more with every response read from the shards' journals and none computed (a missing one is an
error). It needs no weights: the engine is a stand-in (`RecordedEngine`) that has the tokenizer and the model
facts the shards recorded. A response is stored exactly, so results.json's metrics and requests.parquet are
those one process computes, bitwise. The merged folder's journal holds every response (a cache for later).

`--ray` runs the N = --replicas shards as Ray tasks (--cpus-per-replica, --gpus-per-replica) into
`<out>/shards/I-of-N`, then merges them into <out> in this process. With --resume, finished shards are kept
and unfinished ones continue from their journals. The shard folders must be reachable from this process (one
machine, or a shared file system).
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from apcscore.config import EngineConfig
from apcscore.engine.counters import EngineCounters
from apcscore.errors import ApcscoreError
from apcscore.io.identity import short
from apcscore.jobs.options import EvalOptions
from apcscore.lmeval import outdir

SHARDS = "shards"


def is_eval_shard(path: Path) -> bool:
    """Whether `path` is the folder of an `eval --shard` run (finished or not)."""
    return Path(path).is_dir() and ((Path(path) / outdir.SHARD_FILE).exists() or (Path(path) / outdir.RUN_FILE).exists())


def read_shards(paths: list[Path]) -> list[dict[str, Any]]:
    """The shard records of `paths`, in shard order, after checking they are the finished shards of one run."""
    records = []
    for path in paths:
        if not (path / outdir.SHARD_FILE).exists():
            why = ("a finished eval run without --shard: there is nothing to merge, its results are in "
                   f"{path / 'results.json'}") if (path / "results.json").exists() else \
                "unfinished: rerun it with --resume" if (path / outdir.RUN_FILE).exists() else \
                "not the folder of an `apcscore eval --shard` run"
            raise ApcscoreError(f"{path}: no {outdir.SHARD_FILE} ({why})")
        records.append({**outdir.read_json(path / outdir.SHARD_FILE, "an eval shard record"), "_path": path})
    first = records[0]
    base = {k: v for k, v in first["run"]["run"].items() if k != "shard"}
    for rec in records[1:]:
        run = {k: v for k, v in rec["run"]["run"].items() if k != "shard"}
        diffs = sorted(k for k in base.keys() | run.keys() if base.get(k) != run.get(k))
        if diffs:
            raise ApcscoreError(f"{rec['_path']} and {first['_path']} are shards of different runs (they differ in "
                                f"{', '.join(diffs)})")
        if rec["run"]["identity"] != first["run"]["identity"]:
            diffs = outdir.identity_differences(first["run"]["identity"], rec["run"]["identity"])
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
    settings the shards recorded (`config`: lmeval/run.config_sections). It runs nothing."""

    def __init__(self, tokenizer: Any, config: dict[str, Any]) -> None:
        model = config["model"]
        self.tokenizer = tokenizer
        self.sections = config
        self.info = SimpleNamespace(name=model["name"], path=model["path"], num_parameters=model["num_parameters"],
                                    fingerprint=model["fingerprint"], max_model_len=model["max_model_len"])
        self.dtype = getattr(torch, config["dtype"])  # what get_model_info shows: as the engine's
        self.config = EngineConfig()

    def run(self, requests: Any, on_step: Any = None) -> Any:
        raise RuntimeError("a merge computes nothing: every response comes from the shards")

    def counters(self) -> EngineCounters:
        return EngineCounters()  # it computed nothing (the shards' counters are in their shard.json)


def merge_eval(out: Path, paths: list[Path], overwrite: bool, echo: Any, note: Any) -> int:
    """`apcscore merge OUT SHARD_DIR...` of eval shards: check them, then write OUT as one run would have."""
    from apcscore.lmeval.run import evaluate
    from apcscore.models.locate import resolve_model
    from apcscore.models.resolved import resolve_model_parts

    if any(out.resolve() == p.resolve() for p in paths):
        raise ApcscoreError(f"OUT {out} is one of the shard folders; choose another OUT")
    records = read_shards(paths)
    values = {**records[0]["run"]["options"], "out": str(out), "shard": None, "overwrite": overwrite,
              "resume": not overwrite, "cache": None, "ray": None, "replicas": 1, "cpus_per_replica": None,
              "gpus_per_replica": None}
    opts = outdir.options_from(values)
    outdir.check_out(out, opts)
    tokenizer = resolve_model_parts(resolve_model(opts.model).path).tokenizer
    engine = RecordedEngine(tokenizer, records[0]["config"])
    return evaluate(opts, echo, note, shards=paths, engine=engine)


def eval_on_ray(opts: EvalOptions, echo: Any, note: Any) -> int:
    """`eval --ray`: the shards as Ray tasks into <out>/shards/, then their merge into <out>."""
    from apcscore.scale.ray_run import connect, import_ray, replica_resources

    ray = import_ray()
    out, n = Path(opts.out), int(opts.replicas)
    folders = [out / SHARDS / f"{i}-of-{n}" for i in range(n)]
    if (out / SHARDS).exists():
        if opts.overwrite:
            shutil.rmtree(out / SHARDS)
        elif not opts.resume:
            raise ApcscoreError(f"--out {out} holds the shards of an unfinished --ray run ({out / SHARDS}); pass "
                                "--resume to continue it, or --overwrite to discard it and start over")
    started = connect(ray, opts.ray)
    try:
        cpus, gpus = replica_resources(ray, opts)
        task = ray.remote(_shard_task).options(num_cpus=cpus, num_gpus=gpus, max_retries=2)
        values = outdir.flat_options(opts)
        refs = []
        for i, folder in enumerate(folders):
            if (folder / outdir.SHARD_FILE).exists():  # finished in an earlier session of this run
                check_finished(folder, values, f"{i}/{n}")
                continue
            shard = {**values, "out": str(folder), "shard": f"{i}/{n}", "ray": None, "replicas": 1,
                     "cpus_per_replica": None, "gpus_per_replica": None, "overwrite": False, "resume": True,
                     "quiet": True}
            refs.append(task.remote(shard))
        codes = ray.get(refs)
    finally:
        if started:
            ray.shutdown()
    if any(codes):
        note(f"a shard was interrupted; rerun with --resume to continue ({out / SHARDS})")
        return 130
    return merge_eval(out, folders, opts.overwrite, echo, note)


def check_finished(folder: Path, values: dict[str, Any], shard: str) -> None:
    """`eval --ray --resume`: refuse a finished shard that was asked otherwise than this run (the options of
    outdir.RUN_KEYS) or computed by another apcscore (its version and numerics code). The rest of its identity
    (numerics, versions) is compared with the other shards' by the merge."""
    from apcscore.jobs.metadata import apcscore_version, code_fingerprint

    record = outdir.read_json(folder / outdir.SHARD_FILE, "an eval shard record")
    asked = (record.get("run") or {}).get("run") or {}
    ident = (record.get("run") or {}).get("identity") or {}
    now = {**{k: values.get(k) for k in outdir.RUN_KEYS}, "shard": shard}
    diffs = [f"{k}: {short(asked.get(k), 80)} vs {short(now[k], 80)}" for k in outdir.RUN_KEYS
             if asked.get(k) != now[k]]
    code = {"apcscore_version": apcscore_version(), **{f"code.{k}": v for k, v in code_fingerprint().items()}}
    diffs += [f"{k}: {short(ident.get(k), 80)} vs {short(v, 80)}" for k, v in code.items()
              if ident.get(k) != v]
    if diffs:
        raise ApcscoreError(f"--resume: the finished shard {folder} was run otherwise than this run "
                            f"({'; '.join(diffs)}); run it with its own options, or start afresh: --overwrite, "
                            "or another --out")


def _shard_task(values: dict[str, Any]) -> int:
    """One shard of `eval --ray`, in a Ray worker."""
    from apcscore.lmeval.run import evaluate

    opts = outdir.options_from(values)
    opts = replace(opts, quiet=True)
    return evaluate(opts, lambda text: None, lambda text: None)
