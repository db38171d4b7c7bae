"""What both engines share (apcscore/engine/context.py, counters.py): the one context-length rule gives
each engine the value its own formula gave before (issue 25, item 2); EngineCounters add up field by field."""

from __future__ import annotations

from dataclasses import fields
from types import SimpleNamespace
from typing import Any

import pytest

from apcscore.config import EngineConfig
from apcscore.engine.counters import EngineCounters
from apcscore.engine.context import capping_window, context_length
from apcscore.errors import ApcscoreError


def native_before(hf_config: Any, config: EngineConfig, implements_window: bool) -> tuple[int, int | None]:
    """Engine.from_parts' formula before the shared rule: (max_model_len, recorded sliding_window)."""
    max_len = hf_config.max_position_embeddings
    on = getattr(hf_config, "use_sliding_window", True)
    window = getattr(hf_config, "sliding_window", None) if on else None
    window = window if window and window < max_len else None
    window = None if implements_window else window
    if window:
        max_len = window
    if config.max_model_len:
        max_len = min(max_len, config.max_model_len)
    return max_len, window if window and (not config.max_model_len or config.max_model_len > window) else None


def transformers_before(hf_config: Any, config: EngineConfig) -> int:
    """hf_engine._max_len before the shared rule."""
    max_len = getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", None)
    return min(v for v in (max_len, config.max_model_len) if v)


NATIVE = [  # (config, the decoder implements the sliding window)
    (SimpleNamespace(max_position_embeddings=2048), False),  # Llama
    (SimpleNamespace(max_position_embeddings=4096, sliding_window=1024), False),  # Mistral: capped
    (SimpleNamespace(max_position_embeddings=4096, sliding_window=4096), False),  # window = positions
    (SimpleNamespace(max_position_embeddings=4096, sliding_window=8192), False),  # window past positions
    (SimpleNamespace(max_position_embeddings=4096, sliding_window=None), False),
    (SimpleNamespace(max_position_embeddings=32768, sliding_window=4096, use_sliding_window=False),
     False),  # Qwen2
    (SimpleNamespace(max_position_embeddings=32768, sliding_window=4096, use_sliding_window=True),
     False),
    (SimpleNamespace(max_position_embeddings=8192, sliding_window=512), True),  # Gemma masks its window
]
TRANSFORMERS = [SimpleNamespace(n_positions=1024),
                SimpleNamespace(max_position_embeddings=2048, n_positions=64),
                SimpleNamespace(max_position_embeddings=4096, sliding_window=1024)]
CAPS = [None, 100, 1024, 1025, 4096, 100_000]


@pytest.mark.parametrize("hf_config,implements_window", NATIVE)
@pytest.mark.parametrize("cap", CAPS)
def test_context_length_is_the_native_engines(hf_config, implements_window, cap) -> None:
    config = EngineConfig(max_model_len=cap)
    max_len, window = native_before(hf_config, config, implements_window)
    assert context_length(hf_config, config, window_cap=not implements_window) == max_len
    assert capping_window(hf_config, config, window_cap=not implements_window) == window


@pytest.mark.parametrize("hf_config", TRANSFORMERS + [c for c, _ in NATIVE])
@pytest.mark.parametrize("cap", CAPS)
def test_context_length_is_the_transformers_engines(hf_config, cap) -> None:
    config = EngineConfig(max_model_len=cap)
    assert context_length(hf_config, config) == transformers_before(hf_config, config)
    assert capping_window(hf_config, config, window_cap=False) is None


def test_context_length_needs_a_length() -> None:
    with pytest.raises(ApcscoreError, match="pass --max-model-len"):
        context_length(SimpleNamespace(), EngineConfig())
    assert context_length(SimpleNamespace(), EngineConfig(max_model_len=77)) == 77


def test_counters_add_up_field_by_field() -> None:
    a = EngineCounters.of(EngineCounters(steps=3, prompt_tokens=100, generated_tokens=7, finished=2, errors=1,
                                      preemptions=1, seconds=2.0, queried_tokens=90, hit_tokens=30,
                                      reusable_tokens=12, score_store_hits=5),
                          used_kv_blocks=4, num_kv_blocks=64)
    b = EngineCounters.of(EngineCounters(steps=1, prompt_tokens=20, generated_tokens=3, seconds=0.5))
    total = a + b
    assert all(getattr(total, f.name) == getattr(a, f.name) + getattr(b, f.name) for f in fields(total))
    assert total.score_store_hits == 5 and total.num_kv_blocks == 64 and total.steps == 4
    assert sum([a, b], EngineCounters()) == total
    assert b.queried_tokens == 0 and b.hit_rate == 0.0 and EngineCounters().tokens_per_second == 0.0
    assert a.hit_rate == 30 / 90 and total.tokens_per_second == 130 / 2.5
    with pytest.raises(TypeError):
        a + 1  # noqa: B018
    tally = EngineCounters(steps=1)
    snapshot = EngineCounters.of(tally, 1, 2)
    tally.steps += 1  # the engine counts on; a snapshot is a copy and stays as it was
    assert snapshot.steps == 1 and (snapshot.used_kv_blocks, snapshot.num_kv_blocks) == (1, 2)


def test_counters_give_the_metadata_timings() -> None:
    c = EngineCounters.of(EngineCounters(steps=2, prompt_tokens=10, generated_tokens=4, preemptions=1,
                                      queried_tokens=8, hit_tokens=4, reusable_tokens=2, score_store_hits=1))
    t = c.to_timings(1.5, 3.0)
    assert list(t) == ["load_seconds", "run_seconds", "prompt_tokens", "generated_tokens", "steps",
                       "preemptions", "prefix_cache"]  # the metadata's key order
    assert t["prefix_cache"] == {"queried_tokens": 8, "hit_tokens": 4, "reusable_tokens": 2,
                                 "score_store_hits": 1}
    assert (t["load_seconds"], t["run_seconds"], t["prompt_tokens"], t["steps"]) == (1.5, 3.0, 10, 2)
