"""The `apcscore` command line: thin Typer commands over jobs and the engine.

Option precedence: command line > `--config FILE` (TOML, keys named like the options with underscores)
> built-in defaults. Every user-facing problem is an ApcscoreError, shown as one clear message.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Optional

import click
import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperCommand, TyperGroup

from apcscore import __version__
from apcscore.compare.command import compare
from apcscore.errors import ApcscoreError

_UNESCAPED_BRACKET = re.compile(r"(?<!\\)\[")


def markup_safe(text: str | None) -> str | None:
    """`text` with every `[` not yet escaped written `\\[`: Typer renders help as Rich markup, where
    `[lmeval]` is a tag and vanishes."""
    return None if text is None else _UNESCAPED_BRACKET.sub(r"\\[", text)


def _escape_help(command: click.Command) -> None:
    """Escape the command's own help and every parameter's (arguments and options)."""
    command.help = markup_safe(command.help)
    command.short_help = markup_safe(command.short_help)
    for param in command.params:
        if getattr(param, "help", None):
            param.help = markup_safe(param.help)  # type: ignore[attr-defined]


def _plain_help_option(option: click.Option | None) -> click.Option | None:
    if option is not None:
        option.metavar = ""  # a flag: no `<bool>` in the help
    return option


class Group(TyperGroup):
    """Typer's group; its --help shows no `<bool>`; help text is never read as markup."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _escape_help(self)

    def get_help_option(self, ctx: click.Context) -> click.Option | None:
        return _plain_help_option(super().get_help_option(ctx))


class Command(TyperCommand):
    """Typer's command with a plain usage line: `DATASET`, not `{dataset}`; help text is never read as markup."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _escape_help(self)

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        pieces = super().collect_usage_pieces(ctx)
        return [p[1:p.index("}")].upper() + p[p.index("}") + 1:] if p.startswith("{") and "}" in p else p
                for p in pieces]

    def get_help_option(self, ctx: click.Context) -> click.Option | None:
        return _plain_help_option(super().get_help_option(ctx))


app = typer.Typer(help="Batch scoring and evaluation of causal language models (paged KV cache, prefix caching).",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False, cls=Group)
console = Console(stderr=True)
out_console = Console()


def _flag(*names: str, help: str) -> Any:
    """An on/off option; its help shows no `<bool>` type."""
    return typer.Option(*names, help=help, metavar="")


# ---- shared option types ------------------------------------------------------------------------
DatasetArg = Annotated[Path, typer.Argument(help="Dataset: JSONL (one record per line), parquet, CSV, or a datasets save_to_disk directory.", metavar="DATASET",
                                            show_default=False)]
ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="Model alias (smollm2-135m), Hugging Face model directory, or .gguf file. \\[default: smollm2-135m]")]
OutOpt = Annotated[Optional[str], typer.Option("--out", "-o", help="Output parquet file. \\[default: results/<dataset>.<command>.parquet]")]
OverwriteOpt = Annotated[bool, _flag("--overwrite", help="Replace an existing output file.")]
ResumeOpt = Annotated[bool, _flag("--resume", help="Continue an interrupted run from <out>.partial.")]
LimitOpt = Annotated[Optional[int], typer.Option("--limit", help="Only the first N records.", min=1)]
ConfigOpt = Annotated[Optional[Path], typer.Option("--config", help="TOML file of option values (see configs/).")]
SkipInvalidOpt = Annotated[bool, _flag("--skip-invalid", help="Turn invalid records into error rows instead of refusing the dataset.")]
QuietOpt = Annotated[bool, _flag("--quiet", "-q", help="No progress bar or summary.")]
DeviceOpt = Annotated[Optional[str], typer.Option("--device", help="auto | cpu | cuda (auto = cuda if available). \\[default: auto]")]
DtypeOpt = Annotated[Optional[str], typer.Option("--dtype", help="auto | float32 | bfloat16 | float16 (auto = float32 on CPU, bfloat16 on CUDA). \\[default: auto]")]
BlockSizeOpt = Annotated[Optional[int], typer.Option("--block-size", help="Tokens per KV block. \\[default: 16]")]
NumKvBlocksOpt = Annotated[Optional[int], typer.Option("--num-kv-blocks", help="KV pool size in blocks. \\[default: from free memory]")]
MaxBatchTokensOpt = Annotated[Optional[int], typer.Option("--max-batch-tokens", help="Token budget of one engine step. \\[default: 2048]")]
MaxNumSeqsOpt = Annotated[Optional[int], typer.Option("--max-num-seqs", help="Sequences running at once. \\[default: 64]")]
NoPrefixCachingOpt = Annotated[bool, _flag("--no-prefix-caching", help="Turn automatic prefix caching off.")]
NoBatchInvariantOpt = Annotated[bool, _flag("--no-batch-invariant", help="Library GEMMs instead of batch-invariant ones: faster, but a record's last bits may then depend on what shares its steps.")]
ExactReuseOpt = Annotated[bool, _flag("--exact-reuse", help="Scoring reads cached KV of the blocks before each record's first scored position (shared contexts, few-shot prefixes computed once); results stay bitwise those of a full recompute. Needs batch invariance.")]
VerifyReuseOpt = Annotated[Optional[float], typer.Option("--verify-reuse", help="With --exact-reuse: re-score this fraction of the records (0..1, a seeded sample) by full recompute at the end of the run; any bit differing fails the run (exit 1) naming ids and columns.")]
MaxModelLenOpt = Annotated[Optional[int], typer.Option("--max-model-len", help="Cap on the context length in tokens. \\[default: the model's]")]
LogprobsChunkOpt = Annotated[Optional[int], typer.Option("--logprobs-chunk-size", help="Rows of the vocabulary projection computed at once. \\[default: 1024]")]
KvFractionOpt = Annotated[Optional[float], typer.Option("--kv-cache-memory-fraction", help="Share of memory for the KV pool when --num-kv-blocks is not given (CPU: of free host memory, at most 4 GiB; CUDA: of the GPU's total, after weights and the largest step). \\[default: 0.25 CPU, 0.85 CUDA]")]
NoCudaGraphsOpt = Annotated[bool, _flag("--no-cuda-graphs", help="Run decode steps on CUDA eagerly instead of replaying captured CUDA graphs.")]
MaxLogprobsOpt = Annotated[Optional[int], typer.Option("--max-logprobs", help="Cap on --prompt-logprobs / --logprobs. \\[default: 20]")]
BackendOpt = Annotated[Optional[str], typer.Option("--attention-backend", help="auto | torch | triton (auto = triton on CUDA). \\[default: auto]")]
ModelBackendOpt = Annotated[Optional[str], typer.Option("--model-backend", "--backend", help="auto | native | transformers: our decoder (paged KV, prefix cache, batch invariant) or the model's own transformers code (full recompute, no cache); auto = native where the architecture is supported. \\[default: auto]")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Sampling seed (per record unless the record sets its own).")]
TruncateOpt = Annotated[Optional[str], typer.Option("--truncate", help="left: drop a too-long prompt's oldest tokens (counted in num_truncated_tokens) instead of an error row.")]
ColumnsOpt = Annotated[Optional[str], typer.Option("--columns", help="Read record fields from other columns: FIELD=COLUMN,... (e.g. prompt=text,id=doc_id).")]
ShardOpt = Annotated[Optional[str], typer.Option("--shard", help="I/N: run only shard I (0-based) of N of a deterministic prefix-aware split (array jobs); join the files with `apcscore merge`.")]
PartitionOpt = Annotated[Optional[str], typer.Option("--partition", help="prefix | random: how --shard and --ray split the records (random: to measure what prefix-awareness buys). \\[default: prefix]")]
RayOpt = Annotated[Optional[str], typer.Option("--ray", help="Run on Ray replicas: auto (join the running cluster), local (start one here) or a cluster address. Needs the `ray` extra.")]
ReplicasOpt = Annotated[Optional[int], typer.Option("--replicas", help="With --ray: engine replicas (one Ray actor each). \\[default: 1]")]
GpusPerReplicaOpt = Annotated[Optional[float], typer.Option("--gpus-per-replica", help="With --ray: GPUs per replica. \\[default: 1 on a cluster with GPUs (unless --device cpu), else 0]")]
CpusPerReplicaOpt = Annotated[Optional[float], typer.Option("--cpus-per-replica", help="With --ray: CPUs per replica. \\[default: 1]")]
PromptLogprobsOpt = Annotated[Optional[int], typer.Option("--prompt-logprobs", help="Top-K alternatives per prompt token (0 = the token's own logprob and rank only).")]


def _error(exc: ApcscoreError) -> typer.Exit:
    """Print a user-facing error (its text escaped: it may quote data, paths or exceptions) and exit with its code."""
    console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
    return typer.Exit(exc.exit_code)


# ---- commands -----------------------------------------------------------------------------------
def _run(command: str, params: dict[str, Any]) -> None:
    """Run a command from its parameters (`locals()` of the command function); ApcscoreError -> clear exit."""
    from apcscore.run.driver import run_command

    options = {k: v for k, v in params.items() if k not in ("dataset", "config")}
    try:
        code = run_command(command, params["dataset"], options, params["config"], console)
    except ApcscoreError as exc:
        raise _error(exc) from None
    if code:
        raise typer.Exit(code)


@app.command(cls=Command)
def score(
    dataset: DatasetArg,
    prompt_logprobs: PromptLogprobsOpt = None,
    truncate: TruncateOpt = None,
    model: ModelOpt = None, out: OutOpt = None, overwrite: OverwriteOpt = False, resume: ResumeOpt = False,
    limit: LimitOpt = None, config: ConfigOpt = None, skip_invalid: SkipInvalidOpt = False, quiet: QuietOpt = False,
    columns: ColumnsOpt = None,
    device: DeviceOpt = None, dtype: DtypeOpt = None, block_size: BlockSizeOpt = None,
    num_kv_blocks: NumKvBlocksOpt = None, max_batch_tokens: MaxBatchTokensOpt = None,
    max_num_seqs: MaxNumSeqsOpt = None, no_prefix_caching: NoPrefixCachingOpt = False,
    max_logprobs: MaxLogprobsOpt = None, attention_backend: BackendOpt = None,
    max_model_len: MaxModelLenOpt = None, logprobs_chunk_size: LogprobsChunkOpt = None,
    kv_cache_memory_fraction: KvFractionOpt = None, no_cuda_graphs: NoCudaGraphsOpt = False,
    no_batch_invariant: NoBatchInvariantOpt = False, model_backend: ModelBackendOpt = None,
    exact_reuse: ExactReuseOpt = False, verify_reuse: VerifyReuseOpt = None,
    shard: ShardOpt = None, partition: PartitionOpt = None, ray: RayOpt = None, replicas: ReplicasOpt = None,
    gpus_per_replica: GpusPerReplicaOpt = None, cpus_per_replica: CpusPerReplicaOpt = None,
) -> None:
    """Per-token prompt logprobs (own logprob, rank, top-K) and per-record NLL / perplexity; loglikelihoods.

    Records: {"id"?, "prompt": str}, {"id"?, "prompt_token_ids": \\[int, ...]},
    {"id"?, "context": str, "continuation": str} (loglikelihood, is_greedy), or
    {"id"?, "context": str, "choices": \\[str, ...], "answer": int} (multiple choice: pred, correct).
    """
    _run("score", locals())


@app.command(cls=Command)
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
    columns: ColumnsOpt = None,
    device: DeviceOpt = None, dtype: DtypeOpt = None, block_size: BlockSizeOpt = None,
    num_kv_blocks: NumKvBlocksOpt = None, max_batch_tokens: MaxBatchTokensOpt = None,
    max_num_seqs: MaxNumSeqsOpt = None, no_prefix_caching: NoPrefixCachingOpt = False,
    max_logprobs: MaxLogprobsOpt = None, attention_backend: BackendOpt = None,
    max_model_len: MaxModelLenOpt = None, logprobs_chunk_size: LogprobsChunkOpt = None,
    kv_cache_memory_fraction: KvFractionOpt = None, no_cuda_graphs: NoCudaGraphsOpt = False,
    no_batch_invariant: NoBatchInvariantOpt = False, model_backend: ModelBackendOpt = None,
    exact_reuse: ExactReuseOpt = False, verify_reuse: VerifyReuseOpt = None,
    shard: ShardOpt = None, partition: PartitionOpt = None, ray: RayOpt = None, replicas: ReplicasOpt = None,
    gpus_per_replica: GpusPerReplicaOpt = None, cpus_per_replica: CpusPerReplicaOpt = None,
) -> None:
    """Completions with sampling options; prompts sharing a prefix reuse its cached KV.

    Records: {"id"?, "prompt": str}, {"id"?, "prompt_token_ids": \\[int, ...]} or
    {"id"?, "messages": \\[{"role", "content"}, ...]} (chat template with generation prompt), optionally with per-record max_tokens, temperature, top_p, top_k, seed, stop.
    """
    _run("generate", locals())


@app.command(cls=Command)
def perplexity(
    dataset: DatasetArg,
    window: Annotated[Optional[int], typer.Option("--window", min=1, help="Tokens of context a window feeds the model (default: the model's context length minus one, at most 4096).")] = None,
    stride: Annotated[Optional[int], typer.Option("--stride", min=1, help="Tokens a window advances, at most --window (default: --window, disjoint windows).")] = None,
    prompt_logprobs: Annotated[Optional[int], typer.Option("--prompt-logprobs", help="Also write per-token columns, with top-K alternatives (0 = own logprob and rank only).")] = None,
    model: ModelOpt = None, out: OutOpt = None, overwrite: OverwriteOpt = False, resume: ResumeOpt = False,
    limit: LimitOpt = None, config: ConfigOpt = None, skip_invalid: SkipInvalidOpt = False, quiet: QuietOpt = False,
    columns: ColumnsOpt = None,
    device: DeviceOpt = None, dtype: DtypeOpt = None, block_size: BlockSizeOpt = None,
    num_kv_blocks: NumKvBlocksOpt = None, max_batch_tokens: MaxBatchTokensOpt = None,
    max_num_seqs: MaxNumSeqsOpt = None, no_prefix_caching: NoPrefixCachingOpt = False,
    max_logprobs: MaxLogprobsOpt = None, attention_backend: BackendOpt = None,
    max_model_len: MaxModelLenOpt = None, logprobs_chunk_size: LogprobsChunkOpt = None,
    kv_cache_memory_fraction: KvFractionOpt = None, no_cuda_graphs: NoCudaGraphsOpt = False,
    no_batch_invariant: NoBatchInvariantOpt = False, model_backend: ModelBackendOpt = None,
    exact_reuse: ExactReuseOpt = False, verify_reuse: VerifyReuseOpt = None,
    shard: ShardOpt = None, partition: PartitionOpt = None, ray: RayOpt = None, replicas: ReplicasOpt = None,
    gpus_per_replica: GpusPerReplicaOpt = None, cpus_per_replica: CpusPerReplicaOpt = None,
) -> None:
    """Perplexity of long texts with rolling windows: token, word and byte perplexity, bits per byte.

    Records: {"id"?, "text": str}. The sequence [BOS (or EOS)] + tokens(text) is cut into windows of
    --window tokens of context advancing by --stride; every text token is scored exactly once
    (--stride = --window is lm-eval's rolling loglikelihood).
    """
    _run("perplexity", locals())


@app.command("eval", cls=Command)
def eval_(
    tasks: Annotated[str, typer.Option("--tasks", "-t", help="lm-eval task names, comma-separated (T1,T2).", show_default=False)],
    include_path: Annotated[Optional[Path], typer.Option("--include-path", help="Folder of extra lm-eval task YAML files.")] = None,
    num_fewshot: Annotated[Optional[int], typer.Option("--num-fewshot", min=0, help="Few-shot examples per prompt. \\[default: the task's]")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", min=1, help="Only the first N documents of each task.")] = None,
    apply_chat_template: Annotated[bool, _flag("--apply-chat-template", help="Wrap prompts in the model's chat template (few-shot as multi-turn), as lm-eval does.")] = False,
    exact_reuse: ExactReuseOpt = False,
    max_length: Annotated[Optional[int], typer.Option("--max-length", min=1, help="Most tokens a scored sequence feeds the model. \\[default: the model's context length - 1]")] = None,
    seed: SeedOpt = None,
    model: ModelOpt = None,
    out: Annotated[Optional[str], typer.Option("--out", "-o", help="Output folder (results.json, requests.parquet). \\[default: results/eval-<time>]")] = None,
    overwrite: OverwriteOpt = False, quiet: QuietOpt = False,
    device: DeviceOpt = None, dtype: DtypeOpt = None, block_size: BlockSizeOpt = None,
    num_kv_blocks: NumKvBlocksOpt = None, max_batch_tokens: MaxBatchTokensOpt = None,
    max_num_seqs: MaxNumSeqsOpt = None, no_prefix_caching: NoPrefixCachingOpt = False,
    attention_backend: BackendOpt = None, max_model_len: MaxModelLenOpt = None,
    logprobs_chunk_size: LogprobsChunkOpt = None, kv_cache_memory_fraction: KvFractionOpt = None,
    no_cuda_graphs: NoCudaGraphsOpt = False, no_batch_invariant: NoBatchInvariantOpt = False,
) -> None:
    """Run lm-evaluation-harness tasks with apcscore's engine as the model (lm-eval's `--model apcscore`).

    Writes lm-eval's results JSON and a per-request parquet to --out and prints lm-eval's table. Needs the
    `lmeval` extra (pip install 'apcscore[lmeval]').
    """
    params = dict(locals())
    from apcscore.lmeval.run import run_eval

    try:
        run_eval(params, lambda text: out_console.print(text, markup=False, highlight=False))
    except ApcscoreError as exc:
        raise _error(exc) from None


@app.command(cls=Command)
def merge(
    out: Annotated[Path, typer.Argument(help="The merged parquet file.", metavar="OUT", show_default=False)],
    shards: Annotated[list[Path], typer.Argument(help="The shard files of one --shard 0/N .. N-1/N run.",
                                                 metavar="SHARD", show_default=False)],
    overwrite: OverwriteOpt = False,
) -> None:
    """Join the files of `--shard I/N` runs into the file one run would have written (checks they are the shards
    of one dataset under one configuration, refuses gaps and overlaps)."""
    from apcscore.scale.merge import merge_shards

    try:
        path, rows = merge_shards(out, shards, overwrite=overwrite)
    except ApcscoreError as exc:
        raise _error(exc) from None
    console.print(f"merged {len(shards)} shards: {rows:,} rows -> {escape(str(path))}", highlight=False)


app.command("compare", cls=Command)(compare)  # lives in its own module; needs no model


def version_callback(value: bool) -> None:
    if value:
        out_console.print(f"apcscore {__version__}")
        raise typer.Exit()


@app.callback()
def main_callback(
    version: Annotated[bool, typer.Option("--version", callback=version_callback, is_eager=True, metavar="",
                                          help="Show the version and exit.")] = False,
) -> None:
    """apcscore: score, evaluate and generate with causal language models in one batch engine."""


def main() -> None:
    app()
