"""Our Gemma 2 and Gemma 3 (text-only, Gemma3ForCausalLM) decoders, fed Hugging Face weights.

What differs from Llama, each as transformers computes it:
- the embeddings are scaled by sqrt(hidden_size), the factor rounded to the model dtype first;
- RMSNorm computes in fp32 and scales by (1 + weight), then casts (Gemma's norm, not Llama's);
- every layer norms its sublayers' inputs and outputs: x = x + post_attn_norm(attn(input_norm(x))),
  x = x + post_ffw_norm(mlp(pre_ffw_norm(x))); the MLP is GeGLU (GELU, tanh approximation, as configured);
- attention scales by query_pre_attn_scalar ** -0.5 (not head_dim ** -0.5);
- layers alternate sliding-window attention (a query sees the last `sliding_window` positions) and global
  attention, per `config.layer_types`; the window is masked inside the attention ops's fixed key tiles
  (the torch ops's and the Triton kernel's alike: `window=` and `softcap=` of their forward);
- Gemma 2: attention logits soft-capped (tanh(s / c) * c, c = attn_logit_softcapping), and the final logits
  too (final_logit_softcapping);
- Gemma 3: q and k RMS-normed per head before the rotary embedding, and the sliding layers' rotary tables use
  their own base (rope_parameters["sliding_attention"]); final logit soft-capping when configured.

The batch-invariance contract holds as for Llama: projections and the LM head through the ops's `linear`,
attention in the same fixed tiles, and norms, GELU, scaling and soft-capping row by row.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import nn

from apcscore.models.architecture import SUPPORTED_ARCHITECTURES, check_architecture
from apcscore.kernels import rowmath
from apcscore.models.ops import Ops
from apcscore.models.rope import portable_math
from apcscore.models.llama import Attention, Device, Linear, LlamaDecoder

SLIDING = "sliding_attention"


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + weight), in fp32, cast back (row-wise)."""

    def __init__(self, size: int, eps: float, device: Device = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rowmath.rms_norm(x, self.weight, self.eps, offset=1.0)


class GemmaAttention(Attention):
    """Llama's attention with its layer's window (sliding layers), soft-cap (Gemma 2), q/k norms (Gemma 3)."""

    def __init__(self, cfg: Any, layer_idx: int, gemma3: bool, ops: Ops, device: Device = None) -> None:
        bias = bool(getattr(cfg, "attention_bias", False))
        super().__init__(cfg, layer_idx, ops, False, bias, bias, device)
        self.scale = cfg.query_pre_attn_scalar ** -0.5
        self.sliding = cfg.layer_types[layer_idx] == SLIDING
        self.window = (cfg.sliding_window or None) if self.sliding else None
        self.softcap = None if gemma3 else (getattr(cfg, "attn_logit_softcapping", None) or None)  # Gemma 3: none
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, device) if gemma3 else None
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, device) if gemma3 else None

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)  # per head, on q [T, Hq, D] and k [T, Hkv, D]


class GemmaLayer(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, gemma3: bool, ops: Ops, device: Device = None) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = GemmaAttention(cfg, layer_idx, gemma3, ops, device)
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(h, 2 * cfg.intermediate_size, False, ops.linear, device)
        self.down_proj = Linear(cfg.intermediate_size, h, False, ops.linear, device)
        self.act = rowmath.activation(cfg.hidden_activation)  # elementwise (gelu_pytorch_tanh)
        self.input_layernorm = GemmaRMSNorm(h, eps, device)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, device)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, device)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin))
        gate, up = self.gate_up_proj(self.pre_feedforward_layernorm(x)).split(self.intermediate, dim=-1)
        return x + self.post_feedforward_layernorm(self.down_proj(self.act(gate) * up))


class GemmaDecoder(LlamaDecoder):
    """Gemma2ForCausalLM and Gemma3ForCausalLM over a flattened, paged batch (LlamaDecoder's interface)."""

    implements_sliding_window = True  # the engine need not cap the context at the window

    def __init__(self, hf_config: Any, ops: Ops, max_positions: int | None = None,
                 device: Device = None) -> None:
        nn.Module.__init__(self)
        cfg = hf_config
        self.gemma3 = SUPPORTED_ARCHITECTURES[check_architecture(cfg)] == "gemma3"
        layers = [GemmaLayer(cfg, i, self.gemma3, ops, device) for i in range(cfg.num_hidden_layers)]
        self.init_modules(cfg, ops, layers, GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device), device,
                          max_positions, tie_default=True)
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)
        for name in ("cos_local", "sin_local"):  # the sliding layers' tables (init_modules made the global ones)
            self.register_buffer(name, torch.empty(0), persistent=False)

    @portable_math()
    def build_rotary_tables(self, rope: Any = None) -> None:
        """cos/sin [P, D] from transformers' own Gemma rotary module (Gemma 3: one table per layer type)."""
        positions = torch.arange(self.max_positions)[None, :]
        x = torch.zeros(1, dtype=torch.float32)
        with torch.device("cpu"):
            if self.gemma3:
                from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

                rotary = Gemma3RotaryEmbedding(self.config)
                tables = {kind: rotary(x, positions, kind) for kind in sorted(set(self.config.layer_types))}
            else:
                from transformers.models.gemma2.modeling_gemma2 import Gemma2RotaryEmbedding

                both = Gemma2RotaryEmbedding(self.config)(x, positions)
                tables = {"full_attention": both, SLIDING: both}
        dtype, device = self.embed_tokens.weight.dtype, self.embed_tokens.weight.device
        full = tables.get("full_attention", tables.get(SLIDING))
        local = tables.get(SLIDING, full)
        self.cos_table, self.sin_table = (t[0].to(device=device, dtype=dtype) for t in full)
        self.cos_local, self.sin_local = (t[0].to(device=device, dtype=dtype) for t in local)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]."""
        weight = self.embed_tokens.weight
        hidden = self.embed_tokens(input_ids) * torch.tensor(self.config.hidden_size ** 0.5).to(weight.dtype)
        rotary = {False: (self.cos_table[positions], self.sin_table[positions]),
                  True: (self.cos_local[positions], self.sin_local[positions])}  # [T, D] each
        for layer in self.layers:
            hidden = layer(hidden, *rotary[layer.self_attn.sliding])
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits as LlamaDecoder.compute_logits, then soft-capped (tanh(l / c) * c) when configured."""
        logits = super().compute_logits(hidden, out)
        if self.final_softcap:
            rowmath.softcap(logits, self.final_softcap, inplace=True)
        return logits

    def load_layer(self, layer: nn.Module, prefix: str, state: Mapping[str, torch.Tensor],
                   copy: Callable[..., None]) -> None:
        """Gemma's layer: attention, GeGLU MLP stored on the layer, four norms (pre/post attention and MLP)."""
        self.load_attention(layer.self_attn, prefix + "self_attn.", copy)
        self.load_mlp(layer, prefix + "mlp.", state, copy)  # (the layer holds the MLP's projections)
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            copy(getattr(layer, norm).weight, prefix + norm + ".weight")
