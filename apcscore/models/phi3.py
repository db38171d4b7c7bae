"""Our Phi-3 decoder: the Llama decoder (apcscore.models.llama) fed Phi-3's fused weights.

Phi-3 is Llama-shaped: its checkpoint stores q/k/v as one `qkv_proj` ([q | k | v] rows, the order our fused
projection uses) and gate/up as one `gate_up_proj` ([gate | up]), so loading hands the Llama loader views of
those rows (no copies). What is not implemented natively, and runs through the transformers fallback under
`--model-backend auto` (`apcscore.models.architecture.native_problem`): long-rope scaling (`rope_type` "longrope": its frequencies switch
with the sequence's length, which a paged cache written at shorter lengths cannot follow) and partial rotary.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from apcscore.models.llama import LlamaDecoder


class Phi3Decoder(LlamaDecoder):
    """Phi3ForCausalLM: LlamaDecoder with the fused checkpoint names."""

    @torch.no_grad()
    def load_hf_weights(self, state: Mapping[str, torch.Tensor], rope: Any = None, consume: bool = False) -> None:
        """Split qkv_proj and gate_up_proj into the names the Llama loader takes (views), then load."""
        attn = self.layers[0].self_attn
        q, kv, inter = attn.q_size, attn.kv_size, self.layers[0].mlp.intermediate
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
