"""Our Phi-3 decoder: the Llama decoder (apcscore.models.llama) fed Phi-3's fused weights, with long-rope scaling
and partial rotary (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini).

Phi-3 is Llama-shaped: its checkpoint stores q/k/v as one `qkv_proj` ([q | k | v] rows, the order our fused
projection uses) and gate/up as one `gate_up_proj` ([gate | up]), so each loads as it is.

Long-rope (`rope_type` "longrope"): a sequence of at most M = `original_max_position_embeddings` tokens is
rotated with the short frequencies everywhere, a longer one with the long ones everywhere, as transformers'
forward and generate() compute it (the rule and how the engine keeps it: docs/decisions.md, "Long-rope"). The
decoder keeps both tables in one: rows [0, M) short, rows [M, M + max_positions) long; a long sequence's positions
arrive offset by M (`long_rope_after`, apcscore.engine.step_inputs). The cos/sin scale (attention_factor) is the
same for both.

Partial rotary (`partial_rotary_factor` < 1): the first R = head_dim x factor dimensions of each head are
rotated, the rest pass through (the Llama attention's partial branch).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import nn

from apcscore.models.architecture import rope_parameters
from apcscore.models.ops import Ops
from apcscore.models.llama import Device, LlamaDecoder
from apcscore.models.rope import longrope_frequencies, portable_math, rotary_tables


class Phi3Decoder(LlamaDecoder):
    """Phi3ForCausalLM: LlamaDecoder with the fused checkpoint names, long-rope and partial rotary."""

    def __init__(self, hf_config: Any, ops: Ops, max_positions: int | None = None,
                 device: Device = None) -> None:
        super().__init__(hf_config, ops, max_positions, device)
        rope = rope_parameters(hf_config)
        self.longrope = rope.get("rope_type", "default") == "longrope"
        self.partial_rotary = float(rope.get("partial_rotary_factor", 1.0)) != 1.0
        if self.longrope:
            self.long_rope_after = int(rope["original_max_position_embeddings"])

    @portable_math()
    def build_rotary_tables(self, rope: Any = None) -> None:
        """Default rope, full rotary: the Llama tables. Long-rope: [M + P, R] (short rows for positions < M, then
        long rows for positions < P); partial rotary: [P, R] with Phi-3's own default frequencies (R dimensions)."""
        if self.longrope:
            short, long = longrope_frequencies(self.config)
            cos_s, sin_s = rotary_tables(short, self.long_rope_after)
            cos_l, sin_l = rotary_tables(long, self.max_positions)
            dtype, device = self.embed_tokens.weight.dtype, self.embed_tokens.weight.device
            self.cos_table = torch.cat([cos_s, cos_l]).to(device=device, dtype=dtype)
            self.sin_table = torch.cat([sin_s, sin_l]).to(device=device, dtype=dtype)
            return
        if self.partial_rotary:  # the Llama tables of Phi-3's own default frequencies (R dimensions)
            from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

            inv_freq, scaling = Phi3RotaryEmbedding.compute_default_rope_parameters(self.config)
            rope = inv_freq.float(), float(scaling)
        super().build_rotary_tables(rope)

    @staticmethod
    def load_attention(attn: nn.Module, prefix: str, copy: Callable[..., None]) -> None:
        """Phi-3's fused qkv_proj: its rows [q | k | v] are our fused projection's."""
        copy(attn.qkv_proj.weight, prefix + "qkv_proj.weight")
        copy(attn.o_proj.weight, prefix + "o_proj.weight")

    def load_mlp(self, mlp: nn.Module, prefix: str, state: Mapping[str, torch.Tensor],
                 copy: Callable[..., None]) -> None:
        """Phi-3's fused gate_up_proj: its rows [gate | up] are our fused projection's."""
        copy(mlp.gate_up_proj.weight, prefix + "gate_up_proj.weight")
        copy(mlp.down_proj.weight, prefix + "down_proj.weight")
