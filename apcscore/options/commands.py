"""The options of score / generate / perplexity / eval: one frozen dataclass per command, each field declared
once (type, default, help text, CLI flags, lower bound: `config.option`), holding an `EngineConfig`.

From the declarations come the CLI parameters (`cli_params`, turned into Typer's by cli.py), the keys of a
`--config FILE` (TOML, `settings`) and the engine settings of flat values such as lm-eval's model_args
(`engine_config`). How command line, config file and defaults merge, and the checks: options/resolve.py.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from functools import cache
from pathlib import Path
from typing import Any, ClassVar, Mapping, TypeVar

from apcscore.config import NOT_GIVEN, EngineConfig, Spec, base_type, option, spec_of

OptionsT = TypeVar("OptionsT", bound="Options")
# the engine options on the command line, in --help order: score's, generate's and perplexity's; eval's through
# engine_cli (each command's CLI_LEAVES_OUT names those it leaves out, and why)
ENGINE_CLI = ("device", "dtype", "block_size", "num_kv_blocks", "max_batch_tokens", "max_num_seqs",
              "no_prefix_caching", "max_logprobs", "attention_backend", "max_model_len",
              "logprobs_chunk_size", "kv_cache_memory_fraction", "no_cuda_graphs", "no_batch_invariant",
              "model_backend", "exact_reuse", "tensor_parallel_size")


def engine_cli(*placed: str) -> tuple[str, ...]:
    """ENGINE_CLI, in its order, without the settings a command shows elsewhere on its --help page (`placed`)."""
    return tuple(name for name in ENGINE_CLI if name not in placed)


# the options score, generate and perplexity share, in --help order (`config` is cli.py's --config FILE)
RUN_CLI = ("model", "out", "overwrite", "resume", "limit", "config", "skip_invalid", "quiet", "columns",
           *ENGINE_CLI, "verify_reuse", "shard", "partition", "ray", "replicas", "gpus_per_replica",
           "cpus_per_replica")


@dataclass(frozen=True, kw_only=True)
class Options:
    """What every command that runs a model takes: the model, where the results go, the engine settings."""

    CLI: ClassVar[tuple[str, ...]] = ()  # the command's parameters in --help order
    # engine settings (`EngineConfig` fields, as their off-flags where they have one) the command leaves off its
    # command line, each with the reason; every other one is in CLI (tests/cli/test_help_pages.py checks it)
    CLI_LEAVES_OUT: ClassVar[dict[str, str]] = {}

    model: str = option("smollm2-135m", "Model alias (smollm2-135m), Hugging Face model directory, or .gguf "
                        "file.", "--model", "-m", show=True)
    out: str | None = option(None, "Output parquet file.", "--out", "-o",
                             show="results/<dataset>.<command>.parquet")
    overwrite: bool = option(False, "Replace an existing output file.")
    limit: int | None = option(None, "Only the first N records.", at_least=1, click_min=True)
    quiet: bool = option(False, "No progress (the bar, or its lines in a log) and no summary.", "--quiet", "-q")
    engine: EngineConfig = field(default_factory=EngineConfig)

    @classmethod
    def from_values(cls: type[OptionsT], values: Mapping[str, Any]) -> OptionsT:
        """The options of flat values (keys as in a config file; None = not given, so the default)."""
        own = {f.name: values[f.name] for f in fields(cls)
               if f.name != "engine" and values.get(f.name) is not None}
        return cls(**own, engine=engine_config(values))


@dataclass(frozen=True, kw_only=True)
class ScaleOptions(Options):
    """How a run is split: --shard (array jobs) or --ray (replicas); score, generate, perplexity and eval."""

    shard: str | None = option(None, "I/N: run only shard I (0-based) of N of a deterministic prefix-aware "
                               "split (array jobs); join the outputs with `apcscore merge`.")
    partition: str = option("prefix", "prefix | random: how --shard and --ray split the records (random: to "
                            "measure what prefix-awareness buys).", show=True)
    ray: str | None = option(None, "Run on Ray replicas: auto (join the running cluster), local (start one "
                             "here) or a cluster address. Needs the `ray` extra.")
    replicas: int = option(1, "With --ray: engine replicas (one Ray actor each).", show=True, at_least=1)
    gpus_per_replica: float | None = option(None, "With --ray: GPUs per replica.", at_least=0,
                                            show="1 on a cluster with GPUs (unless --device cpu), else 0")
    cpus_per_replica: float | None = option(None, "With --ray: CPUs per replica.", show="1", at_least=0)


@dataclass(frozen=True, kw_only=True)
class RunOptions(ScaleOptions):
    """The options of score, generate and perplexity (a dataset in, one parquet file out)."""

    resume: bool = option(False, "Continue an interrupted run from <out>.partial.")
    skip_invalid: bool = option(False, "Turn invalid records into error rows instead of refusing the "
                                "dataset.")
    columns: str | None = option(None, "Read record fields from other columns: FIELD=COLUMN,... (e.g. "
                                 "prompt=text,id=doc_id).")
    verify_reuse: float | None = option(
        None, "With --exact-reuse: re-score this fraction of the records (0..1, a seeded sample) by full "
        "recompute at the end of the run; any bit differing fails the run (exit 1) naming ids and columns.")
    prompt_logprobs: int | None = None  # each command declares its own (score's default is 0)


def _prompt_logprobs(default: int | None, help: str = "Top-K alternatives per prompt token (0 = the token's "
                     "own logprob and rank only).") -> Any:
    return option(default, help, at_least=0)


def _input_format() -> Any:
    return option("auto", "auto | apcscore | openai-batch: the dataset's lines (auto: OpenAI Batch request lines "
                  "when the first line has custom_id, method, url and body).", show=True)


def _output_format() -> Any:
    return option(None, "parquet | openai-batch (OpenAI Batch result lines, JSONL; needs OpenAI Batch input).",
                  show="openai-batch for an --out ending in .jsonl, else parquet")


def _errors_out() -> Any:
    return option(None, "With --output-format openai-batch: write the error lines to this file (OpenAI's error "
                  "file) and only the answered requests to --out.")


def _ignore_body_model() -> Any:
    return option(False, "OpenAI Batch input: answer every line with --model, whatever model its body names.")


def _truncate() -> Any:
    return option(None, "left: drop a too-long prompt's oldest tokens (counted in num_truncated_tokens) "
                  "instead of an error row.")


@dataclass(frozen=True, kw_only=True)
class RequestOptions(RunOptions):
    """The options of the commands whose records are requests (score and generate): truncation, and OpenAI Batch
    lines in and out."""

    truncate: str | None = _truncate()
    input_format: str = _input_format()
    output_format: str | None = _output_format()
    errors_out: str | None = _errors_out()
    ignore_body_model: bool = _ignore_body_model()


@dataclass(frozen=True, kw_only=True)
class ScoreOptions(RequestOptions):
    """`apcscore score`."""

    CLI = ("prompt_logprobs", "reference_model", "truncate", "input_format", "output_format", "errors_out",
           "ignore_body_model", *RUN_CLI)
    CLI_LEAVES_OUT = {"seed": "scoring samples nothing: the seed only derives each record's sampling seed"}

    prompt_logprobs: int = _prompt_logprobs(0)  # score always scores: own logprob and rank
    reference_model: str | None = option(  # engine/reference.py; the columns: jobs/reference_columns.py
        None, "A reference model (alias, Hugging Face folder or .gguf) with the same tokenizer: add each scored "
        "token's exact KL(reference || model) over the whole vocabulary, the reference's logprob, delta p and "
        "top-1 agreement, and each record's mean_kl (`apcscore compare` gates on them).")


@dataclass(frozen=True, kw_only=True)
class GenerateOptions(RequestOptions):
    """`apcscore generate` (the sampling options are the defaults of records that do not set their own)."""

    CLI = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "logprobs", "prompt_logprobs",
           "truncate", "input_format", "output_format", "errors_out", "ignore_body_model", *RUN_CLI)

    max_tokens: int = option(16, "Most tokens to generate.", show=True)
    temperature: float = option(0.0, "0 = greedy.", show=True)
    top_p: float = option(1.0, "Nucleus sampling mass.", show=True)
    top_k: int = option(0, "Sample among the K most likely (0 = off).", show=True)
    stop: str | list[str] | None = option(None, "Stop string (repeatable); not included in the completion.",
                                          cli_type=list[str])
    logprobs: int | None = option(None, "Logprobs of the sampled tokens with top-K alternatives.", at_least=0)
    prompt_logprobs: int | None = _prompt_logprobs(None)


@dataclass(frozen=True, kw_only=True)
class PerplexityOptions(RunOptions):
    """`apcscore perplexity` (window and stride None: derived from the model's context length)."""

    CLI = ("window", "stride", "prompt_logprobs", *RUN_CLI)
    CLI_LEAVES_OUT = {"seed": "perplexity samples nothing: the seed only derives each record's sampling seed"}

    window: int | None = option(None, "Tokens of context a window feeds the model (default: the model's "
                                "context length minus one, at most 4096).", at_least=1, click_min=True)
    stride: int | None = option(None, "Tokens a window advances, at most --window (default: --window, "
                                "disjoint windows).", at_least=1, click_min=True)
    prompt_logprobs: int | None = _prompt_logprobs(None, "Also write per-token columns, with top-K "
                                                   "alternatives (0 = own logprob and rank only).")


@dataclass(frozen=True, kw_only=True)
class EvalOptions(ScaleOptions):
    """`apcscore eval` (lm-eval tasks; the options named as lm-eval's, with dashes)."""

    # --exact-reuse and --seed among lm-eval's own options, then every other engine setting (engine_cli)
    CLI = ("tasks", "include_path", "num_fewshot", "limit", "apply_chat_template", "fewshot_as_multiturn",
           "system_instruction", "gen_kwargs", "exact_reuse", "max_length", "seed", "model", "out", "overwrite",
           "log_samples", "resume", "cache", "config", "quiet", "batch_size", *engine_cli("exact_reuse"),
           "shard", "partition", "ray", "replicas", "gpus_per_replica", "cpus_per_replica")

    tasks: str = option(NOT_GIVEN, "lm-eval task names, comma-separated (T1,T2); required, here or as `tasks` "
                        "in the --config file.", "--tasks", "-t", show_default=False)
    include_path: Path | None = option(None, "Folder of extra lm-eval task YAML files.")
    num_fewshot: int | None = option(None, "Few-shot examples per prompt.", show="the task's", at_least=0,
                                     click_min=True)
    # a whole number or a fraction below 1, as lm-eval's --limit (checked by options/resolve.check_eval_options)
    limit: float | None = option(None, "Only the first N documents of each task; a number below 1 is that "
                                 "fraction of each task's documents, as in lm-eval.")
    apply_chat_template: bool = option(False, "Wrap prompts in the model's chat template, as lm-eval does "
                                       "(few-shot examples as chat turns by default).")
    # None: lm-eval's default, on with --apply-chat-template, else off (lmeval/tasks.fewshot_as_multiturn)
    fewshot_as_multiturn: bool | None = option(
        None, "With the chat template: each few-shot example its own user/assistant turn (the default, as in "
        "lm-eval); the --no- form puts them all in one user turn.",
        "--fewshot-as-multiturn/--no-fewshot-as-multiturn")
    system_instruction: str | None = option(None, "System instruction put before every prompt, ahead of the "
                                            "task's description (a system turn with --apply-chat-template), as "
                                            "in lm-eval.")
    gen_kwargs: str | None = option(None, "Generation settings over the generate_until tasks' own, as in "
                                    "lm-eval: KEY=VALUE pairs joined by commas, e.g. top_k=40,seed=1 or "
                                    "max_gen_toks=64.")
    max_length: int | None = option(None, "Most tokens a scored sequence feeds the model.", at_least=1,
                                    click_min=True, show="the model's context length - 1")
    out: str | None = option(None, "Output folder: results.json, requests.parquet (and samples_<task>.jsonl "
                             "files with --log-samples).", "--out", "-o", show="results/eval-<time>")
    overwrite: bool = option(False, "Replace the results in an existing --out folder.")
    log_samples: bool = option(False, "Also write lm-eval's per-sample records, one samples_<task>.jsonl per "
                               "task in --out (lm-eval's --log_samples files).")
    resume: bool = option(False, "Continue an interrupted eval in --out: the responses its journal holds "
                          "(responses-<id>.jsonl) are read, the rest computed.")
    cache: Path | None = option(None, "A folder of finished responses (a previous run's --out, or a cache "
                                "folder shared by runs): those of this model and engine configuration are "
                                "read instead of computed, and new ones added to it (lm-eval's --use_cache, "
                                "keyed by the model's fingerprint and numerics).")
    batch_size: str | None = option(None, "Accepted for lm-eval's command lines and ignored: the engine "
                                    "batches by its token budget (--max-batch-tokens).")


# the commands a --config file is for
COMMANDS: dict[str, type[Options]] = {"score": ScoreOptions, "generate": GenerateOptions,
                                      "perplexity": PerplexityOptions, "eval": EvalOptions}


@dataclass(frozen=True)
class Setting:
    """One option key (a config-file key, a CLI parameter's name): a field of the options class, of
    EngineConfig, or an engine switch's off-flag (`no_prefix_caching`)."""

    key: str
    type: str  # the annotation, e.g. "int | None"
    default: Any  # NOT_GIVEN: required
    spec: Spec


@cache
def settings(cls: type[Options]) -> dict[str, Setting]:
    """Every option key of `cls`: its own fields, then the engine's fields and off-flags."""
    found = {f.name: Setting(f.name, str(f.type), NOT_GIVEN if f.default is MISSING else f.default, spec)
             for f in fields(cls) if (spec := spec_of(f)) is not None}
    for f in fields(EngineConfig):
        spec = spec_of(f)
        assert spec is not None, f"EngineConfig.{f.name} is declared without config.option"
        found[f.name] = Setting(f.name, str(f.type), f.default, spec)
        if spec.negation:
            found[spec.negation] = Setting(spec.negation, "bool", False, spec)
    return found


def defaults(cls: type[Options]) -> dict[str, Any]:
    """Every option key of `cls` with its default (required options left out)."""
    return {k: s.default for k, s in settings(cls).items() if s.default is not NOT_GIVEN}


def engine_keys() -> frozenset[str]:
    """The keys `engine_config` reads: EngineConfig's field names and their off-flags (`no_prefix_caching`)."""
    names = {f.name for f in fields(EngineConfig)}
    return frozenset(names | {neg for f in fields(EngineConfig) if (neg := spec_of(f).negation)})  # type: ignore


def engine_config(values: Mapping[str, Any]) -> EngineConfig:
    """EngineConfig from flat option values (EngineConfig field names and the off-flags, e.g. lm-eval's
    model_args); None means not given, a true off-flag turns its setting off, other keys are ignored."""
    given: dict[str, Any] = {}
    for f in fields(EngineConfig):
        if values.get(f.name) is not None:
            given[f.name] = values[f.name]
        negation = spec_of(f).negation  # type: ignore[union-attr]
        if negation and values.get(negation):
            given[f.name] = False
    return EngineConfig(**given)


def cli_values(cli: Mapping[str, Any], cls: type[Options] | None = None) -> dict[str, Any]:
    """The values given on the command line: None (False for on/off flags, [] for lists) is not given; False
    is given for a flag of `cls` with an off-switch of its own (`bool | None`: `--no-fewshot-as-multiturn`)."""
    both = {k for k, s in settings(cls).items() if s.type == "bool | None"} if cls is not None else set()
    return {k: v for k, v in cli.items() if v is not None and (v is not False or k in both) and v != []}


def option_name(key: str) -> str:
    """`max_tokens` -> `--max-tokens`; an engine setting declared with flags of its own names its first
    (`tensor_parallel_size` -> `--tensor-parallel`)."""
    for f in fields(EngineConfig):
        if f.name == key and (spec := spec_of(f)) is not None and spec.flags:
            return spec.flags[0]
    return "--" + key.replace("_", "-")


def _shown_default(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class CliParam:
    """One command-line option of a command, as cli.py hands it to Typer."""

    name: str
    type: Any  # the value's type (bool for an on/off flag)
    flags: tuple[str, ...]
    help: str
    required: bool
    typer: dict[str, Any]  # other keyword arguments of typer.Option
    default: Any = None  # False for an on/off flag; None (not given) for the others, `--x/--no-x` flags too


def cli_params(cls: type[Options]) -> list[CliParam | str]:
    """The parameters of `cls`'s command in --help order; a name that is no option (`config`) stays a str.

    A required option is left to the command to check where it may come from a --config file."""
    known = settings(cls)
    out: list[CliParam | str] = []
    for name in cls.CLI:
        if name not in known:
            out.append(name)
            continue
        s = known[name]
        spec, flag = s.spec, s.type in ("bool", "bool | None")
        text = spec.help
        if spec.show:
            text += f" \\[default: {_shown_default(s.default) if spec.show is True else spec.show}]"
        kind = bool if flag else spec.cli_type or {"int": int, "str": str, "float": float, "Path": Path}[
            base_type(s.type)]
        extra = {**dict(spec.typer), **({"min": spec.at_least} if spec.click_min else {}),
                 **({"metavar": ""} if flag else {})}
        flags = spec.flags if spec.flags and name != spec.negation else (option_name(name),)
        required = s.default is NOT_GIVEN and "config" not in cls.CLI
        out.append(CliParam(name, kind, flags, text, required, extra, False if s.type == "bool" else None))
    return out

