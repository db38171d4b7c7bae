"""Rotary embedding frequencies and cos/sin tables exactly as transformers computes them for a config (every rope
type it knows; Phi-3's long-rope through `longrope_frequencies`)."""

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


def longrope_frequencies(config: Any) -> tuple[RopeFrequencies, RopeFrequencies]:
    """Long-rope (Phi-3): the (short, long) frequencies transformers' rotary embedding switches between.

    transformers computes both with its own `ROPE_INIT_FUNCTIONS["longrope"]`: short as the module's initial
    buffer (no sequence length), long with seq_len original_max_position_embeddings + 1
    (`dynamic_rope_update`'s longrope_frequency_update). The cos/sin scale is the one of the initial call (the
    forward never changes it); it depends only on the config, so both share it.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init = ROPE_INIT_FUNCTIONS["longrope"]
    original_max = int(config.rope_parameters["original_max_position_embeddings"])
    with torch.device("cpu"):
        short, scaling = init(config)
        long, _ = init(config, None, seq_len=original_max + 1)
    return (RopeFrequencies(short.float().clone(), float(scaling)),
            RopeFrequencies(long.float().clone(), float(scaling)))


def rotary_tables(rope: RopeFrequencies, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [num_positions, 2 * len(inv_freq)] fp32 for positions 0 .. num_positions - 1, with the arithmetic of
    transformers' rotary embedding forward (LlamaRotaryEmbedding, Phi3RotaryEmbedding)."""
    positions = torch.arange(num_positions)
    freqs = positions[:, None].float() * rope.inv_freq.float()  # [P, D / 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    return emb.cos() * rope.attention_scaling, emb.sin() * rope.attention_scaling
