"""lm-eval's side of `apcscore eval` before the model: the task list, the tasks and their data, --gen-kwargs
and --limit as lm-eval takes them. Parsed once per run into an `EvalPlan` (run/eval.py hands it down)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from apcscore.errors import ApcscoreError
from apcscore.options.commands import EvalOptions
from apcscore.options.resolve import parse_shard


def import_lm_eval() -> Any:
    try:
        import lm_eval
    except ModuleNotFoundError:
        raise ApcscoreError("apcscore eval needs lm-evaluation-harness: pip install 'apcscore[lmeval]' "
                            "(or `make install`)") from None
    return lm_eval


@dataclass(frozen=True)
class EvalPlan:
    """An eval's options parsed once: the task names, --gen-kwargs as lm-eval's values (checked), --shard as
    (index, count)."""

    tasks: list[str]
    gen_kwargs: dict[str, Any] | None
    shard: tuple[int, int] | None


def plan(opts: EvalOptions) -> EvalPlan:
    """The `EvalPlan` of `opts` (every check before the model loads)."""
    return EvalPlan(tasks=split_tasks(opts.tasks),
                    gen_kwargs=check_gen_kwargs(opts.gen_kwargs) if opts.gen_kwargs is not None else None,
                    shard=parse_shard(opts.shard) if opts.shard is not None else None)


def split_tasks(tasks: str) -> list[str]:
    """`T1,T2` -> ["T1", "T2"] (blanks dropped); at least one name."""
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not names:
        raise ApcscoreError("--tasks needs at least one task name, e.g. --tasks arc_easy,hellaswag")
    return names


HUB_HELP = (
    "lm-eval loads a task's `dataset_path` from the Hugging Face hub, which cannot be reached from here and "
    "has no local copy of it. Point the task at local files: copy its YAML into a folder you pass with "
    "--include-path and set `dataset_path: json` (or `csv`, `parquet`) with `dataset_kwargs: {data_files: "
    "{test: path/to/test.jsonl, train: path/to/train.jsonl}}` (paths relative to where you run the command, "
    "not to the YAML's folder)")

_HUB_MARKERS = ("hub", "huggingface", "offline", "not cached", "couldn't reach", "connection", "datasetnotfound",
                "repositorynotfound", "localentrynotfound")


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """exc, then what it was raised from or while handling, and so on."""
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


def _is_hub_failure(exc: BaseException) -> bool:
    return any(isinstance(e, ConnectionError) or any(m in f"{type(e).__name__} {e}".lower() for m in _HUB_MARKERS)
               for e in _chain(exc))


def load_tasks(names: list[str], include_path: Path | None) -> Any:
    """lm-eval's TaskManager, after checking every task name and loading every task's data. When --include-path holds
    every named task, only that folder is indexed (lm-eval's built-in index takes seconds), else the full index."""
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
        raise ApcscoreError(f"lm-eval could not load task(s) {', '.join(names)}: {type(exc).__name__}: {exc}"
                            f"{_data_files_hint(exc, include_path)}") from None
    return manager


def _data_files_hint(exc: BaseException, include_path: Path | None) -> str:
    """For a data file not found: lm-eval reads `data_files` relative to the working directory, not the YAML's folder;
    the path to write when the file is next to a YAML of --include-path (docs/eval_jobs.md, "Local task data")."""
    seen = next((e for e in _chain(exc) if isinstance(e, FileNotFoundError)), None)
    match = re.search(r"Unable to find '([^']+)'", str(seen)) if seen is not None else None
    if match is None:
        return ""
    cwd = Path.cwd()
    hint = (f" — a task's data_files are read relative to the working directory ({cwd}), not to the task YAML's "
            "folder (lm-eval's rule)")
    missing = Path(match.group(1))
    if include_path is not None and missing.is_relative_to(cwd):
        relative = missing.relative_to(cwd)
        folders = dict.fromkeys(y.parent for y in sorted(include_path.absolute().rglob("*.y*ml")))
        there = next((f / relative for f in folders if (f / relative).is_file()), None)
        if there is not None:
            shown = there.relative_to(cwd) if there.is_relative_to(cwd) else there
            return f"{hint}: {relative} is next to a YAML in --include-path, so write it as {shown} (or absolute)"
    return f"{hint}: write each path relative to {cwd}, or absolute"


def _unknown(manager: Any, names: list[str]) -> list[str]:
    return [n for n in names if n not in manager.all_tasks and not manager.match_tasks([n])]


def fewshot_as_multiturn(opts: EvalOptions) -> bool:
    """lm-eval's rule: on with the chat template unless turned off (--no-fewshot-as-multiturn), else off
    (resolve.check_eval_options refuses it on without the template)."""
    return opts.apply_chat_template if opts.fewshot_as_multiturn is None else opts.fewshot_as_multiturn


# --gen-kwargs keys that are sampling settings -> the record field whose check their values get
_GEN_KWARG_CHECKS = {"max_gen_toks": "max_tokens", "temperature": "temperature", "top_p": "top_p",
                     "top_k": "top_k", "seed": "seed"}


def check_gen_kwargs(text: str) -> dict[str, Any]:
    """--gen-kwargs as lm-eval parses it (`simple_parse_args_string`), its keys those the backend reads and its values
    checked as a generate record's, before the model loads."""
    from lm_eval.utils import simple_parse_args_string

    from apcscore.config import RECORD_FIELDS
    from apcscore.lmeval.model import GEN_KWARGS

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


def lm_eval_limit(limit: float | None) -> float | int | None:
    """--limit as lm-eval takes it: a whole number of documents as an int (the command line reads 10 as 10.0),
    a fraction below 1 as it is."""
    return int(limit) if limit is not None and limit >= 1 else limit


def simple_evaluate(lm: Any, manager: Any, parsed: EvalPlan, opts: EvalOptions) -> Any:
    """lm-eval's `simple_evaluate` over `lm` with the run's tasks and prompt options; the samples are always
    asked for (they make requests.parquet)."""
    import lm_eval

    return lm_eval.simple_evaluate(
        model=lm, tasks=parsed.tasks, task_manager=manager, num_fewshot=opts.num_fewshot,
        limit=lm_eval_limit(opts.limit), apply_chat_template=opts.apply_chat_template,
        fewshot_as_multiturn=fewshot_as_multiturn(opts), system_instruction=opts.system_instruction,
        gen_kwargs=parsed.gen_kwargs, log_samples=True)
