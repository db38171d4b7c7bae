"""One run of score / generate / perplexity: everything checked before the weights load, then an engine (local, or
`--ray`'s run/ray_engine.RayEngine), the job's rows through it and the summary (the order and who owns what:
docs/architecture.md, "A run"). A resumed run's metadata counts its `sessions`, and its `timings` add up every
session that ended normally or by an interrupt."""

from __future__ import annotations

import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from apcscore.config import EngineConfig
from apcscore.engine.interface import BatchEngine
from apcscore.models.loaded import LoadedModel
from apcscore.engine.provenance import now
from apcscore.errors import ApcscoreError, count
from apcscore.io.openai_batch import defaults_note
from apcscore.io.openai_batch_output import LineWriter, created_seconds
from apcscore.io.reader import LoadedDataset, load_dataset
from apcscore.io.tabular_input import parse_columns
from apcscore.io.writer import ResultsWriter
from apcscore.jobs.registry import job_class
from apcscore.options.commands import GenerateOptions, RequestOptions, RunOptions
from apcscore.options.resolve import resolve_options
from apcscore.run.metadata import add_timings, dataset_metadata, run_metadata
from apcscore.run.preflight import check_against_model, check_errors_out, check_output
from apcscore.run.runner import write_rows
from apcscore.run.signals import EXIT_INTERRUPTED
from apcscore.run.summary import exit_code, print_interrupted, print_summary
from apcscore.run.verify import ReuseVerifier, describe

# columns too big to read back for the summary of a resumed run (no job's summary reads them)
_HEAVY = {"token_ids", "token_logprobs", "token_ranks", "top_ids", "top_logprobs", "completion_logprobs",
          "completion_ranks", "completion_top_ids", "completion_top_logprobs"}


def run_command(command: str, dataset: Path, cli_opts: dict[str, Any], config_path: Path | None,
                console: Console) -> int:
    """Run `command`; return the exit code."""
    from apcscore.models.loaded import load_model

    opts, data, out, lines, errors_path = prepare(command, dataset, cli_opts, config_path, console)
    quiet = opts.quiet
    with console.status(f"loading {escape(opts.model)} ...", spinner="dots") if not quiet else nullcontext():
        model = load_model(opts.model)
        data = check_against_model(command, opts, data, int(model.config.vocab_size), model.tokenizer)
        started = time.perf_counter()
        engine = open_engine(command, opts, model)
        load_seconds = time.perf_counter() - started
    try:
        for text, soft_wrap in engine_warnings(engine, opts.engine, model) if not quiet else ():
            console.print(f"[yellow]warning:[/] {escape(text)}", highlight=False, soft_wrap=soft_wrap)
        job = job_class(command)(engine.tokenizer, engine.info.max_model_len, opts)
        metadata = dict(run_metadata(command, engine, job, opts), argv=sys.argv, created=now(),
                        dataset=dataset_metadata(data, opts))
        writer, data = _open_writer(job, data, out, metadata, opts)
        try:
            sessions, previous = start_session(writer, metadata["created"], console)
            if lines:
                writer.lines = LineWriter(engine.tokenizer, opts.model,
                                          created_seconds(previous.get("created", metadata["created"])),
                                          {r.index: r.fields for r in data.records}, {r.index for r in data.invalid},
                                          data.no_custom_id).line
                writer.errors_path = errors_path
            before = observe_previous(job, writer)
            verifier = ReuseVerifier(opts.verify_reuse, opts.engine.seed) if opts.verify_reuse else None
            started = time.perf_counter()

            def timings() -> dict:  # of every session so far; kept before each part reaches the partial too
                so_far = engine.counters().to_timings(load_seconds, time.perf_counter() - started)
                return add_timings(previous.get("timings"), so_far)

            writer.before_flush(lambda: writer.update_metadata({"timings": timings()}))
            rows, errors, interrupted, not_run = write_rows(job, engine, data, writer, console, quiet, verifier)
            total = timings()
            writer.before_flush(None)  # the session's timings are these (--verify-reuse's recompute is not its run)
            writer.update_metadata({"timings": total, **({"ray": engine.section()} if opts.ray else {})})
            return finish(console, command, opts, engine, job, writer, (before[0] + rows, before[1] + errors, sessions),
                          total, interrupted, not_run, verifier, errors_path)
        finally:
            writer.release()  # the partial's lock: whatever happened, this run no longer writes it
    finally:
        if opts.ray:
            engine.close()


def prepare(command: str, dataset: Path, cli_opts: dict[str, Any], config_path: Path | None,
            console: Console) -> tuple[RunOptions, LoadedDataset, Path, bool, Path | None]:
    """Everything checked before the model loads: (options, dataset, output path, whether it is OpenAI Batch
    lines, the error lines' path)."""
    from apcscore.models.locate import check_model_spec

    opts = resolve_options(command, cli_opts, config_path)
    cfg = opts.engine
    check_model_spec(opts.model)
    if getattr(opts, "reference_model", None):  # score --reference-model (engine/reference.py)
        check_model_spec(opts.reference_model)
        if opts.ray:
            raise ApcscoreError("--reference-model runs both models in one engine, which --ray's replicas do not "
                                "host yet: run without --ray (or split the dataset with --shard I/N and merge)")
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
    if not opts.ray:
        from apcscore.engine.devices import check_backend_device

        check_backend_device(cfg)
    return opts, data, out, lines, errors_path


def open_engine(command: str, opts: RunOptions, model: LoadedModel) -> BatchEngine:
    """The engine the run goes through: one here (engine/loader.load_engine), or with --ray replicas
    (run/ray_engine.RayEngine: close it)."""
    if opts.ray:
        from apcscore.run.ray_engine import RayEngine

        return RayEngine(command, opts, model)
    from apcscore.engine.loader import load_engine

    with warnings.catch_warnings():  # the probe's warning is printed by the driver, as one line (engine_warnings)
        warnings.filterwarnings("ignore", message="the start-up probe")
        return load_engine(model, opts.engine, reference=getattr(opts, "reference_model", None))


def engine_warnings(engine: BatchEngine, cfg: EngineConfig, model: LoadedModel) -> list[tuple[str, bool]]:
    """(text, soft_wrap) lines printed once the engine is loaded: what it does not do as asked."""
    from apcscore.engine.hf_engine import NO_CACHE_WARNING

    native = engine.model_backend == "native"
    found = [(w, True) for w in model.warnings]  # GGUF reading left out
    if not native:
        found.append((NO_CACHE_WARNING, True))
    if cfg.batch_invariant and not engine.batch_invariant and native:
        # (--exact-reuse, which --verify-reuse needs, was refused by the engine)
        found.append((f"{engine.numerics['reason']}: a record's scores may depend on what shares its steps "
                      "(metadata numerics.batch_invariant = false)", True))
    length, window = engine.info.max_model_len, engine.info.sliding_window
    if cfg.max_model_len and cfg.max_model_len > length and not window:
        found.append((f"--max-model-len {cfg.max_model_len} is above the model's context length: the context stays "
                      f"{length} tokens (longer prompts are refused or truncated)", False))
    if window:
        found.append((f"the model's sliding attention window is not implemented: the context is capped at its "
                      f"{window} tokens (longer prompts are refused or truncated)", False))
    return found


def finish(console: Console, command: str, opts: RunOptions, engine: Any, job: Any, writer: Any,
           counts: tuple[int, int, int], timings: dict, interrupted: bool, not_run: list[tuple[str, str]],
           verifier: ReuseVerifier | None, errors_path: Path | None) -> int:
    """After the rows (counts: rows and error rows of every session, and the sessions): the records not run, the
    interrupt, --verify-reuse, the final file and the summary; the exit code."""
    rows, errors, sessions = counts
    if not_run:
        writer.flush()
        whys: dict[str, list[str]] = {}
        for rid, why in not_run:
            whys.setdefault(why, []).append(rid)
        lines = [f"{why}: {count(len(ids), 'record')} ({', '.join(ids[:10])}"
                 f"{f' and {len(ids) - 10} more' if len(ids) > 10 else ''})" for why, ids in whys.items()]
        console.print(f"[bold red]error:[/] {escape(f'{len(not_run)} records were not run:')}\n"
                      f"{escape(chr(10).join(lines))}\n{count(rows, 'row')} {'is' if rows == 1 else 'are'} saved in "
                      f"{escape(str(writer.partial_path))}; fix the cause (e.g. memory) and rerun the same command "
                      "plus --resume", highlight=False, soft_wrap=True)
        return 1
    if interrupted:
        print_interrupted(console, rows, writer.partial_path)
        return EXIT_INTERRUPTED
    verified = verifier.check(engine) if verifier is not None else None
    if verified is not None:
        writer.update_metadata({"verify_reuse": verified})
        if not opts.quiet and not verified["mismatches"]:
            console.print(f"verify-reuse: {escape(describe(verified))}", highlight=False, soft_wrap=True)
    final = writer.close()
    if not opts.quiet:
        print_summary(console, command, final, rows, errors, sessions, timings, job.summary())
        if errors_path is not None:
            console.print(f"error lines: {errors:,} in {escape(str(errors_path))}", highlight=False, soft_wrap=True)
        if opts.ray:
            console.print(f"ray: {len(engine.assigned)} replicas; records per replica {engine.assigned}",
                          highlight=False, soft_wrap=True)
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
    writing = dict(overwrite=opts.overwrite, resume=opts.resume)
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
    return chosen or ("openai-batch" if opts.out is not None and opts.out.lower().endswith(".jsonl") else "parquet")


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
    """The options of a run of OpenAI Batch request lines: each body says which logprobs it wants, so generate's
    --logprobs / --prompt-logprobs are refused and set to the largest a body asks for."""
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


def start_session(writer: Any, created: str, console: Console) -> tuple[int, dict]:
    """Print the writer's notes, count this session in its metadata (`sessions`, `resumed`); return (sessions,
    previous metadata)."""
    for note in writer.notes:
        console.print(f"[yellow]note:[/] {escape(note)}", highlight=False, soft_wrap=True)
    previous = writer.previous_metadata or {}
    sessions = int(previous.get("sessions", 1)) + 1 if writer.previous_metadata is not None else 1
    writer.update_metadata({"sessions": sessions, "resumed": sessions > 1, "created": previous.get("created", created)})
    return sessions, previous


def observe_previous(job: Any, writer: Any) -> tuple[int, int]:
    """Show the job the rows of earlier sessions (none in a fresh run; for the summary); return (rows, error rows)."""
    rows = errors = 0
    for row in writer.previous_rows([c for c in writer.schema.names if c not in _HEAVY]):
        job.observe(row)
        rows += 1
        errors += row.get("status") == "error"
    return rows, errors
