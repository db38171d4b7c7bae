"""How an option is declared on the command line (`Spec`, `option`), and the command-line face of the engine's
settings: `ENGINE_OPTIONS`, the help text, flags and off-switch of each `EngineConfig` field (config.py knows no
command line), and `in_flags`, which names in a config error the flags the user typed.

An option's --help line goes into its group's panel (`GROUPS`, in that order), in the order its options class (or
EngineConfig) declares the fields: no list of names is kept by hand.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import MISSING, Field, dataclass, field
from typing import Any

from apcscore.config import ConfigError

NOT_GIVEN: Any = MISSING  # `option(NOT_GIVEN, ...)`: a field without a default (a required CLI option)

# the --help panels, in their order on a page (Typer's own panel, "Options", first)
OPTIONS, SAMPLING, ENGINE, SCALE = "Options", "Sampling", "Engine", "Scale-out"
GROUPS = (OPTIONS, SAMPLING, ENGINE, SCALE)


@dataclass(frozen=True)
class Spec:
    """How one setting is declared on the command line and checked.

    help: the --help text; show: append `[default: X]`, X the field's default (True) or this text (a str).
    flags: the CLI names (default `--name-with-dashes`); negation: the CLI/TOML name of an off-switch flag
    (`no_prefix_caching` for `enable_prefix_caching`); at_least: the lower bound checked on every value;
    click_min: also give Typer the bound (checked while parsing); cli_type: the CLI value type where it is
    not the field's; typer: other keyword arguments of `typer.Option`; group: its --help panel (`GROUPS`)."""

    help: str
    show: bool | str = False
    flags: tuple[str, ...] = ()
    negation: str | None = None
    at_least: int | None = None
    click_min: bool = False
    cli_type: Any = None
    typer: tuple[tuple[str, Any], ...] = ()
    group: str = OPTIONS


def option(default: Any, help: str, *flags: str, show: bool | str = False, negation: str | None = None,
           at_least: int | None = None, click_min: bool = False, cli_type: Any = None, group: str = OPTIONS,
           **typer: Any) -> Any:
    """A dataclass field of an options class, declared with its default and its `Spec` (in `metadata["spec"]`)."""
    spec = Spec(help, show, flags, negation, at_least, click_min, cli_type, tuple(typer.items()), group)
    return field(default=default, metadata={"spec": spec})


def spec_of(f: Field) -> Spec | None:
    """The Spec a field of an options class was declared with: by `option`, or for a sampling option (declared by
    `config.SamplingOptions`) by its declaration, in the Sampling panel with its default shown unless unset; None
    for a field without a command line."""
    declared = f.metadata.get("sampling")
    if declared is None or declared.help is None:
        return f.metadata.get("spec")
    return Spec(declared.help, show=f.default is not None, at_least=declared.at_least,
                cli_type=list[str] if "list[str]" in str(f.type) else None, group=SAMPLING)


def base_type(annotation: str) -> str:
    """`int | None` -> `int`: an annotation (a string: `from __future__ import annotations`) less None."""
    return annotation.removesuffix(" | None")


def _engine(help: str, *flags: str, show: bool | str = True, negation: str | None = None) -> Spec:
    return Spec(help, show, flags, negation, group=ENGINE)


# The command line of each EngineConfig field (score, generate, perplexity and eval; a command's CLI_LEAVES_OUT
# names those it leaves out): its --help panel is ENGINE, its place there the field's place in EngineConfig.
ENGINE_OPTIONS: dict[str, Spec] = {
    "device": _engine("auto | cpu | cuda (auto = cuda if available)."),
    "dtype": _engine("auto | float32 | bfloat16 | float16 (auto = float32 on CPU, bfloat16 on CUDA)."),
    "block_size": _engine("Tokens per KV block."),
    "num_kv_blocks": _engine("KV pool size in blocks.", show="from free memory"),
    "max_batch_tokens": _engine("Token budget of one engine step."),
    "max_num_seqs": _engine("Sequences running at once."),
    "enable_prefix_caching": _engine("Turn automatic prefix caching off.", show=False, negation="no_prefix_caching"),
    "max_logprobs": _engine("Cap on --prompt-logprobs / --logprobs."),
    "logprobs_chunk_size": _engine("Rows of the vocabulary projection computed at once."),
    "attention_backend": _engine("auto | torch | triton (auto = triton on CUDA)."),
    "kv_cache_memory_fraction": _engine(
        "Share of memory for the KV pool when --num-kv-blocks is not given (CPU: of free host memory, at most "
        "4 GiB; CUDA: of the GPU's total, after weights and the largest step).", show="0.25 CPU, 0.85 CUDA"),
    "seed": _engine("Sampling seed (per record unless the record sets its own).", show=False),
    "max_model_len": _engine("Cap on the context length in tokens.", show="the model's"),
    "use_cuda_graphs": _engine("Run decode steps on CUDA eagerly instead of replaying captured CUDA graphs.",
                               show=False, negation="no_cuda_graphs"),
    "batch_invariant": _engine("Library GEMMs instead of batch-invariant ones: faster, but a record's last bits "
                               "may then depend on what shares its steps.", show=False,
                               negation="no_batch_invariant"),
    "model_backend": _engine(
        "auto | native | transformers: our decoder (paged KV, prefix cache, batch invariant) or the model's own "
        "transformers code (full recompute, no cache); auto = native where the architecture is supported.",
        "--model-backend", "--backend"),
    "exact_reuse": _engine(
        "Scoring reads cached KV of the blocks before each record's first scored position (shared contexts, "
        "few-shot prefixes computed once); results stay bitwise those of a full recompute. Needs batch "
        "invariance.", show=False),
    "tensor_parallel_size": _engine(
        "Split the model over N ranks (tensor parallelism on torch.distributed: NCCL on CUDA, one GPU per rank; "
        "gloo on the CPU). Results are exact within a degree.", "--tensor-parallel"),
}


def option_name(key: str) -> str:
    """`max_tokens` -> `--max-tokens`; an engine setting declared with flags of its own names its first
    (`tensor_parallel_size` -> `--tensor-parallel`)."""
    spec = ENGINE_OPTIONS.get(key)
    return spec.flags[0] if spec is not None and spec.flags else "--" + key.replace("_", "-")


def in_flags(error: ConfigError, typed: Collection[str]) -> str:
    """The message of an EngineConfig error with each setting it names that the user typed as a flag (`typed`:
    option keys, off-switches too) named by that flag: `block_size` -> `--block-size`, `batch_invariant=False`
    -> `--no-batch-invariant`, `model_backend=transformers` -> `--model-backend transformers`. Settings from a
    config file or from the defaults keep their field names, which are their config keys."""
    flagged = {name for name in error.names if name in typed or ENGINE_OPTIONS[name].negation in typed}
    if not flagged:
        return str(error)

    def flag(match: re.Match) -> str:
        name, value = match.group(1), match.group(2)
        negation = ENGINE_OPTIONS[name].negation
        if value == "False" and negation:
            return option_name(negation)
        return option_name(name) if value in (None, "True") else f"{option_name(name)} {value}"

    return re.sub(rf"\b({'|'.join(sorted(flagged))})\b(?:=(\w+))?", flag, str(error))
