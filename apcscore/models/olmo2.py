"""Our OLMo 2 decoder, fed Hugging Face weights.

What differs from Llama: no pre-norms; each sublayer's output is normed before the residual add
(x = x + post_attention_layernorm(attn(x)); x = x + post_feedforward_layernorm(mlp(x))), and q and k are
RMS-normed over the whole projection (all heads together) before the rotary embedding. Rotary tables,
the SiLU MLP, the LM head and the paged fixed-tile attention are Llama's (apcscore.models.llama), so the
batch-invariance contract holds the same way: projections through the ops's `linear`, the rest row-wise.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import nn

from apcscore.models.ops import Ops
from apcscore.models.llama import MLP, Attention, Device, LlamaDecoder, RMSNorm, own_residual_forward


class Olmo2Attention(Attention):
    """Llama's attention with q/k RMSNorm over the full projection (all heads together)."""

    def __init__(self, cfg: Any, layer_idx: int, ops: Ops, device: Device = None) -> None:
        bias = bool(getattr(cfg, "attention_bias", False))
        super().__init__(cfg, layer_idx, ops, False, bias, bias, device)
        self.q_norm = RMSNorm(self.q_size, cfg.rms_norm_eps, ops.rms_norm, device)
        self.k_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps, ops.rms_norm, device)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D] and k [T, Hkv, D], each normed over its whole projection [T, H * D]."""
        t = q.shape[0]
        return (self.q_norm(q.reshape(t, -1).contiguous()).view_as(q),
                self.k_norm(k.reshape(t, -1).contiguous()).view_as(k))


class Olmo2Layer(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, ops: Ops, device: Device = None) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(cfg, layer_idx, ops, device)
        self.mlp = MLP(cfg, ops.linear, device, ops.silu_mul)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops.rms_norm, device)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops.rms_norm, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2Decoder(LlamaDecoder):
    """OLMo 2 over a flattened, paged batch (LlamaDecoder's engine-facing interface and rotary tables)."""

    def __init__(self, hf_config: Any, ops: Ops, max_positions: int | None = None,
                 device: Device = None) -> None:
        nn.Module.__init__(self)
        cfg = hf_config
        layers = [Olmo2Layer(cfg, i, ops, device) for i in range(cfg.num_hidden_layers)]
        self.init_modules(cfg, ops, layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops.rms_norm, device), device,
                          max_positions)

    forward = own_residual_forward

    def load_layer(self, layer: nn.Module, prefix: str, state: Mapping[str, torch.Tensor],
                   copy: Callable[..., None]) -> None:
        """OLMo 2's layer: attention with q/k norms, MLP, and norms after attention and MLP (no pre-norms)."""
        self.load_attention(layer.self_attn, prefix + "self_attn.", copy)
        self.load_mlp(layer.mlp, prefix + "mlp.", state, copy)
        copy(layer.post_attention_layernorm.weight, prefix + "post_attention_layernorm.weight")
        copy(layer.post_feedforward_layernorm.weight, prefix + "post_feedforward_layernorm.weight")
