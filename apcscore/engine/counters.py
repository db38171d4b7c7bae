"""The engines' counters: `EngineStats` (what an engine counts as it runs) and `EngineCounters` (the snapshot
`Engine.counters()` returns: run metadata, progress bar, the sum over Ray replicas). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

# the fields of block_manager.PrefixCacheStats
_PREFIX_CACHE = ("queried_tokens", "hit_tokens", "reusable_tokens", "score_store_hits")


@dataclass
class EngineStats:
    """What an engine counts as it runs (the prefix cache's counters are the block manager's)."""

    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens prefilled (cache hits excluded)
    generated_tokens: int = 0
    finished: int = 0
    errors: int = 0
    preemptions: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class EngineCounters:
    """An engine's counters since it was built; `a + b` adds two up field by field (Ray replicas).

    steps .. preemptions: EngineStats'. queried_tokens .. score_store_hits: the prefix cache's
    (block_manager.PrefixCacheStats; 0 on the transformers fallback). seconds: time inside `run` (summed by +,
    so a sum's tokens_per_second is per engine-second). used_kv_blocks / num_kv_blocks: the KV pool now (0 / 0
    without one).
    """

    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    finished: int = 0
    errors: int = 0
    preemptions: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    reusable_tokens: int = 0
    score_store_hits: int = 0
    seconds: float = 0.0
    used_kv_blocks: int = 0
    num_kv_blocks: int = 0

    @classmethod
    def of(cls, stats: EngineStats, prefix_cache: Any = None, used_kv_blocks: int = 0,
           num_kv_blocks: int = 0) -> "EngineCounters":
        """The snapshot of an engine's stats and its prefix cache's (a PrefixCacheStats, or None)."""
        pc = {k: getattr(prefix_cache, k) for k in _PREFIX_CACHE} if prefix_cache is not None else {}
        return cls(steps=stats.steps, prompt_tokens=stats.prompt_tokens,
                   generated_tokens=stats.generated_tokens, finished=stats.finished, errors=stats.errors,
                   preemptions=stats.preemptions, seconds=stats.seconds, used_kv_blocks=used_kv_blocks,
                   num_kv_blocks=num_kv_blocks, **pc)

    def __add__(self, other: "EngineCounters") -> "EngineCounters":
        if not isinstance(other, EngineCounters):
            return NotImplemented
        return EngineCounters(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                                 for f in fields(self)})

    @property
    def tokens_per_second(self) -> float:
        """Prompt tokens prefilled and tokens generated per second inside `run`."""
        return (self.prompt_tokens + self.generated_tokens) / self.seconds if self.seconds else 0.0

    @property
    def hit_rate(self) -> float:
        """The share of the queried prompt tokens that the prefix cache served."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def to_timings(self, load_seconds: float, run_seconds: float) -> dict:
        """The run metadata's `timings` of one session (run/metadata.add_timings then rounds them and adds
        the rates)."""
        return {"load_seconds": load_seconds, "run_seconds": run_seconds,
                "prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
                "steps": self.steps, "preemptions": self.preemptions,
                "prefix_cache": {"queried_tokens": self.queried_tokens, "hit_tokens": self.hit_tokens,
                                 "reusable_tokens": self.reusable_tokens,
                                 "score_store_hits": self.score_store_hits}}
