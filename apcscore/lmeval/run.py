"""One `apcscore eval` process: lm-eval's `simple_evaluate` with the apcscore backend; results JSON,
per-request parquet (the command's options and checks: lmeval/command.py).

Order: the tasks are resolved and their data loaded (a task whose data needs the hub fails here, with how to
point it at local files), then the model loads, then lm-eval runs, its responses read from and appended to the
journal in --out (lmeval/store.py, lmeval/outdir.py: --resume, --cache). `<out>/results.json` is
lm-eval's results (without the samples); `<out>/requests.parquet` has one row per request (see
`requests.py`); with --log-samples, `<out>/samples_<task>.jsonl` are lm-eval's samples files.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping

from apcscore.config import EngineConfig
from apcscore.errors import ApcscoreError
from apcscore.io.result_tables import write_atomic
from apcscore.jobs.metadata import (add_timings, apcscore_version, code_fingerprint, engine_sections,
                                    model_section, package_version, run_header, versions)
from apcscore.jobs.options import EvalOptions
from apcscore.jobs.resolve import parse_gen_kwargs, parse_shard
from apcscore.lmeval import outdir
from apcscore.lmeval.store import ResponseStore, identity

HUB_HELP = (
    "lm-eval loads a task's `dataset_path` from the Hugging Face hub, which cannot be reached from here and "
    "has no local copy of it. Point the task at local files: copy its YAML into a folder you pass with "
    "--include-path and set `dataset_path: json` (or `csv`, `parquet`) with `dataset_kwargs: {data_files: "
    "{test: path/to/test.jsonl, train: path/to/train.jsonl}}` (paths relative to where you run the command)")

_HUB_MARKERS = ("hub", "huggingface", "offline", "not cached", "couldn't reach", "connection", "datasetnotfound",
                "repositorynotfound", "localentrynotfound")


def import_lm_eval() -> Any:
    try:
        import lm_eval
    except ModuleNotFoundError:
        raise ApcscoreError("apcscore eval needs lm-evaluation-harness: pip install 'apcscore[lmeval]' "
                            "(or `make install`)") from None
    return lm_eval


def split_tasks(tasks: str) -> list[str]:
    """`T1,T2` -> ["T1", "T2"] (blanks dropped); at least one name."""
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not names:
        raise ApcscoreError("--tasks needs at least one task name, e.g. --tasks arc_easy,hellaswag")
    return names


def _is_hub_failure(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        text = f"{type(seen).__name__} {seen}".lower()
        if isinstance(seen, ConnectionError) or any(m in text for m in _HUB_MARKERS):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def load_tasks(names: list[str], include_path: Path | None) -> Any:
    """lm-eval's TaskManager, after checking every task name and loading every task's data.

    When --include-path holds every named task, only that folder is indexed first (indexing lm-eval's thousands
    of built-in YAML files takes seconds of every run); the full index is built when a name is not there or
    the tasks need something from it (e.g. a group of built-in tasks)."""
    import_lm_eval()
    from lm_eval.tasks import TaskManager

    if include_path is not None and not include_path.is_dir():
        raise ApcscoreError(f"--include-path {include_path}: not a directory")
    if include_path is not None:
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if not _unknown(local, names):
            try:
                local.load(names)
                return local
            except Exception:  # noqa: BLE001  (retried with the full index below, which reports the error)
                pass
    manager = TaskManager(include_path=str(include_path) if include_path else None)
    unknown = _unknown(manager, names)
    if unknown:
        raise ApcscoreError(f"unknown lm-eval task(s): {', '.join(unknown)} (check the names, or add the folder "
                            "of their YAML files with --include-path)")
    try:
        manager.load(names)
    except Exception as exc:  # lm-eval and datasets raise many kinds; say which problem it is
        if _is_hub_failure(exc):
            raise ApcscoreError(f"could not load the data of task(s) {', '.join(names)}: {exc}. {HUB_HELP}") from None
        raise ApcscoreError(f"lm-eval could not load task(s) {', '.join(names)}: {type(exc).__name__}: {exc}") from None
    return manager


def _unknown(manager: Any, names: list[str]) -> list[str]:
    return [n for n in names if n not in manager.all_tasks and not manager.match_tasks([n])]


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived during an eval (raised between engine steps)."""


def evaluate(opts: EvalOptions, echo: Any, note: Any, shards: list[Path] | None = None, engine: Any = None) -> int:
    """One eval process: load the tasks and the model, answer lm-eval's requests from the journal in --out
    (and --cache) or the engine, and write the results (a --shard run: its shard.json). shards: the folders of
    the shard runs a merge reads every response from (nothing is computed: a missing one is an error), with
    `engine` their stand-in (lmeval/scale.RecordedEngine: no weights)."""
    import lm_eval

    from apcscore.lmeval.model import ApcscoreLM
    from apcscore.lmeval.requests import write_outputs, write_samples

    out = Path(opts.out)
    names = split_tasks(opts.tasks)
    gen_kwargs = check_gen_kwargs(opts.gen_kwargs) if opts.gen_kwargs is not None else None
    shard = parse_shard(opts.shard) if opts.shard is not None else None
    manager = load_tasks(names, opts.include_path)
    if opts.overwrite:
        outdir.clear(out)
    started = time.perf_counter()
    lm = ApcscoreLM(pretrained=opts.model, max_length=opts.max_length, seed=opts.engine.seed,
                    progress=not opts.quiet, engine=engine if engine is not None else _engine(opts))
    load_seconds = time.perf_counter() - started
    sections = engine.sections if engine is not None else config_sections(lm, opts.engine)
    ident = identity(sections)
    resumed = outdir.start(out, outdir.run_record(opts, ident), opts.resume)
    caches = [opts.cache] if opts.cache is not None else []
    store = ResponseStore(ident, folders=[*(shards or []), *caches], journals=[out, *caches])
    lm.use_store(store, shard, partition=opts.partition, strict=shards is not None)
    if shards is not None:
        store.write_all()  # the merged folder's journal holds every response: a cache for later runs
    if resumed or store.read:
        note(f"{store.read} finished responses read ({store.name}{' in ' + str(out) if resumed else ''}"
             f"{', ' + str(opts.cache) if caches else ''})")
    try:
        with _stop_on_signals(lm):
            results = lm_eval.simple_evaluate(
                model=lm, tasks=names, task_manager=manager, num_fewshot=opts.num_fewshot,
                limit=lm_eval_limit(opts.limit), apply_chat_template=opts.apply_chat_template,
                fewshot_as_multiturn=fewshot_as_multiturn(opts), system_instruction=opts.system_instruction,
                gen_kwargs=gen_kwargs, log_samples=True)  # the samples make requests.parquet
    except Interrupted:
        note(f"interrupted: {lm.computed} responses computed in this session, {len(store)} kept in "
             f"{out / store.name}; rerun the same command with --resume to continue")
        return 130
    except ValueError as exc:  # random.sample in lm-eval's few-shot sampler: more shots than its split holds
        if "larger than population" not in str(exc):
            raise
        store.close()
        if not resumed:
            outdir.clear(out)  # the run that was just started computed nothing worth keeping
        asked = f"--num-fewshot {opts.num_fewshot}" if opts.num_fewshot is not None else "a task's num_fewshot"
        raise ApcscoreError(f"{asked} asks for more few-shot examples than a task's few-shot split holds (lm-eval: "
                            f"{exc}) — choose a smaller --num-fewshot") from None
    finally:
        store.close()
    if results is None:
        raise ApcscoreError("lm-eval returned no results")
    run_seconds = time.perf_counter() - started - load_seconds
    counts = {"store": store.name, "computed": lm.computed, "read": lm.reused, "other_shards": lm.skipped}
    timing = add_timings(None, lm.engine.counters().to_timings(load_seconds, run_seconds))
    if shard is not None:
        _write_shard(out, opts, ident, sections, counts, timing)
        if not opts.quiet:
            echo(f"shard {opts.shard}: {lm.computed} requests computed, {lm.reused} read, {lm.skipped} left to "
                 f"the other shards; wrote {out / store.name}. Join the shards with `apcscore merge OUT "
                 "SHARD_DIR...`")
        return 0
    meta = run_info(sections, opts, names, results, timing, lm.max_length, counts)
    written = write_samples(out, results if opts.log_samples else {})  # before results.json: it marks a run done
    write_outputs(out, results, meta)
    if not opts.quiet:
        from lm_eval.utils import make_table

        echo(make_table(results))
        if results.get("groups"):
            echo(make_table(results, "groups"))
        echo(f"wrote {out / 'results.json'} and {out / 'requests.parquet'}"
             + (f" and {len(written)} samples file(s) {out / 'samples_<task>.jsonl'}" if written else ""))
    return 0


def _write_shard(out: Path, opts: EvalOptions, ident: dict, sections: dict, counts: dict, timing: dict) -> None:
    record = {"shard": opts.shard, "run": outdir.run_record(opts, ident), "config": sections, "responses": counts,
              "timing": timing}
    write_atomic(out / outdir.SHARD_FILE, (json.dumps(record, indent=2, sort_keys=True, default=str) + "\n").encode())


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_handlers_before: dict[int, Any] = {}  # while an eval's handlers are installed: the ones they replaced


def _restore_handlers_in_child() -> None:
    """In a process forked while an eval's handlers are installed (lm-eval's bootstrap pool forks one worker
    per CPU for each bootstrapped metric), put back the handlers from before the eval, before the child runs
    anything else: `Pool.terminate`'s SIGTERM then kills a worker by the kernel's default action, whatever it
    is doing. (A handler that re-raised in the child was not enough: a CI run hung at the pool's exit, 650 s,
    with a worker alive after the terminate until it was killed by hand.)"""
    for signum, previous in _handlers_before.items():
        signal.signal(signum, previous)


os.register_at_fork(after_in_child=_restore_handlers_in_child)


@contextmanager
def _stop_on_signals(lm: Any) -> Iterator[None]:
    """SIGINT and SIGTERM stop the eval after the current engine step (`Interrupted`); the journal keeps every
    response finished before. A child forked meanwhile gets the handlers from before (see above)."""
    caught: list[int] = []
    owner = os.getpid()

    def handler(signum: int, _frame: Any) -> None:
        if os.getpid() != owner:  # a forked child that missed _restore_handlers_in_child: die as usual
            signal.signal(signum, _handlers_before.get(signum, signal.SIG_DFL))
            os.kill(os.getpid(), signum)
            return
        caught.append(signum)

    def tick(_engine: Any = None) -> None:
        if caught:
            raise Interrupted()

    lm.on_step = tick
    previous = {s: signal.signal(s, handler) for s in _STOP_SIGNALS}
    _handlers_before.update(previous)
    try:
        yield
    finally:
        lm.on_step = None
        _handlers_before.clear()
        for s, h in previous.items():
            signal.signal(s, h)


def fewshot_as_multiturn(opts: EvalOptions) -> bool:
    """lm-eval's rule: on with the chat template unless turned off (--no-fewshot-as-multiturn), else off
    (resolve.check_eval_options refuses it on without the template)."""
    return opts.apply_chat_template if opts.fewshot_as_multiturn is None else opts.fewshot_as_multiturn


# --gen-kwargs keys that are sampling settings -> the record field whose check their values get
_GEN_KWARG_CHECKS = {"max_gen_toks": "max_tokens", "temperature": "temperature", "top_p": "top_p",
                     "top_k": "top_k", "seed": "seed"}


def check_gen_kwargs(text: str) -> dict[str, Any]:
    """--gen-kwargs as lm-eval parses it (`simple_parse_args_string`: numbers and true/false converted), its
    keys those the backend reads and its values checked as a generate record's, before the model loads."""
    from lm_eval.utils import simple_parse_args_string

    from apcscore.config import RECORD_FIELDS
    from apcscore.lmeval.model import GEN_KWARGS

    parse_gen_kwargs(text)  # the form KEY=VALUE,...
    values = simple_parse_args_string(text)
    unknown = sorted(set(values) - GEN_KWARGS)
    if unknown:
        raise ApcscoreError(f"--gen-kwargs {', '.join(unknown)}: not a generation setting the apcscore backend "
                            f"reads — use only {', '.join(sorted(GEN_KWARGS))}")
    if values.get("until") == "":  # lm-eval would drop the task's stop strings for none
        raise ApcscoreError("--gen-kwargs until must not be an empty string (the same check as a generate record's "
                            "'stop', and generate --stop=) — give a stop string, or leave until out to keep each "
                            "task's own")
    for key, field in _GEN_KWARG_CHECKS.items():
        if key in values and (why := RECORD_FIELDS[field](values[key])) is not None:
            raise ApcscoreError(f"--gen-kwargs {key} {why} (the same check as a generate record's {field!r})")
    if not isinstance(values.get("do_sample", False), bool):
        raise ApcscoreError(f"--gen-kwargs do_sample must be true or false, not {values['do_sample']!r}")
    return values


def _engine(opts: EvalOptions) -> Any:
    from apcscore.engine.loader import load_engine

    return load_engine(opts.model, opts.engine)


def task_configs(results: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Each task's version (its config's `metadata.version`) and the sha256 of its config as lm-eval resolved
    it (results.json's `configs`: the YAML with includes, overrides such as --num-fewshot and --gen-kwargs,
    functions as their source), JSON with sorted keys (`default=str`)."""
    out = {}
    for task, cfg in results.get("configs", {}).items():
        text = json.dumps(cfg, sort_keys=True, default=str, ensure_ascii=False)
        out[task] = {"version": (cfg.get("metadata") or {}).get("version"),
                     "sha256": hashlib.sha256(text.encode()).hexdigest()}
    return out


def config_sections(lm: Any, config: EngineConfig) -> dict[str, Any]:
    """The run metadata's sections that describe the model and the engine (jobs/metadata.py, as every run
    records them): what fixes the bits, so the responses' identity is made of them (lmeval/store.identity)."""
    engine = lm.engine
    return {
        "apcscore_version": apcscore_version(),
        "code": code_fingerprint(),
        "model": model_section(engine),
        **engine_sections(engine, config),
        "numerics": engine.numerics,  # batch invariance on this machine (docs/architecture.md, "The contract")
        "versions": versions(lm_eval=package_version("lm_eval"), triton=package_version("triton")),
    }


def lm_eval_limit(limit: float | None) -> float | int | None:
    """--limit as lm-eval takes it: a whole number of documents as an int (the command line reads 10 as 10.0),
    a fraction below 1 as it is."""
    return int(limit) if limit is not None and limit >= 1 else limit


def run_info(sections: Mapping[str, Any], opts: EvalOptions, names: list[str], results: Mapping[str, Any],
             timing: Mapping[str, Any], max_length: int, responses: Mapping[str, Any]) -> dict[str, Any]:
    """Our run metadata for the parquet (key `apcscore`) and results.json (key `apcscore`): the sections every
    run records (jobs/metadata.py), with the eval's own; `timing`: this process's seconds and engine counters
    (jobs/metadata.add_timings: prompt tokens computed, the prefix cache's hits); `responses`: how many were
    computed and read."""
    return {
        **run_header("eval"),
        "tasks": names, "num_fewshot": opts.num_fewshot, "limit": lm_eval_limit(opts.limit),
        "apply_chat_template": opts.apply_chat_template, "fewshot_as_multiturn": fewshot_as_multiturn(opts),
        "system_instruction": opts.system_instruction, "gen_kwargs": opts.gen_kwargs,
        "max_length": max_length,
        "task_configs": task_configs(results),
        **{k: v for k, v in sections.items() if k not in ("apcscore_version", "code")},
        "responses": dict(responses),
        "timing": dict(timing),
    }
