"""The engine's settings: `EngineConfig`, one frozen dataclass checked on construction, whose errors name its
fields (`block_size must be a power of two`); each field also says how it enters a run's identity (`Identity`,
read by io/identity.py). No command line here: the flags, help text and --help groups of these settings are the
options' (options/specs.py), which also put a config error in the flags the user typed.

And a request's sampling settings, each declared once (`SamplingOptions`, `SamplingParams`: default, check, help
text, whether a record may set it), below every package: generate's options, the record checks of io/ and the
engine's SamplingParams all read the one declaration. The checks of numbers records, options and configs share.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from apcscore.errors import ApcscoreError, shown


class ConfigError(ApcscoreError):
    """An EngineConfig value no run can use. `names`: the settings the message names (as field names, a switch's
    value as `name=False`), so that the command line can name them by the flags the user typed."""

    def __init__(self, message: str, *names: str) -> None:
        super().__init__(message)
        self.names = names


@dataclass(frozen=True)
class Identity:
    """How a setting enters a run's identity (io/identity.py, docs/architecture.md "A run's identity").

    why: why it changes bits or rows (compared), or why it cannot (`compared=False`: recorded, never compared);
    result_files_only: compared by the result files' views (resume, merge, Ray), left out of the eval cache's key;
    unless_invariant: dropped where the start-up probe found the engine batch-invariant (schedule and reuse)."""

    why: str
    compared: bool = True
    result_files_only: bool = False
    unless_invariant: bool = False


def setting(default: Any, identity: Identity) -> Any:
    """An EngineConfig field: its default and its part in a run's identity (in `metadata["identity"]`)."""
    return field(default=default, metadata={"identity": identity})


_SCHEDULE = ("which requests share a step: a library GEMM's bits change with the row count (dropped where the "
             "probe passed: the contract is any budget, any batch)")
_REUSE = ("a prefix-cache or score-store hit serves values computed in another step (dropped where the probe "
          "passed: a hit is then bitwise a recompute; exact reuse is refused where it failed)")


def _typed(resolved: str) -> Identity:
    return Identity(f"what was typed; the resolved `{resolved}` is compared", compared=False)


@dataclass(frozen=True)
class EngineConfig:
    """Settings of the batch engine; every value is checked on construction (`ConfigError`). What a setting
    does: its --help text (options/specs.ENGINE_OPTIONS), and where that cannot say it all, a comment here."""

    device: str = setting("auto", _typed("device"))  # auto | cpu | cuda | cuda:N (auto = cuda if available)
    dtype: str = setting("auto", _typed("dtype"))  # auto | float32 | bfloat16 | float16 (auto: float32 on CPU)
    block_size: int = setting(16, Identity("the KV blocks that prefix caching and the --shard split count in"))
    num_kv_blocks: int | None = setting(None, Identity(
        "the KV pool's size (auto-sized from free memory): a request's blocks hold the same KV", compared=False))
    max_batch_tokens: int = setting(2048, Identity(_SCHEDULE, unless_invariant=True))
    max_num_seqs: int = setting(64, Identity(_SCHEDULE, unless_invariant=True))
    enable_prefix_caching: bool = setting(True, Identity(_REUSE, unless_invariant=True))
    max_logprobs: int = setting(20, Identity(
        "a record asking for more top-K fails: other rows (an eval request asks for its own k, in its key)",
        result_files_only=True))
    logprobs_chunk_size: int = setting(1024, Identity(
        "the LM head's row count per call (schedule-like, dropped where the probe passed; the eval cache leaves "
        "it out: it is sized to fit memory)", result_files_only=True, unless_invariant=True))
    attention_backend: str = setting("auto", _typed("attention_backend"))  # auto | torch | triton
    # share of memory for the KV pool when num_kv_blocks is None (None: 0.25 of free host memory, at most
    # 4 GiB, on CPU; on CUDA 0.85 of the card's total, minus the peak of a profile run of the largest step)
    kv_cache_memory_fraction: float | None = setting(None, Identity("as num_kv_blocks", compared=False))
    seed: int = setting(0, Identity("each record's sampling seed derives from it (an eval request's seed is in "
                                    "its key)", result_files_only=True))
    max_model_len: int | None = setting(None, Identity(
        "which records fit and how they are truncated (an eval request's tokens after truncation are its key)",
        result_files_only=True))
    use_cuda_graphs: bool = setting(True, Identity(
        "a graph replays the kernels an eager step runs, with the same arguments", compared=False))
    # a record's results do not depend on what shares its steps (docs/architecture.md); False trades it for speed
    batch_invariant: bool = setting(True, Identity(
        "what was asked; the probe's verdict (numerics.batch_invariant) and the construction (numerics.linear) "
        "are compared", compared=False))
    # auto | native | transformers: our decoder (paged KV, prefix cache, batch invariance) or the model's own
    # transformers forward and generate() (full recompute, no cache); auto = native where it implements the
    # architecture, else transformers (apcscore.models.architecture.choose_model_backend)
    model_backend: str = setting("auto", _typed("model_backend"))
    # scoring requests read cached KV of the blocks before their first scored position (needs batch_invariant:
    # then the results are bitwise those of a full recompute, docs/architecture.md "Exact reuse")
    exact_reuse: bool = setting(False, Identity(_REUSE, unless_invariant=True))
    # ranks one model is split over (engine/parallel/ranks.py); 1 = one device, the plain single-process engine
    tensor_parallel_size: int = setting(1, Identity("the reductions across ranks (exact within a degree only)"))

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str, *names: str) -> None:
            if not cond:
                raise ConfigError(msg, *names)

        for f in fields(self):  # types first, so that the range checks below cannot raise TypeError
            value, kind = getattr(self, f.name), str(f.type).removesuffix(" | None")
            optional = kind != str(f.type)
            what, test = TYPE_CHECKS[kind]
            need((value is None and optional) or test(value),
                 f"{f.name} must be {what}{' or unset' if optional else ''}, not {shown(value)}", f.name)
            if kind == "float" and (why := finite_problem(value)) is not None:
                raise ConfigError(f"{f.name} {why}", f.name)

        need(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
             f"device must be auto, cpu or cuda, not {self.device!r}", "device")
        need(self.dtype in ("auto", "float32", "bfloat16", "float16"),
             f"dtype must be auto, float32, bfloat16 or float16, not {self.dtype!r}", "dtype")
        need(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
             f"block_size must be a power of two, not {self.block_size}", "block_size")
        for name in ("num_kv_blocks", "max_batch_tokens", "max_num_seqs", "logprobs_chunk_size",
                     "tensor_parallel_size"):
            value = getattr(self, name)
            need(value is None or value >= 1, f"{name} must be at least 1, not {value}", name)
        need(self.max_model_len is None or self.max_model_len >= 1,
             f"max_model_len must be at least 1 (tokens), not {self.max_model_len}; leave it out for the model's "
             "own context length", "max_model_len")
        need(self.max_logprobs >= 0, f"max_logprobs must be >= 0, not {self.max_logprobs}", "max_logprobs")
        need(self.attention_backend in ("auto", "torch", "triton"),
             f"attention_backend must be auto, torch or triton, not {self.attention_backend!r}", "attention_backend")
        need(self.model_backend in ("auto", "native", "transformers"),
             f"model_backend must be auto, native or transformers, not {self.model_backend!r}", "model_backend")
        need(self.tensor_parallel_size == 1 or self.model_backend != "transformers",
             f"tensor_parallel_size={self.tensor_parallel_size} needs the native engine: the transformers fallback "
             "(model_backend=transformers) runs on one device — drop one of the two", "tensor_parallel_size",
             "model_backend")
        need(self.kv_cache_memory_fraction is None or 0 < self.kv_cache_memory_fraction <= 0.95,
             f"kv_cache_memory_fraction must be in (0, 0.95], not {self.kv_cache_memory_fraction}",
             "kv_cache_memory_fraction")
        need(not self.exact_reuse or self.batch_invariant,
             "exact_reuse needs batch invariance: without it a cached block's KV is not bitwise what a fresh "
             "prefill writes, so reused scores could differ from a full recompute — drop batch_invariant=False "
             "(or exact_reuse=True)", "exact_reuse", "batch_invariant")
        need(not self.exact_reuse or self.enable_prefix_caching,
             "exact_reuse reads the prefix cache, which enable_prefix_caching=False turns off — drop one of the "
             "two", "exact_reuse", "enable_prefix_caching")

    def to_dict(self) -> dict:
        """The settings as a plain dict (the run metadata's `engine`)."""
        return asdict(self)


# ---------------------------------------------------------------- checks (None = fine, else the problem)

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """An int or a float, not a bool (finite or not: `finite_problem` says)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# a setting's type (its annotation less `| None`) -> (what a value must be, its test); a float setting takes an int
TYPE_CHECKS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "int": ("an integer", _is_int),
    "float": ("a number", is_number),
}


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


# ---------------------------------------------------------------- sampling: each setting declared once

@dataclass(frozen=True)
class SamplingOption:
    """How a sampling setting is checked and given (in its field's `metadata["sampling"]`).

    check: the one check of its values (records, options, SamplingParams; None passes where it is the default);
    help: its flag's --help text on generate's Sampling panel (None: no flag); per_record: a generate record
    (JSONL, CSV, OpenAI Batch body) may set it for itself; at_least: its flag's lower bound, for a setting no
    record has (the options layer checks it)."""

    check: Check
    help: str | None = None
    per_record: bool = True
    at_least: int | None = None


def sampling(default: Any, check: Check, help: str | None = None, *, per_record: bool = True,
             at_least: int | None = None) -> Any:
    """A field of SamplingOptions or SamplingParams: its default and its declaration (`SamplingOption`)."""
    return field(default=default, metadata={"sampling": SamplingOption(check, help, per_record, at_least)})


@dataclass(frozen=True, kw_only=True)
class SamplingOptions:
    """The sampling settings a user gives: generate's options (options/commands.py, the defaults of the records
    that do not set their own) and the first fields of SamplingParams. A field declared here is a whole option:
    its flag (its default shown unless unset), its config key, its record field of every input format, the same
    check everywhere, its value in each record's SamplingParams; then only its consumers (engine/sampler.py, and
    the transformers fallback's generate() arguments in engine/hf_engine.py)."""

    max_tokens: int = sampling(16, _int_at_least_0, "Most tokens to generate.")
    temperature: float = sampling(0.0, _number_at_least_0, "0 = greedy.")
    top_p: float = sampling(1.0, _probability, "Nucleus sampling mass.")
    top_k: int = sampling(0, _int_at_least_0, "Sample among the K most likely (0 = off).")
    stop: str | list[str] | None = sampling(None, _stop, "Stop string (repeatable); not included in the completion.")
    logprobs: int | None = sampling(None, _int_at_least_0, "Logprobs of the sampled tokens with top-K alternatives.",
                                    per_record=False, at_least=0)


GREEDY_BELOW = 1e-5  # temperatures below this sample greedily


@dataclass(frozen=True, kw_only=True)
class SamplingParams(SamplingOptions):
    """How to sample a completion. `temperature == 0` is greedy; `top_k == 0` and `top_p == 1` are off.

    `seed` makes a sampled completion reproducible whatever else is in the batch. `logprobs` asks for the
    sampled tokens' logprobs (0 = the token's own logprob and rank, K > 0 adds the top-K). `stop`: a string or
    several, held as a tuple.

    A temperature below GREEDY_BELOW (1e-5, vLLM's `_SAMPLING_EPS`) is greedy: dividing logits by it can
    overflow to inf (NaN probabilities), and the distribution is the argmax anyway but for exact ties.
    """

    seed: int | None = sampling(None, _any_int)  # a record's own; generate's flag is the engine's base --seed
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ApcscoreError("; ".join(problems))
        if 0 < self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)

    def problems(self) -> list[str]:
        """Everything wrong with these values, as messages a user can act on."""
        out = []
        for f in fields(self):
            value = getattr(self, f.name)
            if "sampling" in f.metadata and (value is not None or f.default is not None):  # None: unset
                if (why := f.metadata["sampling"].check(value)) is not None:
                    out.append(f"{f.name} {why}")
        return out


# The sampling settings a generate record may set for itself, and the check of each: used by generate's options,
# the generate record schema (io/schemas.py), OpenAI Batch bodies (io/openai_batch.py) and CSV cells
# (io/tabular_input.py), which need no engine.
_PER_RECORD = [f for f in fields(SamplingParams) if "sampling" in f.metadata and f.metadata["sampling"].per_record]
RECORD_FIELDS: dict[str, Check] = {f.name: f.metadata["sampling"].check for f in _PER_RECORD}
# what a CSV cell of a sampling field is read as (io/tabular_input.py): a number field's type
RECORD_NUMBERS: dict[str, type] = {f.name: {"int": int, "float": float}[kind] for f in _PER_RECORD
                                   if (kind := str(f.type).removesuffix(" | None")) in ("int", "float")}
