"""One run of score / generate / perplexity: check everything, start an executor, write its rows, summarise.

Order: options (options/commands.py) -> output location (run/preflight.py) -> dataset (io/reader.py) -> the
model's config and tokenizer, and the records checked against them -> the executor (the weights load) ->
rows -> final file. So every problem the user can fix is reported before the weights load.

The executor is where records become rows: `run/local.LocalExecutor` (one engine here) or
`run/ray_executor.RayExecutor` (`--ray`: engine replicas; this process writes the file). Everything else is
written once, here: the writer (`--shard`'s included), resume, SIGINT/SIGTERM, progress, `--verify-reuse`,
the summary and the exit code (0 done, 1 every record failed or records not run, 130 interrupted).

A resumed run is one file written by several sessions: its metadata counts them (`sessions`, `resumed`),
its `timings` add up every session that ended normally or by an interrupt (a killed session's are lost),
and the summary describes the whole file, rows of earlier sessions included.
"""

from __future__ import annotations

import sys
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from apcscore.io.identity import resume_check
from apcscore.errors import ApcscoreError, count
from apcscore.io.openai_batch import defaults_note
from apcscore.io.openai_batch_output import LineWriter, created_seconds
from apcscore.io.reader import LoadedDataset, load_dataset
from apcscore.io.tabular_input import parse_columns
from apcscore.io.writer import ResultsWriter
from apcscore.run.executor import Executor
from apcscore.engine.provenance import now
from apcscore.run.metadata import add_timings, dataset_metadata
from apcscore.options.commands import GenerateOptions, RequestOptions, RunOptions
from apcscore.run.preflight import check_against_model, check_errors_out, check_output
from apcscore.run.progress import make_progress
from apcscore.jobs.registry import job_class
from apcscore.options.resolve import resolve_options
from apcscore.run.verify import describe
from apcscore.run.signals import EXIT_INTERRUPTED, Interrupted, stop_on_signals
from apcscore.run.summary import exit_code, print_interrupted, print_summary

# columns too big to read back for the summary of a resumed run (no job's summary reads them)
_HEAVY = {"token_ids", "token_logprobs", "token_ranks", "top_ids", "top_logprobs", "completion_logprobs",
          "completion_ranks", "completion_top_ids", "completion_top_logprobs"}


def run_command(command: str, dataset: Path, cli_opts: dict[str, Any], config_path: Path | None,
                console: Console) -> int:
    """Run `command`; return the exit code."""
    from apcscore.engine.model_files import load_model
    from apcscore.models.locate import check_model_spec

    opts = resolve_options(command, cli_opts, config_path)
    cfg = opts.engine
    cfg.check_logprobs(opts.prompt_logprobs, "--prompt-logprobs")
    if isinstance(opts, GenerateOptions):
        cfg.check_logprobs(opts.logprobs, "--logprobs")
    check_model_spec(opts.model)
    if getattr(opts, "reference_model", None):  # score --reference-model (engine/reference.py)
        check_model_spec(opts.reference_model)
    lines = output_format(opts) == "openai-batch"
    if lines and opts.shard:
        raise ApcscoreError("--shard writes shard files for apcscore merge, which are parquet, so it cannot write "
                            "--output-format openai-batch: run the shards with parquet output (an --out not "
                            "ending in .jsonl) and merge them, or run without --shard")
    out, note = check_output(opts.out, dataset, command, overwrite=opts.overwrite, resume=opts.resume,
                             suffix=".jsonl" if lines else ".parquet", shard=opts.shard)
    requests = opts if isinstance(opts, RequestOptions) else None  # score and generate: OpenAI Batch lines too
    errors_out = requests.errors_out if requests else None
    if errors_out is not None and not lines:
        raise ApcscoreError("--errors-out writes the error lines of an OpenAI Batch result file apart from its "
                            "answers, so it needs --output-format openai-batch (or an --out ending in .jsonl); "
                            "parquet keeps error rows beside the others (status, error)")
    errors_path = check_errors_out(errors_out, out, dataset, overwrite=opts.overwrite) if errors_out else None
    data = load_dataset(dataset, command, skip_invalid=opts.skip_invalid, limit=opts.limit,
                        columns=parse_columns(opts.columns), input_format=requests.input_format if requests else "auto",
                        max_logprobs=cfg.max_logprobs,
                        model_names=None if requests and requests.ignore_body_model else model_names(opts.model))
    if lines and data.format != "openai-batch":
        raise ApcscoreError(f"--output-format openai-batch writes the result lines of OpenAI Batch request lines, and "
                            f"{dataset} holds apcscore records — give a file of request lines, or write parquet "
                            "(an --out not ending in .jsonl)")
    if data.format == "openai-batch":
        opts = batch_options(opts, data)
    for warning in data.warnings:
        console.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False, soft_wrap=True)
    notes = [note, defaults_note(data.records, opts.max_tokens, opts.temperature)
             if data.format == "openai-batch" and command == "generate" else None]
    for text in filter(None, notes):  # the defaults' note: once per run, before the weights load
        console.print(f"[yellow]note:[/] {escape(text)}", highlight=False, soft_wrap=True)
    quiet = opts.quiet
    if opts.ray:
        from apcscore.run.ray_executor import RayExecutor as executor_class
    else:
        from apcscore.engine.devices import check_backend_device
        from apcscore.run.local import LocalExecutor as executor_class

        check_backend_device(cfg)
    with console.status(f"loading {escape(opts.model)} ...", spinner="dots") if not quiet else nullcontext():
        model = load_model(opts.model)
        data = check_against_model(command, opts, data, int(model.config.vocab_size), model.tokenizer)
        executor = executor_class(command, opts, model)
    try:
        for text, soft_wrap in executor.warnings if not quiet else ():
            console.print(f"[yellow]warning:[/] {escape(text)}", highlight=False, soft_wrap=soft_wrap)
        return _drive(executor, command, opts, data, out, console, lines, errors_path)
    finally:
        executor.close()


def _drive(executor: Executor, command: str, opts: RunOptions, data: LoadedDataset, out: Path,
           console: Console, lines: bool = False, errors_path: Path | None = None) -> int:
    """Write the executor's rows of `data` to `out` (`lines`: as OpenAI Batch result lines, the error lines to
    `errors_path` when given); the exit code."""
    job = job_class(command)(executor.tokenizer, executor.max_model_len, opts)
    metadata = dict(executor.metadata(job), argv=sys.argv, created=now(), dataset=dataset_metadata(data, opts))
    writer, data = _open_writer(job, data, out, metadata, opts)
    for note in writer.notes:
        console.print(f"[yellow]note:[/] {escape(note)}", highlight=False, soft_wrap=True)
    try:
        return _drive_open(executor, command, opts, job, data, writer, metadata, console, lines, errors_path)
    finally:
        writer.release()  # the partial's lock: whatever happened, this run no longer writes it


def _drive_open(executor: Executor, command: str, opts: RunOptions, job: Any, data: LoadedDataset, writer: Any,
                metadata: dict, console: Console, lines: bool, errors_path: Path | None) -> int:
    """`_drive` once the writer holds the partial."""
    sessions, previous = start_session(writer, metadata["created"])
    if lines:
        writer.lines = LineWriter(executor.tokenizer, opts.model, created_seconds(previous.get("created",
                                                                                                metadata["created"])),
                                  {r.index: r.fields for r in data.records}, {r.index for r in data.invalid},
                                  data.no_custom_id).line
        writer.errors_path = errors_path
    before = observe_previous(job, writer)
    started = time.perf_counter()

    def keep_timings() -> None:  # before each part reaches the partial, so that a session killed outright counts
        if (so_far := executor.snapshot(time.perf_counter() - started)) is not None:
            writer.update_metadata({"timings": add_timings(previous.get("timings"), so_far)})

    writer.before_flush(keep_timings)
    quiet = opts.quiet
    rows, errors, seconds, interrupted = _write_rows(executor, job, data, writer, console, quiet)
    this_session, extra = executor.finish(interrupted, seconds)
    timings = add_timings(previous.get("timings"), this_session)
    writer.update_metadata({"timings": timings, **extra})
    rows, errors = before[0] + rows, before[1] + errors
    if (failure := executor.failure()) is not None:
        writer.flush()
        saved = f"{count(rows, 'row')} {'is' if rows == 1 else 'are'} saved in"
        console.print(f"[bold red]error:[/] {escape(failure)}\n{saved} "
                      f"{escape(str(writer.partial_path))}; fix the cause (e.g. memory) and rerun the same command "
                      "plus --resume", highlight=False, soft_wrap=True)
        return 1
    if interrupted:
        print_interrupted(console, rows, writer.partial_path)
        return EXIT_INTERRUPTED
    verified = executor.verify()
    if verified is not None:
        writer.update_metadata({"verify_reuse": verified})
        if not quiet and not verified["mismatches"]:
            console.print(f"verify-reuse: {escape(describe(verified))}", highlight=False, soft_wrap=True)
    final = writer.close()
    if not quiet:
        print_summary(console, command, final, rows, errors, sessions, timings, job.summary())
        if errors_path is not None:
            console.print(f"error lines: {errors:,} in {escape(str(errors_path))}", highlight=False, soft_wrap=True)
        if (line := executor.closing_line()) is not None:
            console.print(line, highlight=False, soft_wrap=True)
    if verified is not None and verified["mismatches"]:
        console.print(f"[bold red]error:[/] --verify-reuse: {len(verified['mismatches'])} of {verified['requests']} "
                      f"re-scored requests differ from full recompute:\n{escape(describe(verified))}",
                      highlight=False, soft_wrap=True)
        return 1
    return exit_code(console, errors_path or final, rows, errors)


def _open_writer(job: Any, data: LoadedDataset, out: Path, metadata: dict,
                 opts: RunOptions) -> tuple[Any, LoadedDataset]:
    """The results writer and the records it takes: with --shard a ShardWriter and this shard's records (its
    file has the extra column record_index), else a ResultsWriter and every record."""
    writing = dict(overwrite=opts.overwrite, resume=opts.resume, resume_check=resume_check)
    schema = job.output_schema()
    if not opts.shard:
        return ResultsWriter(out, schema, metadata, num_rows=data.num_records, **writing), data
    from apcscore.scale.shard import ShardWriter, select_shard

    data, metadata["shard"], indices = select_shard(job, data, opts.shard, opts.engine.block_size,
                                                    opts.partition or "prefix")
    return ShardWriter(out, schema, metadata, indices, **writing), data


def output_format(opts: RunOptions) -> str:
    """parquet or openai-batch: --output-format, else openai-batch for an --out ending in .jsonl."""
    chosen = opts.output_format if isinstance(opts, RequestOptions) else None
    if chosen is not None:
        return chosen
    return "openai-batch" if opts.out is not None and opts.out.lower().endswith(".jsonl") else "parquet"


def model_names(spec: str) -> frozenset[str]:
    """The names an OpenAI Batch body's `model` may give for --model `spec`: the spec as written, its file or
    folder name (a .gguf's without the suffix), and for an alias its Hugging Face name and that name's last part."""
    from apcscore.models.locate import MODEL_ALIASES

    path = Path(spec.rstrip("/"))
    names = {spec, path.name, path.stem if path.suffix == ".gguf" else path.name}
    if spec in MODEL_ALIASES:
        hf = MODEL_ALIASES[spec].hf_name
        names |= {hf, hf.split("/")[-1]}
    return frozenset(n for n in names if n)


def batch_options(opts: RunOptions, data: LoadedDataset) -> RunOptions:
    """The options of a run of OpenAI Batch request lines: each body says which logprobs it wants, so
    generate's --logprobs / --prompt-logprobs are refused, and set to the largest a body asks for (the
    columns exist; each request computes its own)."""
    if not isinstance(opts, GenerateOptions):
        return opts
    for value, flag in ((opts.logprobs, "--logprobs"), (opts.prompt_logprobs, "--prompt-logprobs")):
        if value is not None:
            raise ApcscoreError(f"{flag} does not apply to OpenAI Batch request lines: each request's body says "
                                "which logprobs it wants (chat: logprobs and top_logprobs; completions: logprobs, "
                                "with echo the prompt's too; prompt_logprobs) — drop it")
    asked = {key: [r.fields["openai"][key] for r in data.records if r.fields["openai"][key] is not None]
             for key in ("logprobs", "prompt_logprobs")}
    return replace(opts, **{key: max(ks) if ks else None for key, ks in asked.items()})


def start_session(writer: Any, created: str) -> tuple[int, dict]:
    """Count this session in the writer's metadata (`sessions`, `resumed`); return (sessions, previous metadata)."""
    previous = writer.previous_metadata or {}
    sessions = int(previous.get("sessions", 1)) + 1 if writer.previous_metadata is not None else 1
    writer.update_metadata({"sessions": sessions, "resumed": sessions > 1, "created": previous.get("created", created)})
    return sessions, previous


def observe_previous(job: Any, writer: Any) -> tuple[int, int]:
    """Show the job the rows of earlier sessions (for the summary); return (rows, error rows)."""
    rows = errors = 0
    if writer.previous_metadata is None:
        return rows, errors
    for row in writer.previous_rows([c for c in writer.schema.names if c not in _HEAVY]):
        job.observe(row)
        rows += 1
        errors += row.get("status") == "error"
    return rows, errors


def _write_rows(executor: Executor, job: Any, data: LoadedDataset, writer: Any, console: Console,
                quiet: bool) -> tuple[int, int, float, bool]:
    """Invalid records' error rows, then the executor's rows of the records not done yet, into the writer;
    (rows, error rows, seconds, interrupted). SIGINT/SIGTERM stop it after the current engine step (or the
    chunks in hand); whatever went wrong, every finished row is flushed to the partial file."""
    done = set(writer.done_indices)
    todo = [r for r in data.records if r.index not in done]
    invalid = [r for r in data.invalid if r.index not in done]
    counts = {"rows": 0, "errors": 0}
    progress = make_progress(console, quiet)  # a bar with an ETA, or plain lines in a log (run/progress.py)
    task = progress.add_task(job.command, total=len(todo) + len(invalid), tok_s=0.0, hit=0.0, kv="0/0")

    def emit(index: int, row: dict) -> None:
        writer.add(index, row)
        job.observe(row)
        counts["rows"] += 1
        counts["errors"] += row.get("status") == "error"
        progress.update(task, advance=1)

    def tick() -> None:
        writer.flush_if_due()  # finished rows reach disk within max_buffer_seconds, even in a long generation
        progress.update(task, **executor.progress())
        stop.check()

    started = time.perf_counter()
    interrupted = False
    with stop_on_signals() as stop:  # held until every finished row is flushed
        try:
            with progress:
                for rec in invalid:  # invalid records need no engine
                    emit(rec.index, job.finish_row(job.error_row(rec.id, rec.message)))
                for index, row in executor.rows(job, data, todo, tick):
                    emit(index, row)
        except Interrupted:
            interrupted = True
            writer.flush()
        except BaseException:
            writer.flush()  # keep every finished row, whatever went wrong
            writer.abandon()  # a run that failed before its first row leaves no partial to block the next one
            raise
    return counts["rows"], counts["errors"], time.perf_counter() - started, interrupted
