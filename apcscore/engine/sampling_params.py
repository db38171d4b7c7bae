"""Sampling parameters of one generation request."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from apcscore.errors import ApcscoreError


@dataclass(frozen=True)
class SamplingParams:
    """How to sample a completion. `temperature == 0` is greedy; `top_k == 0` and `top_p == 1` are off.

    `seed` makes a sampled completion reproducible whatever else is in the batch. `logprobs` asks for the
    sampled tokens' logprobs (0 = the token's own logprob and rank, K > 0 adds the top-K).
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

    def problems(self) -> list[str]:
        """Everything wrong with these values, as messages a user can act on."""
        out = []
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            out.append(f"max_tokens must be an integer >= 0, not {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            out.append(f"temperature must be a number >= 0, not {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            out.append(f"top_p must be in (0, 1], not {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            out.append(f"top_k must be an integer >= 0 (0 = off), not {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            out.append(f"seed must be an integer, not {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            out.append(f"logprobs must be an integer >= 0, not {self.logprobs!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            out.append(f"stop must be a list of non-empty strings, not {list(self.stop)!r}")
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        return d
