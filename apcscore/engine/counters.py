"""`EngineCounters`, an engine's one tally (`Engine.stats`) and the snapshot `Engine.counters()` returns (run
metadata, progress bar, the sum over Ray replicas). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace


@dataclass
class EngineCounters:
    """An engine's counters since it was built; `a + b` adds two up field by field (Ray replicas).

    The prefix cache's fields (queried_tokens .. score_store_hits) are counted by the block manager and scheduler
    (engine/block_manager.py), 0 on the transformers fallback. seconds is the time inside `run` (summed by +, so a
    sum's tokens_per_second is per engine-second). used_kv_blocks / num_kv_blocks: the KV pool at the snapshot
    (`of`; 0 / 0 without one).
    """

    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens prefilled (cache hits excluded)
    generated_tokens: int = 0
    finished: int = 0
    errors: int = 0
    preemptions: int = 0
    queried_tokens: int = 0  # prompt tokens of requests that read the prefix cache
    hit_tokens: int = 0  # of those, tokens served from the cache
    # prompt tokens of scoring requests (recompute mode) that --exact-reuse could have served from the cache:
    # blocks before the first scored position that were cached or being prefilled when the request started
    reusable_tokens: int = 0
    # exact reuse: scored prompt positions whose results came from the score store (engine/score_store.py)
    score_store_hits: int = 0
    seconds: float = 0.0
    used_kv_blocks: int = 0
    num_kv_blocks: int = 0

    @classmethod
    def of(cls, stats: "EngineCounters", used_kv_blocks: int = 0, num_kv_blocks: int = 0) -> "EngineCounters":
        """A snapshot of an engine's running tally, with its KV pool's use now."""
        return replace(stats, used_kv_blocks=used_kv_blocks, num_kv_blocks=num_kv_blocks)

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


