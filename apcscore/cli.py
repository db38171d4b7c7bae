"""The `apcscore` command line: thin Typer commands over jobs and the engine.

Option precedence: command line > `--config FILE` (TOML, keys named like the options with underscores)
> built-in defaults. Every user-facing problem is an ApcscoreError, shown as one clear message.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from apcscore import __version__
from apcscore.compare.command import compare
from apcscore.config import EngineConfig
from apcscore.errors import ApcscoreError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

app = typer.Typer(help="Batch scoring and evaluation of causal language models (paged KV cache, prefix caching).",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
console = Console(stderr=True)
out_console = Console()

DEFAULTS: dict[str, Any] = {
    "model": "smollm2-135m", "out": None, "overwrite": False, "resume": False, "limit": None,
    "skip_invalid": False, "quiet": False, "prompt_logprobs": None, "logprobs": None,
    "max_tokens": 16, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": None,
    "window": None, "stride": None, "truncate": None,
    **{k: v for k, v in EngineConfig().to_dict().items()},
}
ENGINE_KEYS = set(EngineConfig().to_dict())

# ---- shared option types ------------------------------------------------------------------------
DatasetArg = Annotated[Path, typer.Argument(help="JSONL dataset, one record per line.")]
ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="Model alias (smollm2-135m), Hugging Face model directory, or .gguf file. \\[default: smollm2-135m]")]
OutOpt = Annotated[Optional[Path], typer.Option("--out", "-o", help="Output parquet file. \\[default: results/<dataset>.<command>.parquet]")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace an existing output file.")]
ResumeOpt = Annotated[bool, typer.Option("--resume", help="Continue an interrupted run from <out>.partial.")]
LimitOpt = Annotated[Optional[int], typer.Option("--limit", help="Only the first N records.", min=1)]
ConfigOpt = Annotated[Optional[Path], typer.Option("--config", help="TOML file of option values (see configs/).")]
SkipInvalidOpt = Annotated[bool, typer.Option("--skip-invalid", help="Turn invalid records into error rows instead of refusing the dataset.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar or summary.")]
DeviceOpt = Annotated[Optional[str], typer.Option("--device", help="auto | cpu | cuda (auto = cuda if available). \\[default: auto]")]
DtypeOpt = Annotated[Optional[str], typer.Option("--dtype", help="auto | float32 | bfloat16 | float16 (auto = float32 on CPU, bfloat16 on CUDA). \\[default: auto]")]
BlockSizeOpt = Annotated[Optional[int], typer.Option("--block-size", help="Tokens per KV block. \\[default: 16]")]
NumKvBlocksOpt = Annotated[Optional[int], typer.Option("--num-kv-blocks", help="KV pool size in blocks. \\[default: from free memory]")]
MaxBatchTokensOpt = Annotated[Optional[int], typer.Option("--max-batch-tokens", help="Token budget of one engine step. \\[default: 2048]")]
MaxNumSeqsOpt = Annotated[Optional[int], typer.Option("--max-num-seqs", help="Sequences running at once. \\[default: 64]")]
NoPrefixCachingOpt = Annotated[bool, typer.Option("--no-prefix-caching", help="Turn automatic prefix caching off.")]
NoBatchInvariantOpt = Annotated[bool, typer.Option("--no-batch-invariant", help="Library GEMMs instead of batch-invariant ones: faster, but a record's last bits may then depend on what shares its steps.")]
MaxLogprobsOpt = Annotated[Optional[int], typer.Option("--max-logprobs", help="Cap on --prompt-logprobs / --logprobs. \\[default: 20]")]
BackendOpt = Annotated[Optional[str], typer.Option("--attention-backend", help="auto | torch | triton (auto = triton on CUDA). \\[default: auto]")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Sampling seed (per record unless the record sets its own).")]
TruncateOpt = Annotated[Optional[str], typer.Option("--truncate", help="left: drop a too-long prompt's oldest tokens (counted in num_truncated_tokens) instead of an error row.")]
MaxModelLenOpt = Annotated[Optional[int], typer.Option("--max-model-len", help="Cap on the context length in tokens. \\[default: the model's]")]
LogprobsChunkOpt = Annotated[Optional[int], typer.Option("--logprobs-chunk-size", help="Rows of the vocabulary projection computed at once. \\[default: 1024]")]
KvFractionOpt = Annotated[Optional[float], typer.Option("--kv-cache-memory-fraction", help="Share of memory for the KV pool when --num-kv-blocks is not given (CPU: of free host memory, at most 4 GiB; CUDA: of the GPU's total, after weights and the largest step). \\[default: 0.25 CPU, 0.85 CUDA]")]
NoCudaGraphsOpt = Annotated[bool, typer.Option("--no-cuda-graphs", help="Run decode steps on CUDA eagerly instead of replaying captured CUDA graphs.")]
PromptLogprobsOpt = Annotated[Optional[int], typer.Option("--prompt-logprobs", help="Top-K alternatives per prompt token (0 = the token's own logprob and rank only).")]


def _error(exc: ApcscoreError) -> typer.Exit:
    console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
    return typer.Exit(exc.exit_code)


def resolve_options(cli: dict[str, Any], config_path: Path | None) -> dict[str, Any]:
    """Merge command line (non-None values) over the config file over DEFAULTS."""
    from_file: dict[str, Any] = {}
    if config_path is not None:
        try:
            from_file = tomllib.loads(Path(config_path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ApcscoreError(f"{config_path}: config file not found")
        except tomllib.TOMLDecodeError as exc:
            raise ApcscoreError(f"{config_path}: not valid TOML: {exc}")
        unknown = sorted(set(from_file) - set(DEFAULTS))
        if unknown:
            raise ApcscoreError(f"{config_path}: unknown option(s) {', '.join(unknown)}; "
                                f"known: {', '.join(sorted(DEFAULTS))}")
    merged = dict(DEFAULTS)
    merged.update(from_file)
    # None (and False for on/off flags) means "not given on the command line"
    merged.update({k: v for k, v in cli.items() if v is not None and v is not False and v != []})
    return merged


def engine_config(opts: dict[str, Any]) -> EngineConfig:
    return EngineConfig(**{k: opts[k] for k in ENGINE_KEYS})


def default_out(dataset: Path, command: str) -> Path:
    return Path("results") / f"{dataset.stem}.{command}.parquet"


def run_command(command: str, dataset: Path, cli_opts: dict[str, Any], config_path: Path | None) -> None:
    """Shared flow of score / generate / perplexity: validate everything, load, run, write, summarise."""
    from apcscore.io.reader import load_dataset
    from apcscore.models.locate import check_model_spec

    opts = resolve_options(cli_opts, config_path)
    if command == "score" and opts["prompt_logprobs"] is None:
        opts["prompt_logprobs"] = 0  # score always scores: own logprob and rank
    if opts.pop("no_prefix_caching", None):
        opts["enable_prefix_caching"] = False
    if opts.pop("no_cuda_graphs", None):
        opts["use_cuda_graphs"] = False
    if opts.pop("no_batch_invariant", None):
        opts["batch_invariant"] = False
    cfg = engine_config(opts)
    if opts.get("truncate") not in (None, "left"):
        raise ApcscoreError(f"--truncate must be 'left' (drop a too-long prompt's oldest tokens), not {opts['truncate']!r}")
    cfg.check_logprobs(opts.get("prompt_logprobs"), "--prompt-logprobs")
    cfg.check_logprobs(opts.get("logprobs"), "--logprobs")
    check_model_spec(opts["model"])
    out = Path(opts["out"] or default_out(dataset, command))
    if out.exists() and not (opts["overwrite"] or opts["resume"]):  # fail before the model loads
        raise ApcscoreError(f"{out} exists; pass --overwrite to replace it, or choose another --out")
    data = load_dataset(dataset, command, skip_invalid=opts["skip_invalid"], limit=opts["limit"])
    for warning in data.warnings:
        console.print(f"[yellow]warning:[/] {warning}", highlight=False)

    from apcscore.engine.engine import Engine
    from apcscore.io.writer import ResultsWriter
    from apcscore.jobs.runner import run_job

    quiet = opts["quiet"]
    load_start = time.perf_counter()
    with console.status(f"loading {opts['model']} ...", spinner="dots") if not quiet else _nullcontext():
        engine = Engine.from_model(opts["model"], cfg)
    load_seconds = time.perf_counter() - load_start
    if engine.info.sliding_window:
        console.print(f"[yellow]warning:[/] the model's sliding attention window is not implemented: the context is "
                      f"capped at its {engine.info.sliding_window} tokens (longer prompts are refused or truncated)", highlight=False)
    job = _job_class(command)(engine, opts)
    metadata = run_metadata(command, engine, job, data, cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = ResultsWriter(out, job.output_schema(), metadata, overwrite=opts["overwrite"], resume=opts["resume"],
                           resume_keys=["command", "model", "dtype", "job", "dataset"],
                           num_rows=len(data.records) + len(data.invalid))
    result = run_job(job, data, writer, console, show_progress=not quiet and console.is_terminal)
    stats = engine.stats
    bm = engine.block_manager
    timings = {
        "load_seconds": round(load_seconds, 3), "run_seconds": round(result.seconds, 3),
        "prompt_tokens": stats.prompt_tokens, "generated_tokens": stats.generated_tokens,
        "tokens_per_second": round(stats.tokens_per_second, 1), "steps": stats.steps,
        "preemptions": stats.preemptions,
        "prefix_cache": {"queried_tokens": bm.stats.queried_tokens, "hit_tokens": bm.stats.hit_tokens,
                         "hit_rate": round(bm.stats.hit_rate, 4)},
    }
    if result.interrupted:
        console.print(f"[yellow]interrupted:[/] {result.num_rows} rows are saved in {out}.partial; "
                      f"continue with the same command plus --resume", highlight=False)
        raise typer.Exit(130)
    writer.update_metadata({"timings": timings})
    final = writer.close()
    if not quiet:
        _print_summary(command, final, data, result, timings, job.summary())


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _job_class(command: str):
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


def run_metadata(command: str, engine: Any, job: Any, data: Any, cfg: EngineConfig) -> dict:
    """The run metadata stored under the parquet key `apcscore` (io/writer.METADATA_KEY)."""
    import torch
    import transformers

    info = engine.info
    tok = engine.tokenizer
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
        "engine": {**cfg.to_dict(), "num_kv_blocks": engine.block_manager.num_blocks},
        "job": job.metadata(),
        "dataset": {"path": str(data.path), "sha256": data.sha256,
                    "num_records": len(data.records) + len(data.invalid)},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "triton": _package_version("triton")},
        # what else the bits of a batch-invariant run depend on (docs/architecture.md, "The contract")
        "numerics": {"batch_invariant": cfg.batch_invariant, "torch_threads": torch.get_num_threads(),
                     "cpu_capability": torch.backends.cpu.get_cpu_capability()},
    }


def _package_version(name: str) -> str | None:
    """An installed distribution's version without importing it (None when absent)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _print_summary(command: str, out: Path, data: Any, result: Any, timings: dict,
                   job_lines: list[tuple[str, str]]) -> None:
    table = Table(title=f"apcscore {command}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    ok = result.num_rows - result.num_errors
    table.add_row("records", f"{result.num_rows:,} written ({ok:,} ok, {result.num_errors:,} error)")
    for label, value in job_lines:
        table.add_row(label, value)
    pc = timings["prefix_cache"]
    table.add_row("tokens", f"{timings['prompt_tokens']:,} prefilled, {timings['generated_tokens']:,} generated")
    table.add_row("time", f"{timings['run_seconds']:.1f} s run ({timings['tokens_per_second']:,.0f} tok/s), "
                          f"{timings['load_seconds']:.1f} s load")
    if pc["queried_tokens"]:
        table.add_row("prefix cache", f"{pc['hit_rate']:.1%} hit ({pc['hit_tokens']:,} of {pc['queried_tokens']:,} "
                                      f"prompt tokens served from the cache)")
    else:
        table.add_row("prefix cache", "not read (prompt logprobs need full prefills); blocks written for later requests")
    if timings["preemptions"]:
        table.add_row("preemptions", str(timings["preemptions"]))
    table.add_row("output", str(out))
    console.print(table)


# ---- commands -----------------------------------------------------------------------------------
def _run(command: str, params: dict[str, Any]) -> None:
    """Run a command from its parameters (`locals()` of the command function); ApcscoreError -> clear exit."""
    options = {k: v for k, v in params.items() if k not in ("dataset", "config")}
    try:
        run_command(command, params["dataset"], options, params["config"])
    except ApcscoreError as exc:
        raise _error(exc)


@app.command()
def score(
    dataset: DatasetArg,
    prompt_logprobs: PromptLogprobsOpt = None,
    truncate: TruncateOpt = None,
    model: ModelOpt = None, out: OutOpt = None, overwrite: OverwriteOpt = False, resume: ResumeOpt = False,
    limit: LimitOpt = None, config: ConfigOpt = None, skip_invalid: SkipInvalidOpt = False, quiet: QuietOpt = False,
    device: DeviceOpt = None, dtype: DtypeOpt = None, block_size: BlockSizeOpt = None,
    num_kv_blocks: NumKvBlocksOpt = None, max_batch_tokens: MaxBatchTokensOpt = None,
    max_num_seqs: MaxNumSeqsOpt = None, no_prefix_caching: NoPrefixCachingOpt = False,
    max_logprobs: MaxLogprobsOpt = None, attention_backend: BackendOpt = None,
    max_model_len: MaxModelLenOpt = None, logprobs_chunk_size: LogprobsChunkOpt = None,
    kv_cache_memory_fraction: KvFractionOpt = None, no_cuda_graphs: NoCudaGraphsOpt = False,
    no_batch_invariant: NoBatchInvariantOpt = False,
) -> None:
    """Per-token prompt logprobs (own logprob, rank, top-K) and per-record NLL / perplexity; loglikelihoods.

    Records: {"id"?, "prompt": str}, {"id"?, "prompt_token_ids": \\[int, ...]},
    {"id"?, "context": str, "continuation": str} (loglikelihood, is_greedy), or
    {"id"?, "context": str, "choices": \\[str, ...], "answer": int} (multiple choice: pred, correct).
    """
    _run("score", locals())


@app.command()
def generate(
    dataset: DatasetArg,
    max_tokens: Annotated[Optional[int], typer.Option("--max-tokens", help="Most tokens to generate. \\[default: 16]")] = None,
    temperature: Annotated[Optional[float], typer.Option("--temperature", help="0 = greedy. \\[default: 0]")] = None,
    top_p: Annotated[Optional[float], typer.Option("--top-p", help="Nucleus sampling mass. \\[default: 1]")] = None,
    top_k: Annotated[Optional[int], typer.Option("--top-k", help="Sample among the K most likely (0 = off). \\[default: 0]")] = None,
    seed: SeedOpt = None,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop string (repeatable); not included in the completion.")] = None,
    logprobs: Annotated[Optional[int], typer.Option("--logprobs", help="Logprobs of the sampled tokens with top-K alternatives.")] = None,
    prompt_logprobs: PromptLogprobsOpt = None,
    truncate: TruncateOpt = None,
    model: ModelOpt = None, out: OutOpt = None, overwrite: OverwriteOpt = False, resume: ResumeOpt = False,
    limit: LimitOpt = None, config: ConfigOpt = None, skip_invalid: SkipInvalidOpt = False, quiet: QuietOpt = False,
    device: DeviceOpt = None, dtype: DtypeOpt = None, block_size: BlockSizeOpt = None,
    num_kv_blocks: NumKvBlocksOpt = None, max_batch_tokens: MaxBatchTokensOpt = None,
    max_num_seqs: MaxNumSeqsOpt = None, no_prefix_caching: NoPrefixCachingOpt = False,
    max_logprobs: MaxLogprobsOpt = None, attention_backend: BackendOpt = None,
    max_model_len: MaxModelLenOpt = None, logprobs_chunk_size: LogprobsChunkOpt = None,
    kv_cache_memory_fraction: KvFractionOpt = None, no_cuda_graphs: NoCudaGraphsOpt = False,
    no_batch_invariant: NoBatchInvariantOpt = False,
) -> None:
    """Completions with sampling options; prompts sharing a prefix reuse its cached KV.

    Records: {"id"?, "prompt": str}, {"id"?, "prompt_token_ids": \\[int, ...]} or
    {"id"?, "messages": \\[{"role", "content"}, ...]} (chat template with generation prompt), optionally with per-record max_tokens, temperature, top_p, top_k, seed, stop.
    """
    _run("generate", locals())


@app.command()
def perplexity(
    dataset: DatasetArg,
    window: Annotated[Optional[int], typer.Option("--window", min=1, help="Tokens of context a window feeds the model (default: the model's context length minus one, at most 4096).")] = None,
    stride: Annotated[Optional[int], typer.Option("--stride", min=1, help="Tokens a window advances, at most --window (default: --window, disjoint windows).")] = None,
    prompt_logprobs: Annotated[Optional[int], typer.Option("--prompt-logprobs", help="Also write per-token columns, with top-K alternatives (0 = own logprob and rank only).")] = None,
    model: ModelOpt = None, out: OutOpt = None, overwrite: OverwriteOpt = False, resume: ResumeOpt = False,
    limit: LimitOpt = None, config: ConfigOpt = None, skip_invalid: SkipInvalidOpt = False, quiet: QuietOpt = False,
    device: DeviceOpt = None, dtype: DtypeOpt = None, block_size: BlockSizeOpt = None,
    num_kv_blocks: NumKvBlocksOpt = None, max_batch_tokens: MaxBatchTokensOpt = None,
    max_num_seqs: MaxNumSeqsOpt = None, no_prefix_caching: NoPrefixCachingOpt = False,
    max_logprobs: MaxLogprobsOpt = None, attention_backend: BackendOpt = None,
    max_model_len: MaxModelLenOpt = None, logprobs_chunk_size: LogprobsChunkOpt = None,
    kv_cache_memory_fraction: KvFractionOpt = None, no_cuda_graphs: NoCudaGraphsOpt = False,
    no_batch_invariant: NoBatchInvariantOpt = False,
) -> None:
    """Perplexity of long texts with rolling windows: token, word and byte perplexity, bits per byte.

    Records: {"id"?, "text": str}. The sequence [BOS (or EOS)] + tokens(text) is cut into windows of
    --window tokens of context advancing by --stride; every text token is scored exactly once
    (--stride = --window is lm-eval's rolling loglikelihood).
    """
    _run("perplexity", locals())


app.command("compare")(compare)  # lives in its own module; needs no model


def version_callback(value: bool) -> None:
    if value:
        out_console.print(f"apcscore {__version__}")
        raise typer.Exit()


@app.callback()
def main_callback(
    version: Annotated[bool, typer.Option("--version", callback=version_callback, is_eager=True,
                                          help="Show the version and exit.")] = False,
) -> None:
    """apcscore: score, evaluate and generate with causal language models in one batch engine."""


def main() -> None:
    app()
