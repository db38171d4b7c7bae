"""The context length both engines (the native `Engine` and the transformers fallback) run a model with: the one
context-length rule (`context_length`, an engine's `info.max_model_len`), with the sliding-window cap the native
decoder needs (`capping_window`).
"""

from __future__ import annotations

from typing import Any

from apcscore.config import EngineConfig
from apcscore.errors import ApcscoreError


def _positions(hf_config: Any) -> int | None:
    """The model's own context length: max_position_embeddings, or n_positions (GPT-2 style configs)."""
    return getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", None)


def unmasked_window(hf_config: Any) -> int | None:
    """The config's sliding attention window where it is on (`use_sliding_window`, default true) and shorter
    than the model's positions, else None: what an attention that does not mask the window must cap at."""
    on = getattr(hf_config, "use_sliding_window", True)
    window = getattr(hf_config, "sliding_window", None) if on else None
    positions = _positions(hf_config)
    return window if window and positions and window < positions else None


def context_length(hf_config: Any, config: EngineConfig, window_cap: bool = False) -> int:
    """The engine's context length (its `info.max_model_len`): the least of the model's positions
    (max_position_embeddings, else n_positions), --max-model-len when set, and, with window_cap, the sliding
    window of `unmasked_window`.

    window_cap: for an attention that does not implement the model's sliding window (the native decoder, but
    Gemma's): inside the window full causal attention is the same thing, so the context is capped there and
    longer prompts are refused. The transformers fallback masks the window itself (window_cap=False).
    """
    positions = _positions(hf_config)
    if not positions and not config.max_model_len:
        raise ApcscoreError("the model's config gives no context length (max_position_embeddings); "
                            "pass --max-model-len")
    window = unmasked_window(hf_config) if window_cap else None
    return min(v for v in (positions, window, config.max_model_len) if v)


def capping_window(hf_config: Any, config: EngineConfig, window_cap: bool = True) -> int | None:
    """The sliding window where it (and not --max-model-len) capped `context_length(..., window_cap)`, else
    None (what an engine's `info.sliding_window` and the metadata's context_capped_by_sliding_window record)."""
    window = unmasked_window(hf_config) if window_cap else None
    return window if window and (not config.max_model_len or config.max_model_len > window) else None
