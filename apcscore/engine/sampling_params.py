"""Sampling parameters of one generation request."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from apcscore.errors import ApcscoreError, shown


# ---------------------------------------------------------------- checks (None = fine, else the problem)

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int_at_least_0(v: Any) -> str | None:
    return None if _is_int(v) and v >= 0 else f"must be an integer >= 0, got {shown(v)}"


def _number_at_least_0(v: Any) -> str | None:
    return None if _is_number(v) and v >= 0 else f"must be a number >= 0, got {shown(v)}"


def _probability(v: Any) -> str | None:
    return None if _is_number(v) and 0 < v <= 1 else f"must be a number in (0, 1], got {shown(v)}"


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
# SamplingParams.problems() and by the generate record schema (apcscore.io.schemas).
RECORD_FIELDS: dict[str, Check] = {
    "max_tokens": _int_at_least_0,
    "temperature": _number_at_least_0,
    "top_p": _probability,
    "top_k": _int_at_least_0,
    "seed": _any_int,
    "stop": _stop,
}
_CHECKS: dict[str, Check] = {**RECORD_FIELDS, "logprobs": _int_at_least_0}
_UNSET_ALLOWED = ("seed", "logprobs")
GREEDY_BELOW = 1e-5  # temperatures below this sample greedily  # None = no seed, no logprobs


@dataclass(frozen=True)
class SamplingParams:
    """How to sample a completion. `temperature == 0` is greedy; `top_k == 0` and `top_p == 1` are off.

    `seed` makes a sampled completion reproducible whatever else is in the batch. `logprobs` asks for the
    sampled tokens' logprobs (0 = the token's own logprob and rank, K > 0 adds the top-K).

    A temperature below GREEDY_BELOW (1e-5, vLLM's `_SAMPLING_EPS`) is greedy: dividing logits by it can
    overflow to inf (NaN probabilities), and the distribution is the argmax anyway but for exact ties.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ApcscoreError("; ".join(problems))
        if 0 < self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)

    def problems(self) -> list[str]:
        """Everything wrong with these values, as messages a user can act on."""
        out = []
        for name, check in _CHECKS.items():
            value = getattr(self, name)
            if value is None and name in _UNSET_ALLOWED:
                continue
            why = check(value)
            if why is not None:
                out.append(f"{name} {why}")
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        return d
