"""What both engines (the native `Engine` and the transformers fallback) share about the model they run.

- `ModelInfo`: what the run metadata records about the model;
- `context_length`: the one context-length rule (`max_model_len`), with the sliding-window cap the native
  decoder needs (`capping_window`);
- the device and dtype of a run: `resolve_device`, `resolve_dtype`, `DTYPES`, `check_backend_device`;
- the stop rule of a completion: `stop_tokens` (end-of-sequence and stop token ids) and `stop_string_cut`
  (stop strings, through the incremental detokenizer).

The engines' counters are in `apcscore.engine.counters` (torch-free).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from apcscore.config import EngineConfig
from apcscore.engine.detokenizer import IncrementalDetokenizer, find_stop
from apcscore.engine.sampling_params import SamplingParams
from apcscore.errors import ApcscoreError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelInfo:
    """What the run metadata records about the model."""

    name: str
    path: str
    architecture: str
    vocab_size: int
    max_model_len: int
    fingerprint: str
    num_parameters: int
    # the model's sliding attention window where it capped max_model_len (the window itself is not
    # implemented: inside it, full causal attention is the same thing), else None
    sliding_window: int | None = None


# ---- context length ---------------------------------------------------------------------------------
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
    """The engine's context length (`ModelInfo.max_model_len`): the least of the model's positions
    (max_position_embeddings, else n_positions), --max-model-len when set, and, with window_cap, the sliding
    window of `unmasked_window`.

    window_cap: for an attention that does not implement the model's sliding window (the native decoder, but
    Gemma's): inside the window full causal attention is the same thing, so the context is capped there and
    longer prompts are refused. The transformers fallback masks the window itself (window_cap=False).
    A clear error when neither the model nor --max-model-len gives a length.
    """
    positions = _positions(hf_config)
    if not positions and not config.max_model_len:
        raise ApcscoreError("the model's config gives no context length (max_position_embeddings); "
                            "pass --max-model-len")
    window = unmasked_window(hf_config) if window_cap else None
    return min(v for v in (positions, window, config.max_model_len) if v)


def capping_window(hf_config: Any, config: EngineConfig, window_cap: bool = True) -> int | None:
    """The sliding window where it (and not --max-model-len) capped `context_length(..., window_cap)`, else
    None (what `ModelInfo.sliding_window` and the metadata's context_capped_by_sliding_window record)."""
    window = unmasked_window(hf_config) if window_cap else None
    return window if window and (not config.max_model_len or config.max_model_len > window) else None


# ---- device and dtype ---------------------------------------------------------------------------------
def resolve_device(device: str) -> torch.device:
    """The torch device of --device (auto: CUDA when available, else the CPU); an error for CUDA without
    one."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ApcscoreError("--device cuda was asked for, but no CUDA device is available; use --device cpu")
    return torch.device(device)


def check_backend_device(config: EngineConfig) -> None:
    """Refuse --attention-backend triton where no GPU runs it (the Triton interpreter, for tests,
    excepted)."""
    if config.attention_backend == "triton" and resolve_device(config.device).type != "cuda" \
            and os.environ.get("TRITON_INTERPRET") != "1":
        raise ApcscoreError("--attention-backend triton needs a CUDA GPU, and this run is on the CPU — use "
                            "--attention-backend torch (or auto, which picks torch on a CPU)")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The torch dtype of --dtype (auto: bfloat16 on CUDA, float32 on the CPU)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[dtype]


# ---- the stop rule ------------------------------------------------------------------------------------
def stop_tokens(params: SamplingParams, eos_token_ids: set[int]) -> set[int]:
    """The token ids that end a completion: its stop_token_ids, and the model's end-of-sequence ids unless
    ignore_eos. The stopping token is part of the completion (finish reason "stop")."""
    return set(params.stop_token_ids) | (set() if params.ignore_eos else eos_token_ids)


def stop_string_cut(detokenizer: IncrementalDetokenizer, token_ids: list[int], prompt_len: int,
                    stop: tuple[str, ...]) -> int | None:
    """Where the completion's text ends at its first stop string, or None: decodes only the new tokens' window
    (engine/detokenizer.py), so a whole completion costs O(n). token_ids: prompt and completion so far."""
    searched = len(detokenizer.text)
    detokenizer.update(token_ids, start=prompt_len)
    return find_stop(detokenizer.text, stop, searched)
