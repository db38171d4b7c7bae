"""Our Phi-3 decoder: the Llama decoder (apcscore.models.llama) fed Phi-3's fused weights, with long-rope scaling
and partial rotary (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini).

Phi-3 is Llama-shaped: its checkpoint stores q/k/v as one `qkv_proj` ([q | k | v] rows, the order our fused
projection uses) and gate/up as one `gate_up_proj` ([gate | up]), so loading hands the Llama loader views of
those rows (no copies).

Long-rope (`rope_type` "longrope"). transformers' Phi-3 rotary embedding computes each forward call with the
*long* frequencies when the call's largest position + 1 exceeds `original_max_position_embeddings` (call it M),
else with the *short* ones, for every position of the call; and Phi3ForCausalLM's generate() drops its KV cache
and recomputes the whole sequence the first time the sequence grows past M tokens. So in transformers every
token's logits are those of one full forward over the sequence so far: a sequence of at most M tokens is
rotated short everywhere, a longer one long everywhere. The engine follows exactly that rule per sequence
(`Sequence.rope_long`): a prompt longer than M is prefilled long; a shorter one that generates past M tokens
is re-prefilled long, prompt and output, when it crosses (`Scheduler.switch_to_long_rope`), and the two
variants' KV blocks never share a prefix-cache digest (`Sequence.hash_root`). The decoder keeps both tables in
one: rows [0, M) short, rows [M, M + max_positions) long; a long sequence's positions arrive offset by M
(`long_rope_after`, apcscore.engine.step_inputs). The cos/sin scale (attention_factor) is the same for both.

Partial rotary (`partial_rotary_factor` < 1): the first R = head_dim x factor dimensions of each head are
rotated, the rest pass through (the Llama attention's partial branch).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from apcscore.models.architecture import rope_parameters
from apcscore.models.ops import Ops
from apcscore.models.llama import Device, LlamaDecoder
from apcscore.models.rope import RopeFrequencies, longrope_frequencies, rotary_tables, with_portable_math


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

    @with_portable_math
    def build_rotary_tables(self, rope: Any = None) -> None:
        """Default rope, full rotary: the Llama tables. Long-rope: [M + P, R] (short rows for positions < M, then
        long rows for positions < P); partial rotary: [P, R] with Phi-3's own default frequencies (R dimensions)."""
        if not self.longrope and not self.partial_rotary:
            super().build_rotary_tables(rope)
            return
        if self.longrope:
            short, long = longrope_frequencies(self.config)
            cos_s, sin_s = rotary_tables(short, self.long_rope_after)
            cos_l, sin_l = rotary_tables(long, self.max_positions)
            cos, sin = torch.cat([cos_s, cos_l]), torch.cat([sin_s, sin_l])
        else:
            from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

            inv_freq, scaling = Phi3RotaryEmbedding.compute_default_rope_parameters(self.config)
            cos, sin = rotary_tables(RopeFrequencies(inv_freq.float(), float(scaling)), self.max_positions)
        dtype, device = self.embed_tokens.weight.dtype, self.embed_tokens.weight.device
        self.cos_table = cos.to(device=device, dtype=dtype)
        self.sin_table = sin.to(device=device, dtype=dtype)

    @torch.no_grad()
    def load_hf_weights(self, state: Mapping[str, torch.Tensor], rope: Any = None, consume: bool = False) -> None:
        """Split qkv_proj and gate_up_proj into the names the Llama loader takes (views), then load."""
        cfg = self.config  # the full sizes (a tensor-parallel rank's layers hold parts: models.tensor_parallel)
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        q, kv, inter = cfg.num_attention_heads * d, kv_heads * d, cfg.intermediate_size
        mapped: dict[str, torch.Tensor] = {}
        for name, tensor in state.items():
            if name.endswith("self_attn.qkv_proj.weight"):
                base = name[:-len("qkv_proj.weight")]
                for part, (lo, hi) in zip("qkv", ((0, q), (q, q + kv), (q + kv, q + 2 * kv))):
                    mapped[f"{base}{part}_proj.weight"] = tensor[lo:hi]
            elif name.endswith("mlp.gate_up_proj.weight"):
                base = name[:-len("gate_up_proj.weight")]
                mapped[base + "gate_proj.weight"], mapped[base + "up_proj.weight"] = tensor[:inter], tensor[inter:]
            else:
                mapped[name] = tensor
        super().load_hf_weights(mapped, rope, consume=False)
        if consume:
            state.clear()  # type: ignore[attr-defined]
