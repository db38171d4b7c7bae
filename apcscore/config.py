"""Engine configuration: one frozen dataclass, validated on construction; and `option`, the declaration of a
setting (default, help text, CLI flags, checks) that EngineConfig and the run options (options/commands.py) share.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import Field, asdict, dataclass, field, fields
from typing import Any

from apcscore.errors import ApcscoreError, shown

MAX_LOGPROBS_DEFAULT = 20
NOT_GIVEN: Any = ...  # `option(NOT_GIVEN, ...)`: a field without a default (a required CLI option)


@dataclass(frozen=True)
class Spec:
    """How one setting is declared on the command line and checked.

    help: the --help text; show: append `[default: X]`, X the field's default (True) or this text (a str).
    flags: the CLI names (default `--name-with-dashes`); negation: the CLI/TOML name of an off-switch flag
    (`no_prefix_caching` for `enable_prefix_caching`); at_least: the lower bound checked on every value;
    click_min: also give Typer the bound (checked while parsing); cli_type: the CLI value type where it is
    not the field's; typer: other keyword arguments of `typer.Option`."""

    help: str
    show: bool | str = False
    flags: tuple[str, ...] = ()
    negation: str | None = None
    at_least: int | None = None
    click_min: bool = False
    cli_type: Any = None
    typer: tuple[tuple[str, Any], ...] = ()


def option(default: Any, help: str, *flags: str, show: bool | str = False, negation: str | None = None,
           at_least: int | None = None, click_min: bool = False, cli_type: Any = None, **typer: Any) -> Any:
    """A dataclass field declared with its default and its `Spec` (in `metadata["spec"]`)."""
    spec = Spec(help, show, flags, negation, at_least, click_min, cli_type, tuple(typer.items()))
    if default is NOT_GIVEN:
        return field(metadata={"spec": spec})
    return field(default=default, metadata={"spec": spec})


def spec_of(f: Field) -> Spec | None:
    """The Spec a field was declared with (None for a field declared without `option`)."""
    return f.metadata.get("spec")


def base_type(annotation: str) -> str:
    """`int | None` -> `int`: an annotation (a string: `from __future__ import annotations`) less None."""
    return annotation.removesuffix(" | None")


@dataclass(frozen=True)
class EngineConfig:
    """Settings of the batch engine. Every field has a CLI option of the same name (dashes for underscores) on
    score, generate and perplexity (`seed` on generate only), and a key of the same name in a `--config` file;
    the switches that default to on are turned off with --no-prefix-caching, --no-cuda-graphs and
    --no-batch-invariant (also keys of a `--config` file)."""

    device: str = option("auto", "auto | cpu | cuda (auto = cuda if available).", show=True)
    dtype: str = option("auto", "auto | float32 | bfloat16 | float16 (auto = float32 on CPU, bfloat16 on "
                        "CUDA).", show=True)
    block_size: int = option(16, "Tokens per KV block.", show=True)
    # None = derived from available memory
    num_kv_blocks: int | None = option(None, "KV pool size in blocks.", show="from free memory")
    # token budget of one engine step (prefill chunks + decodes)
    max_batch_tokens: int = option(2048, "Token budget of one engine step.", show=True)
    max_num_seqs: int = option(64, "Sequences running at once.", show=True)
    enable_prefix_caching: bool = option(True, "Turn automatic prefix caching off.",
                                         negation="no_prefix_caching")
    max_logprobs: int = option(MAX_LOGPROBS_DEFAULT, "Cap on --prompt-logprobs / --logprobs.", show=True)
    logprobs_chunk_size: int = option(1024, "Rows of the vocabulary projection computed at once.", show=True)
    attention_backend: str = option("auto", "auto | torch | triton (auto = triton on CUDA).", show=True)
    # share of memory for the KV pool when num_kv_blocks is None (None: 0.25 of free host memory, at most
    # 4 GiB, on CPU; on CUDA 0.85 of the card's total, minus the peak of a profile run of the largest step)
    kv_cache_memory_fraction: float | None = option(
        None, "Share of memory for the KV pool when --num-kv-blocks is not given (CPU: of free host memory, "
        "at most 4 GiB; CUDA: of the GPU's total, after weights and the largest step).",
        show="0.25 CPU, 0.85 CUDA")
    # base seed for requests that do not set their own
    seed: int = option(0, "Sampling seed (per record unless the record sets its own).")
    max_model_len: int | None = option(None, "Cap on the context length in tokens.", show="the model's")
    use_cuda_graphs: bool = option(True, "Run decode steps on CUDA eagerly instead of replaying captured CUDA "
                                   "graphs.", negation="no_cuda_graphs")
    # a record's results do not depend on what shares its steps (docs/architecture.md); False trades it for speed
    batch_invariant: bool = option(True, "Library GEMMs instead of batch-invariant ones: faster, but a "
                                   "record's last bits may then depend on what shares its steps.",
                                   negation="no_batch_invariant")
    # auto | native | transformers: our decoder (paged KV, prefix cache, batch invariance) or the model's own
    # transformers forward and generate() (full recompute, no cache); auto = native where it implements the
    # architecture, else transformers (apcscore.models.architecture.choose_model_backend)
    model_backend: str = option(
        "auto", "auto | native | transformers: our decoder (paged KV, prefix cache, batch invariant) or the "
        "model's own transformers code (full recompute, no cache); auto = native where the architecture is "
        "supported.", "--model-backend", "--backend", show=True)
    # scoring requests read cached KV of the blocks before their first scored position (needs batch_invariant:
    # then the results are bitwise those of a full recompute, docs/architecture.md "Exact reuse")
    exact_reuse: bool = option(
        False, "Scoring reads cached KV of the blocks before each record's first scored position (shared "
        "contexts, few-shot prefixes computed once); results stay bitwise those of a full recompute. Needs "
        "batch invariance.")
    # ranks one model is split over (engine/parallel/ranks.py); 1 = one device, the plain single-process engine
    tensor_parallel_size: int = option(
        1, "Split the model over N ranks (tensor parallelism on torch.distributed: NCCL on CUDA, one GPU per rank; "
        "gloo on the CPU). Results are exact within a degree.", "--tensor-parallel",
        show=True, at_least=1)

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ApcscoreError(msg)

        for f in fields(self):  # types first, so that the range checks below cannot raise TypeError
            value, kinds = getattr(self, f.name), _kinds(str(f.type))
            need((value is None and type(None) in kinds) or
                 (isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)),
                 f"--{f.name.replace('_', '-')} must be {_WHAT[kinds]}, not {shown(value)}")
            if float in kinds and (why := finite_problem(value)) is not None:
                raise ApcscoreError(f"--{f.name.replace('_', '-')} {why}")

        need(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
             f"--device must be auto, cpu or cuda, not {self.device!r}")
        need(self.dtype in ("auto", "float32", "bfloat16", "float16"),
             f"--dtype must be auto, float32, bfloat16 or float16, not {self.dtype!r}")
        need(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
             f"--block-size must be a power of two, not {self.block_size}")
        need(self.num_kv_blocks is None or self.num_kv_blocks >= 1,
             f"--num-kv-blocks must be at least 1, not {self.num_kv_blocks}")
        need(self.max_model_len is None or self.max_model_len >= 1,
             f"--max-model-len must be at least 1 (tokens), not {self.max_model_len}; leave it out for the model's "
             "own context length")
        need(self.max_batch_tokens >= 1, f"--max-batch-tokens must be at least 1, not {self.max_batch_tokens}")
        need(self.max_num_seqs >= 1, f"--max-num-seqs must be at least 1, not {self.max_num_seqs}")
        need(self.max_logprobs >= 0, f"--max-logprobs must be >= 0, not {self.max_logprobs}")
        need(self.logprobs_chunk_size >= 1, f"--logprobs-chunk-size must be at least 1, not {self.logprobs_chunk_size}")
        need(self.attention_backend in ("auto", "torch", "triton"),
             f"--attention-backend must be auto, torch or triton, not {self.attention_backend!r}")
        need(self.model_backend in ("auto", "native", "transformers"),
             f"--model-backend must be auto, native or transformers, not {self.model_backend!r}")
        need(self.tensor_parallel_size >= 1,
             f"--tensor-parallel must be at least 1, not {self.tensor_parallel_size}")
        need(self.tensor_parallel_size == 1 or self.model_backend != "transformers",
             f"--tensor-parallel {self.tensor_parallel_size} needs the native engine: the transformers fallback "
             "(--model-backend transformers) runs on one device — drop one of the two")
        need(self.kv_cache_memory_fraction is None or 0 < self.kv_cache_memory_fraction <= 0.95,
             f"--kv-cache-memory-fraction must be in (0, 0.95], not {self.kv_cache_memory_fraction}")
        need(not self.exact_reuse or self.batch_invariant,
             "--exact-reuse needs batch invariance: without it a cached block's KV is not bitwise what a fresh "
             "prefill writes, so reused scores could differ from a full recompute — drop --no-batch-invariant "
             "(or --exact-reuse)")
        need(not self.exact_reuse or self.enable_prefix_caching,
             "--exact-reuse reads the prefix cache, which --no-prefix-caching turns off — drop one of the two")

    def check_logprobs(self, k: int | None, option: str) -> None:
        """Refuse a top-K request above `max_logprobs` with a message that says how to raise the cap."""
        if k is None:
            return
        if k < 0:
            raise ApcscoreError(f"{option} must be >= 0, not {k}")
        if k > self.max_logprobs:
            raise ApcscoreError(
                f"{option} {k} is above the cap max_logprobs = {self.max_logprobs}; "
                f"ask for at most {self.max_logprobs}, or raise the cap with --max-logprobs {k}"
            )

    def to_dict(self) -> dict:
        """The settings as a plain dict (the run metadata's `engine`)."""
        return asdict(self)


def _kinds(annotation: str) -> tuple[type, ...]:
    """The types a field of this annotation takes (a float setting takes an int too)."""
    kinds = {"str": (str,), "int": (int,), "bool": (bool,), "float": (int, float)}[base_type(annotation)]
    return (*kinds, type(None)) if annotation.endswith(" | None") else kinds


_WHAT = {(str,): "a string", (int,): "an integer", (int, type(None)): "an integer or unset",
         (bool,): "true or false", (int, float, type(None)): "a number or unset"}


# ---------------------------------------------------------------- checks (None = fine, else the problem)

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """An int or a float, not a bool (finite or not: `finite_problem` says)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def finite_problem(v: Any) -> str | None:
    """Why the number `v` is not finite (NaN, an infinity, an integer beyond a float's range), else None (None for a
    value that is no number too: the type checks say that). The one check of every number a record, an option or
    a config file gives for a number setting (docs/errors.md: NaN and infinity are errors)."""
    if not is_number(v):
        return None
    try:
        if math.isfinite(v):
            return None
        what = "NaN" if math.isnan(v) else "infinity" if v > 0 else "-infinity"
    except OverflowError:  # an int too large for a float
        what = f"{shown(v)}, beyond a float's range"
    return (f"must be a finite number, not {what} (NaN and infinity are errors; a number beyond ±1.8e308, such "
            "as 1e400, reads as infinity)")


def _int_at_least_0(v: Any) -> str | None:
    return None if _is_int(v) and v >= 0 else f"must be an integer >= 0, got {shown(v)}"


def _number_at_least_0(v: Any) -> str | None:
    return finite_problem(v) or (None if is_number(v) and v >= 0 else f"must be a number >= 0, got {shown(v)}")


def _probability(v: Any) -> str | None:
    return finite_problem(v) or (None if is_number(v) and 0 < v <= 1 else f"must be a number in (0, 1], got {shown(v)}")


def _any_int(v: Any) -> str | None:
    return None if _is_int(v) else f"must be an integer, got {shown(v)}"


def _stop(v: Any) -> str | None:
    if isinstance(v, str):
        return None if v else "must not be an empty string"
    if isinstance(v, (list, tuple)) and all(isinstance(s, str) and s for s in v):
        return None
    return f"must be a non-empty string or a list of non-empty strings, got {shown(v)}"


Check = Callable[[Any], "str | None"]

# The sampling options a generate record may set for itself, and how each is checked: declared once, used by
# SamplingParams (engine/sampling_params.py), by generate's options and by the generate record schema
# (io/schemas.py). They live here, below every package, so that io needs no engine.
RECORD_FIELDS: dict[str, Check] = {
    "max_tokens": _int_at_least_0,
    "temperature": _number_at_least_0,
    "top_p": _probability,
    "top_k": _int_at_least_0,
    "seed": _any_int,
    "stop": _stop,
}
# and what SamplingParams checks besides
SAMPLING_CHECKS: dict[str, Check] = {**RECORD_FIELDS, "logprobs": _int_at_least_0}
