"""Rotary embedding frequencies exactly as transformers computes them for a config (every rope type it knows)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class RopeFrequencies:
    """Rotary inverse frequencies [head_dim / 2] (fp32) and the cos/sin scale, as transformers computes them."""

    inv_freq: torch.Tensor
    attention_scaling: float


def rope_frequencies(config: Any) -> RopeFrequencies | None:
    """transformers' rotary frequencies for config; None for rope types that change with sequence length."""
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if "dynamic" in rope_type or rope_type == "longrope":
        return None
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    with torch.device("cpu"):
        rotary = LlamaRotaryEmbedding(config)
    return RopeFrequencies(rotary.inv_freq.float().clone(), float(rotary.attention_scaling))
