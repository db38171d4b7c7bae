"""`apcscore eval`: lm-eval's `simple_evaluate` with the apcscore backend; results JSON, per-request parquet.

Order: the tasks are resolved and their data loaded first (a task whose data needs the hub fails here, with
how to point it at local files), then the model loads, then lm-eval runs. `<out>/results.json` is lm-eval's
results (without the samples); `<out>/requests.parquet` has one row per request (see `requests.py`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Mapping

from apcscore.config import EngineConfig
from apcscore.errors import ApcscoreError
from apcscore.jobs.metadata import engine_sections, model_section, package_version, run_header, versions
from apcscore.jobs.options import EvalOptions, cli_values

HUB_HELP = (
    "lm-eval loads a task's `dataset_path` from the Hugging Face hub, which cannot be reached from here and "
    "has no local copy of it. Point the task at local files: copy its YAML into a folder you pass with "
    "--include-path and set `dataset_path: json` (or `csv`, `parquet`) with `dataset_kwargs: {data_files: "
    "{test: path/to/test.jsonl, train: path/to/train.jsonl}}` (paths relative to where you run the command)")

_HUB_MARKERS = ("hub", "huggingface", "offline", "not cached", "couldn't reach", "connection", "datasetnotfound",
                "repositorynotfound", "localentrynotfound")


def _import_lm_eval() -> Any:
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
    _import_lm_eval()
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


def run_eval(cli: Mapping[str, Any], echo: Any) -> dict[str, Any]:
    """Run `apcscore eval` with its command-line values (the parameters of EvalOptions, None = not given);
    return lm-eval's results (samples included). echo: prints a line.

    The tasks and --out are checked first, then the options (EvalOptions, its EngineConfig), before anything
    loads."""
    lm_eval = _import_lm_eval()
    from apcscore.lmeval.model import ApcscoreLM
    from apcscore.lmeval.requests import write_outputs

    names = split_tasks(cli["tasks"])
    out = Path(cli.get("out") or f"results/eval-{time.strftime('%Y%m%d-%H%M%S')}")
    if out.exists() and not out.is_dir():
        raise ApcscoreError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and (out / "results.json").exists() and not cli.get("overwrite"):
        raise ApcscoreError(f"--out {out} already holds results.json; pass --overwrite or choose another folder")
    opts = EvalOptions.from_values(cli_values(cli))  # checked before anything loads
    config = opts.engine
    manager = load_tasks(names, opts.include_path)
    started = time.perf_counter()
    lm = ApcscoreLM(pretrained=opts.model, max_length=opts.max_length,
                    seed=config.seed, progress=not opts.quiet, engine=_engine(opts, config))
    load_seconds = time.perf_counter() - started
    results = lm_eval.simple_evaluate(
        model=lm, tasks=names, task_manager=manager, num_fewshot=opts.num_fewshot,
        limit=opts.limit, apply_chat_template=opts.apply_chat_template,
        fewshot_as_multiturn=opts.apply_chat_template, log_samples=True)
    if results is None:
        raise ApcscoreError("lm-eval returned no results")
    run_seconds = time.perf_counter() - started - load_seconds
    meta = run_info(lm, config, opts, names, load_seconds, run_seconds)
    write_outputs(out, results, meta)
    if not opts.quiet:
        from lm_eval.utils import make_table

        echo(make_table(results))
        if results.get("groups"):
            echo(make_table(results, "groups"))
        echo(f"wrote {out / 'results.json'} and {out / 'requests.parquet'}")
    return results


def _engine(opts: EvalOptions, config: EngineConfig) -> Any:
    from apcscore.engine.loader import load_engine

    return load_engine(opts.model, config)


def run_info(lm: Any, config: EngineConfig, opts: EvalOptions, names: list[str], load_seconds: float,
             run_seconds: float) -> dict[str, Any]:
    """Our run metadata for the parquet (key `apcscore`) and results.json (key `apcscore`): the sections every
    run records (jobs/metadata.py), with the eval's own."""
    engine = lm.engine
    return {
        **run_header("eval"),
        "tasks": names, "num_fewshot": opts.num_fewshot, "limit": opts.limit,
        "apply_chat_template": opts.apply_chat_template, "max_length": lm.max_length,
        "model": model_section(engine),
        **engine_sections(engine, config),
        "numerics": engine.numerics,  # batch invariance on this machine (docs/architecture.md, "The contract")
        "versions": versions(lm_eval=package_version("lm_eval")),
        "timing": {"load_seconds": round(load_seconds, 3), "run_seconds": round(run_seconds, 3)},
    }
