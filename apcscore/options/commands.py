"""The options of score / generate / perplexity / eval: one frozen dataclass per command, each field declared
once (type, default, help text, CLI flags, lower bound, --help group: `specs.option`), holding an `EngineConfig`
(whose command line is `specs.ENGINE_OPTIONS`).

From the declarations come the CLI parameters in --help order (`cli_params`, turned into Typer's by cli.py), the
keys of a `--config FILE` (TOML, `settings`) and the engine settings of flat values such as lm-eval's model_args
(`engine_config`). How command line, config file and defaults merge, and the checks: options/resolve.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cache
from pathlib import Path
from typing import Any, ClassVar, Mapping, TypeVar

from apcscore.config import EngineConfig, SamplingOptions
from apcscore.options.specs import (ENGINE_OPTIONS, GROUPS, NOT_GIVEN, OPTIONS, SCALE, Spec,
                                    base_type, option, option_name, spec_of)

OptionsT = TypeVar("OptionsT", bound="Options")


@dataclass(frozen=True, kw_only=True)
class Options:
    """What every command that runs a model takes: the model, where the results go, the engine settings."""

    # engine settings (`EngineConfig` fields, as their off-flags where they have one) the command leaves off its
    # command line, each with the reason; every other one is a parameter (tests/cli/test_help_pages.py checks it)
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
        """The options of flat values (keys as in a config file; None = not given, so the default; a path as a
        string too)."""
        own = {f.name: Path(v) if isinstance(v, str) and base_type(str(f.type)) == "Path" else v
               for f in fields(cls) if f.name != "engine" and (v := values.get(f.name)) is not None}
        return cls(**own, engine=engine_config(values))


@dataclass(frozen=True, kw_only=True)
class ScaleOptions(Options):
    """How a run is split: --shard (array jobs) or --ray (replicas); score, generate, perplexity and eval."""

    shard: str | None = option(None, "I/N: run only shard I (0-based) of N of a deterministic prefix-aware "
                               "split (array jobs); join the outputs with `apcscore merge`.", group=SCALE)
    partition: str = option("prefix", "prefix | random: how --shard and --ray split the records (random: to "
                            "measure what prefix-awareness buys).", show=True, group=SCALE)
    ray: str | None = option(None, "Run on Ray replicas: auto (join the running cluster), local (start one "
                             "here) or a cluster address. Needs the `ray` extra.", group=SCALE)
    replicas: int = option(1, "With --ray: engine replicas (one Ray actor each).", show=True, at_least=1,
                           group=SCALE)
    gpus_per_replica: float | None = option(None, "With --ray: GPUs per replica.", at_least=0, group=SCALE,
                                            show="1 on a cluster with GPUs (unless --device cpu), else 0")
    cpus_per_replica: float | None = option(None, "With --ray: CPUs per replica.", show="1", at_least=0,
                                            group=SCALE)


@dataclass(frozen=True, kw_only=True)
class RunOptions(ScaleOptions):
    """The options of score, generate and perplexity (a dataset in, one parquet file out)."""

    prompt_logprobs: int | None = option(None, "Top-K alternatives per prompt token (0 = the token's own logprob "
                                         "and rank only; perplexity writes per-token columns only with it).",
                                         at_least=0)
    resume: bool = option(False, "Continue an interrupted run from <out>.partial.")
    skip_invalid: bool = option(False, "Turn invalid records into error rows instead of refusing the "
                                "dataset.")
    columns: str | None = option(None, "Read record fields from other columns: FIELD=COLUMN,... (e.g. "
                                 "prompt=text,id=doc_id).")
    verify_reuse: float | None = option(
        None, "With --exact-reuse: re-score this fraction of the records (0..1, a seeded sample) by full "
        "recompute at the end of the run; any bit differing fails the run (exit 1) naming ids and columns.")


@dataclass(frozen=True, kw_only=True)
class RequestOptions(RunOptions):
    """The options of the commands whose records are requests (score and generate): truncation, and OpenAI Batch
    lines in and out."""

    truncate: str | None = option(None, "left: drop a too-long prompt's oldest tokens (counted in "
                                  "num_truncated_tokens) instead of an error row.")
    input_format: str = option("auto", "auto | apcscore | openai-batch: the dataset's lines (auto: OpenAI Batch "
                               "request lines when the first line has custom_id, method, url and body).", show=True)
    output_format: str | None = option(None, "parquet | openai-batch (OpenAI Batch result lines, JSONL; needs "
                                       "OpenAI Batch input).",
                                       show="openai-batch for an --out ending in .jsonl, else parquet")
    errors_out: str | None = option(None, "With --output-format openai-batch: write the error lines to this file "
                                    "(OpenAI's error file) and only the answered requests to --out.")
    ignore_body_model: bool = option(False, "OpenAI Batch input: answer every line with --model, whatever model "
                                     "its body names.")


@dataclass(frozen=True, kw_only=True)
class ScoreOptions(RequestOptions):
    """`apcscore score`."""

    CLI_LEAVES_OUT = {"seed": "scoring samples nothing: the seed only derives each record's sampling seed"}

    prompt_logprobs: int = option(0, "Top-K alternatives per prompt token (0 = the token's own logprob and rank "
                                  "only).", at_least=0)  # score always scores: own logprob and rank
    reference_model: str | None = option(  # engine/reference.py; the columns: jobs/reference_columns.py
        None, "A reference model (alias, Hugging Face folder or .gguf) with the same tokenizer: add each scored "
        "token's exact KL(reference || model) over the whole vocabulary, the reference's logprob, delta p and "
        "top-1 agreement, and each record's mean_kl (`apcscore compare` gates on them).")


@dataclass(frozen=True, kw_only=True)
class GenerateOptions(RequestOptions, SamplingOptions):
    """`apcscore generate` (the sampling options, declared by `config.SamplingOptions`, are the defaults of records
    that do not set their own)."""


@dataclass(frozen=True, kw_only=True)
class PerplexityOptions(RunOptions):
    """`apcscore perplexity` (window and stride None: derived from the model's context length)."""

    CLI_LEAVES_OUT = {"seed": "perplexity samples nothing: the seed only derives each record's sampling seed"}

    window: int | None = option(None, "Tokens of context a window feeds the model (default: the model's "
                                "context length minus one, at most 4096).", at_least=1, click_min=True)
    stride: int | None = option(None, "Tokens a window advances, at most --window (default: --window, "
                                "disjoint windows).", at_least=1, click_min=True)


@dataclass(frozen=True, kw_only=True)
class EvalOptions(ScaleOptions):
    """`apcscore eval` (lm-eval tasks; the options named as lm-eval's, with dashes)."""

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
    found = {f.name: Setting(f.name, str(f.type), f.default, spec)
             for f in fields(cls) if (spec := spec_of(f)) is not None}
    for f in fields(EngineConfig):
        spec = ENGINE_OPTIONS.get(f.name)
        assert spec is not None, f"EngineConfig.{f.name} has no command line: declare it in ENGINE_OPTIONS"
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
    return frozenset(names | {neg for name in names if (neg := ENGINE_OPTIONS[name].negation)})


def engine_config(values: Mapping[str, Any]) -> EngineConfig:
    """EngineConfig from flat option values (EngineConfig field names and the off-flags, e.g. lm-eval's
    model_args); None means not given, a true off-flag turns its setting off, other keys are ignored."""
    given: dict[str, Any] = {}
    for f in fields(EngineConfig):
        if values.get(f.name) is not None:
            given[f.name] = values[f.name]
        negation = ENGINE_OPTIONS[f.name].negation
        if negation and values.get(negation):
            given[f.name] = False
    return EngineConfig(**given)


def cli_keys(cls: type[Options]) -> list[str]:
    """The option keys on the command line of `cls`'s command, in --help order: panel by panel (`GROUPS`), each
    in declaration order, the class's fields (dataclass order: a base class's first) before EngineConfig's (an
    engine switch as its off-flag); the engine settings in `CLI_LEAVES_OUT` left out."""
    known = settings(cls)
    keys = [f.name for f in fields(cls) if f.name in known]
    keys += [ENGINE_OPTIONS[f.name].negation or f.name for f in fields(EngineConfig)]
    return sorted((k for k in keys if k not in cls.CLI_LEAVES_OUT), key=lambda k: GROUPS.index(known[k].spec.group))


def _shown_default(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class CliParam:
    """One command-line option of a command, as cli.py hands it to Typer."""

    name: str
    type: Any  # the value's type (bool for an on/off flag)
    flags: tuple[str, ...]
    help: str
    panel: str | None  # its --help panel (None: Typer's own, "Options")
    typer: dict[str, Any]  # other keyword arguments of typer.Option
    default: Any = None  # False for an on/off flag; None (not given) for the others, `--x/--no-x` flags too


def cli_params(cls: type[Options]) -> list[CliParam | str]:
    """The parameters of `cls`'s command in --help order (`cli_keys`), and "config" (cli.py's --config FILE, no
    option) last in the first panel. None is required: a required option (eval's --tasks) may come from the
    --config file, so options/resolve.py checks it."""
    known = settings(cls)
    out: list[CliParam | str] = []
    for name in cli_keys(cls):
        s = known[name]
        spec, flag = s.spec, s.type in ("bool", "bool | None")
        if spec.group != OPTIONS and "config" not in out:
            out.append("config")
        text = spec.help
        if spec.show:
            text += f" \\[default: {_shown_default(s.default) if spec.show is True else spec.show}]"
        kind = bool if flag else spec.cli_type or {"int": int, "str": str, "float": float, "Path": Path}[
            base_type(s.type)]
        extra = {**dict(spec.typer), **({"min": spec.at_least} if spec.click_min else {}),
                 **({"metavar": ""} if flag else {})}
        flags = spec.flags if spec.flags and name != spec.negation else (option_name(name),)
        panel = None if spec.group == OPTIONS else spec.group
        out.append(CliParam(name, kind, flags, text, panel, extra, False if s.type == "bool" else None))
    return out
