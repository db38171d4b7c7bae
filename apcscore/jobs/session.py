"""One run of score / generate / perplexity from the command line: check everything, load, run, write, summarise.

Order: options (jobs/options.py) -> output location (jobs/preflight.py) -> dataset (io/reader.py) -> the
model's config and tokenizer, and the records checked against them -> weights -> run -> final file. So
every problem the user can fix is reported before the weights load.

A resumed run is one file written by several sessions: its metadata counts them (`sessions`, `resumed`),
its `timings` add up every session that ended normally or by an interrupt (a killed session's are lost),
and the summary describes the whole file, rows of earlier sessions included.

Text from data, paths and exceptions goes through `rich.markup.escape` before Rich prints it.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from apcscore import __version__
from apcscore.errors import ApcscoreError
from apcscore.io.provenance import same_bits
from apcscore.jobs.options import RunOptions
from apcscore.jobs.resolve import resolve_options
from apcscore.jobs.preflight import check_against_model, check_output

# what a resumed run must share with its partial (engine and numerics without the fields that do not change bits)
RESUME_KEYS = ["command", "model", "dtype", "device", "attention_backend", "job", "dataset", "shard", "engine",
               "numerics", "versions"]
# columns too big to read back for the summary of a resumed run (no job's summary reads them)
_HEAVY = {"token_ids", "token_logprobs", "token_ranks", "top_ids", "top_logprobs", "completion_logprobs",
          "completion_ranks", "completion_top_ids", "completion_top_logprobs"}


def same_dataset(old: dict, new: dict) -> bool:
    """One dataset: equal content (sha256), records read and --columns mapping, wherever the path points or
    however it is spelled."""
    return (old.get("sha256") == new.get("sha256") and old.get("num_records") == new.get("num_records")
            and (old.get("columns") or {}) == (new.get("columns") or {}))


RESUME_COMPARE = {"dataset": same_dataset, "engine": same_bits("engine"), "numerics": same_bits("numerics")}


def dataset_metadata(data: Any, opts: RunOptions) -> dict:
    """The metadata's `dataset`: where, its content, the records read and the --columns mapping read with."""
    from apcscore.io.tabular import parse_columns

    return {"path": str(Path(data.path).resolve()), "sha256": data.sha256, "num_records": data.num_records,
            "columns": parse_columns(opts.columns)}


def run_command(command: str, dataset: Path, cli_opts: dict[str, Any], config_path: Path | None,
                console: Console) -> int:
    """Run `command`; return the exit code (0 done, 1 every record failed, 130 interrupted)."""
    from apcscore.io.reader import load_dataset
    from apcscore.io.tabular import parse_columns
    from apcscore.models.locate import check_model_spec

    opts = resolve_options(command, cli_opts, config_path)
    cfg = opts.engine
    cfg.check_logprobs(opts.prompt_logprobs, "--prompt-logprobs")
    cfg.check_logprobs(getattr(opts, "logprobs", None), "--logprobs")
    check_model_spec(opts.model)
    out, note = check_output(opts.out, dataset, command, overwrite=opts.overwrite, resume=opts.resume)
    data = load_dataset(dataset, command, skip_invalid=opts.skip_invalid, limit=opts.limit,
                        columns=parse_columns(opts.columns))
    for warning in data.warnings:
        console.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False)
    if note:
        console.print(f"[yellow]note:[/] {escape(note)}", highlight=False)

    if opts.ray:  # the engines run in Ray replicas (apcscore/scale/); this process writes the file
        from apcscore.scale.ray_run import run_on_ray

        return run_on_ray(command, data, opts, out, console)

    from apcscore.engine.engine import Engine, check_backend_device
    from apcscore.io.writer import ResultsWriter
    from apcscore.jobs.runner import run_job
    from apcscore.models.locate import resolve_model
    from apcscore.models.resolved import resolve_model_parts

    quiet = opts.quiet
    check_backend_device(cfg)
    load_start = time.perf_counter()
    with console.status(f"loading {escape(opts.model)} ...", spinner="dots") if not quiet else _nullcontext():
        files = resolve_model(opts.model)
        parts = resolve_model_parts(files.path)
        data = check_against_model(command, opts, data, int(parts.config.vocab_size), parts.tokenizer)
        with warnings.catch_warnings():  # the probe's warning is printed below, as one line
            warnings.filterwarnings("ignore", message="the start-up probe")
            engine = Engine.from_model(opts.model, cfg, resolved=(files, parts))
    load_seconds = time.perf_counter() - load_start
    for warning in files.warnings if not quiet else ():  # what transformers' GGUF reading left out
        console.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False, soft_wrap=True)
    if getattr(engine, "model_backend", "native") == "transformers" and not quiet:
        from apcscore.engine.hf_engine import NO_CACHE_WARNING

        console.print(f"[yellow]warning:[/] {escape(NO_CACHE_WARNING)}", highlight=False, soft_wrap=True)
    if cfg.batch_invariant and not engine.batch_invariant and getattr(engine, "model_backend", "native") == "native":
        if not quiet:  # (--exact-reuse, which --verify-reuse needs, was refused by the engine)
            console.print(f"[yellow]warning:[/] {escape(engine.numerics['reason'])}: a record's scores may depend on "
                          "what shares its steps (metadata numerics.batch_invariant = false)", highlight=False,
                          soft_wrap=True)
    if engine.info.sliding_window and not quiet:
        console.print(f"[yellow]warning:[/] the model's sliding attention window is not implemented: the context is "
                      f"capped at its {engine.info.sliding_window} tokens (longer prompts are refused or truncated)",
                      highlight=False)
    job = _job_class(command)(engine, opts)
    metadata = run_metadata(command, engine, job, data, cfg, opts)
    writing = dict(overwrite=opts.overwrite, resume=opts.resume, resume_keys=RESUME_KEYS,
                   resume_compare=RESUME_COMPARE)
    if opts.shard:  # one part of the dataset; its file has the extra column record_index
        from apcscore.scale.shard import ShardWriter, select_shard

        data, metadata["shard"], indices = select_shard(lambda: _job_class(command)(engine, opts), data,
                                                        opts.shard, cfg.block_size, opts.partition or "prefix")
        writer: Any = ShardWriter(out, job.output_schema(), metadata, indices, **writing)
    else:
        writer = ResultsWriter(out, job.output_schema(), metadata, num_rows=data.num_records, **writing)
    sessions, previous = start_session(writer, metadata["created"])
    before = _observe_previous(job, writer)
    verifier = None
    if opts.verify_reuse:
        from apcscore.jobs.verify import ReuseVerifier

        verifier = ReuseVerifier(opts.verify_reuse, cfg.seed)
    try:
        result = run_job(job, data, writer, console, show_progress=not quiet and console.is_terminal,
                         verifier=verifier)
    except BaseException:
        writer.abandon()  # a run that failed before its first row leaves no partial to block the next one
        raise
    timings = add_timings(previous.get("timings"), session_timings(engine, load_seconds, result.seconds))
    writer.update_metadata({"timings": timings})
    if result.interrupted:
        console.print(f"[yellow]interrupted:[/] {before[0] + result.num_rows} rows are saved in "
                      f"{escape(str(writer.partial_path))}; continue with the same command plus --resume",
                      highlight=False)
        return 130
    verified = _verify(verifier, engine, writer, None if quiet else console)
    final = writer.close()
    rows, errors = before[0] + result.num_rows, before[1] + result.num_errors
    if not quiet:
        print_summary(console, command, final, rows, errors, sessions, timings, job.summary())
    if verified is not None and verified["mismatches"]:
        from apcscore.jobs.verify import describe

        console.print(f"[bold red]error:[/] --verify-reuse: {len(verified['mismatches'])} of {verified['requests']} "
                      f"re-scored requests differ from full recompute:\n{escape(describe(verified))}",
                      highlight=False, soft_wrap=True)
        return 1
    return exit_code(console, final, rows, errors)


def exit_code(console: Console, final: Path, rows: int, errors: int) -> int:
    """0, or 1 (said on the console) when every record of the finished file failed."""
    if rows and errors == rows:
        console.print(f"[bold red]error:[/] every record failed ({errors} of {rows} rows are errors); see the "
                      f"'error' column of {escape(str(final))}", highlight=False, soft_wrap=True)
        return 1
    return 0


def start_session(writer: Any, created: str) -> tuple[int, dict]:
    """Count this session in the writer's metadata (`sessions`, `resumed`); return (sessions, previous metadata)."""
    previous = writer.previous_metadata or {}
    sessions = int(previous.get("sessions", 1)) + 1 if writer.previous_metadata is not None else 1
    writer.update_metadata({"sessions": sessions, "resumed": sessions > 1, "created": previous.get("created", created)})
    return sessions, previous


def _verify(verifier: Any, engine: Any, writer: Any, console: Console | None) -> dict | None:
    """Run --verify-reuse's recompute of the sample; its report goes into the metadata (`verify_reuse`)."""
    if verifier is None:
        return None
    from apcscore.jobs.verify import describe

    report = verifier.check(engine)
    writer.update_metadata({"verify_reuse": report})
    if console is not None and not report["mismatches"]:
        console.print(f"verify-reuse: {escape(describe(report))}", highlight=False)
    return report


def _observe_previous(job: Any, writer: Any) -> tuple[int, int]:
    """Show the job the rows of earlier sessions (for the summary); return (rows, error rows)."""
    rows = errors = 0
    if writer.previous_metadata is None:
        return rows, errors
    for row in writer.previous_rows([c for c in writer.schema.names if c not in _HEAVY]):
        job.observe(row)
        rows += 1
        errors += row.get("status") == "error"
    return rows, errors


class _nullcontext:
    def __enter__(self) -> "_nullcontext":
        return self

    def __exit__(self, *exc: Any) -> bool:
        return False


def _job_class(command: str) -> type:
    if command == "score":
        from apcscore.jobs.score import ScoreJob

        return ScoreJob
    if command == "generate":
        from apcscore.jobs.generate import GenerateJob

        return GenerateJob
    if command == "perplexity":
        from apcscore.jobs.perplexity import PerplexityJob

        return PerplexityJob
    raise ValueError(command)


def session_timings(engine: Any, load_seconds: float, run_seconds: float) -> dict:
    """This session's timings and engine counters."""
    stats, bm = engine.stats, engine.block_manager
    return {"load_seconds": load_seconds, "run_seconds": run_seconds, "prompt_tokens": stats.prompt_tokens,
            "generated_tokens": stats.generated_tokens, "steps": stats.steps, "preemptions": stats.preemptions,
            "prefix_cache": {"queried_tokens": bm.stats.queried_tokens, "hit_tokens": bm.stats.hit_tokens,
                             "reusable_tokens": bm.stats.reusable_tokens,
                             "score_store_hits": bm.stats.score_store_hits}}


def add_timings(previous: dict | None, now: dict) -> dict:
    """Timings of all sessions: counters and seconds added up, rates recomputed from the sums."""
    total = {k: v for k, v in now.items() if k != "prefix_cache"}
    pc = dict(now["prefix_cache"])
    if isinstance(previous, dict):
        for key in total:
            total[key] += previous.get(key) or 0
        for key in pc:
            pc[key] += (previous.get("prefix_cache") or {}).get(key) or 0
    tokens = total["prompt_tokens"] + total["generated_tokens"]
    total["tokens_per_second"] = round(tokens / total["run_seconds"], 1) if total["run_seconds"] else 0.0
    total["load_seconds"], total["run_seconds"] = round(total["load_seconds"], 3), round(total["run_seconds"], 3)
    pc["hit_rate"] = round(pc["hit_tokens"] / pc["queried_tokens"], 4) if pc["queried_tokens"] else 0.0
    return {**total, "prefix_cache": pc}


def run_metadata(command: str, engine: Any, job: Any, data: Any, cfg: Any, opts: RunOptions) -> dict:
    """The run metadata stored under the parquet key `apcscore` (io/writer.METADATA_KEY)."""
    import torch
    import transformers

    info = engine.info
    tok = engine.tokenizer
    job_meta = job.metadata()
    if command in ("score", "generate"):
        job_meta["truncate"] = opts.truncate
    return {
        "apcscore_version": __version__,
        "command": command,
        "argv": sys.argv,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": {"name": info.name, "path": info.path, "architecture": info.architecture,
                  "fingerprint": info.fingerprint, "vocab_size": info.vocab_size,
                  "max_model_len": info.max_model_len, "num_parameters": info.num_parameters,
                  "context_capped_by_sliding_window": info.sliding_window},
        "tokenizer": {"class": type(tok).__name__, "name_or_path": str(getattr(tok, "name_or_path", "")),
                      "vocab_size": len(tok)},
        "dtype": str(engine.dtype).removeprefix("torch."),
        "device": str(engine.device),
        "attention_backend": engine.attention_backend,
        "model_backend": getattr(engine, "model_backend", "native"),  # native | transformers: the path that ran
        "engine": {**cfg.to_dict(), "num_kv_blocks": engine.block_manager.num_blocks},
        "job": job_meta,
        "dataset": dataset_metadata(data, opts),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "triton": _package_version("triton")},
        # what else the bits of a batch-invariant run depend on (docs/architecture.md, "The contract")
        "numerics": engine.numerics,
    }


def _package_version(name: str) -> str | None:
    """An installed distribution's version without importing it (None when absent)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def print_summary(console: Console, command: str, out: Path, rows: int, errors: int, sessions: int,
                  timings: dict, job_lines: list[tuple[str, str]]) -> None:
    """The end-of-run table: the whole file's rows and figures, every session's timings added up."""
    table = Table(title=f"apcscore {command}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("records", f"{rows:,} written ({rows - errors:,} ok, {errors:,} error)")
    if sessions > 1:
        table.add_row("sessions", f"{sessions} (resumed; figures and timings cover the whole file)")
    for label, value in job_lines:
        table.add_row(escape(label), escape(value))
    pc = timings["prefix_cache"]
    table.add_row("tokens", f"{timings['prompt_tokens']:,} prefilled, {timings['generated_tokens']:,} generated")
    table.add_row("time", f"{timings['run_seconds']:.1f} s run ({timings['tokens_per_second']:,.0f} tok/s), "
                          f"{timings['load_seconds']:.1f} s load")
    reusable = pc.get("reusable_tokens") or 0
    if pc["queried_tokens"]:
        store = pc.get("score_store_hits") or 0
        table.add_row("prefix cache", f"{pc['hit_rate']:.1%} hit ({pc['hit_tokens']:,} of {pc['queried_tokens']:,} "
                                      f"prompt tokens served from the cache)"
                      + (f"; {store:,} scored positions served from the score store" if store else ""))
        if reusable:
            table.add_row("exact reuse", f"--exact-reuse would also have served {reusable:,} prefill tokens of "
                                         f"scored requests from the cache")
    elif reusable:
        table.add_row("prefix cache", f"not read by scoring (full recompute, the default); --exact-reuse would have "
                                      f"served {reusable:,} of the {timings['prompt_tokens']:,} prefill tokens from "
                                      f"the cache, with bitwise the same results")
    else:
        table.add_row("prefix cache", "not read (prompt logprobs need full prefills); blocks written for later requests")
    if timings["preemptions"]:
        table.add_row("preemptions", str(timings["preemptions"]))
    table.add_row("output", escape(str(out)))
    console.print(table)

