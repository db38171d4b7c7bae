"""Sampling parameters of one generation request."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from apcscore.config import SAMPLING_CHECKS
from apcscore.errors import ApcscoreError

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
        for name, check in SAMPLING_CHECKS.items():
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
