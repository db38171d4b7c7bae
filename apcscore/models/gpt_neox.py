"""Our GPT-NeoX decoder (Pythia, GPT-NeoX-20B), fed Hugging Face weights.

What differs from the Llama family: LayerNorm with bias (not RMSNorm), a fused query_key_value projection
whose rows are per head [q | k | v] (reordered at load time into [all q | all k | all v]), rotary embedding
on the first `partial_rotary_factor` of each head's dimensions only, a GELU MLP with biases, and the parallel
residual (x + attn(ln1(x)) + mlp(ln2(x))) when `use_parallel_residual`, else the sequential one.

The batch-invariance contract holds as for Llama: every projection and the LM head go through the ops's
`linear`, attention is the same paged fixed-tile ops, and LayerNorm, rotary and GELU are row-wise.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from apcscore.errors import ApcscoreError
from apcscore.kernels import rowmath
from apcscore.models.architecture import rope_parameters
from apcscore.models.ops import Ops
from apcscore.models.rope import portable_math
from apcscore.models.weights import WeightCopier, param_slices
from apcscore.models.llama import Attention, Device, Linear, LlamaDecoder, own_residual_forward


class LayerNorm(nn.Module):
    """torch's layer_norm (row-wise) with weight and bias."""

    def __init__(self, size: int, eps: float, device: Device = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(size, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rowmath.layer_norm(x, self.weight, self.bias, self.eps)


class NeoXLayer(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, ops: Ops, device: Device = None) -> None:
        super().__init__()
        bias = bool(getattr(cfg, "attention_bias", True))  # (fused qkv rows regrouped at load: Llama's layout)
        self.self_attn = Attention(cfg, layer_idx, ops, False, bias, bias, device)
        self.input_layernorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, device)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, device)
        self.up = Linear(cfg.hidden_size, cfg.intermediate_size, True, ops.linear, device)
        self.down = Linear(cfg.intermediate_size, cfg.hidden_size, True, ops.linear, device)
        self.act = rowmath.activation(cfg.hidden_act)  # elementwise
        self.parallel = bool(cfg.use_parallel_residual)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin)
        if self.parallel:  # transformers' order of the sums: mlp + attn + x
            return self.down(self.act(self.up(self.post_attention_layernorm(x)))) + attn + x
        x = attn + x
        return self.down(self.act(self.up(self.post_attention_layernorm(x)))) + x


class GPTNeoXDecoder(LlamaDecoder):
    """GPT-NeoX over a flattened, paged batch; the engine-facing interface of LlamaDecoder (forward,
    compute_logits, lm_head_weight, materialize, load_hf_weights)."""

    def __init__(self, hf_config: Any, ops: Ops, max_positions: int | None = None,
                 device: Device = None) -> None:
        nn.Module.__init__(self)
        cfg = hf_config
        if (kind := rope_parameters(cfg).get("rope_type", "default")) != "default":
            raise ApcscoreError(f"GPT-NeoX with rope type {kind!r} is not implemented natively; use "
                                "--model-backend transformers")
        layers = [NeoXLayer(cfg, i, ops, device) for i in range(cfg.num_hidden_layers)]
        self.init_modules(cfg, ops, layers, LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, device), device,
                          max_positions)

    @portable_math()
    def build_rotary_tables(self, rope: Any = None) -> None:
        """cos/sin [P, rotary dimensions] from transformers' own GPTNeoXRotaryEmbedding (rope is ignored)."""
        from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

        with torch.device("cpu"):
            rotary = GPTNeoXRotaryEmbedding(self.config)
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(self.max_positions)[None, :])
        dtype, device = self.embed_tokens.weight.dtype, self.embed_tokens.weight.device
        self.cos_table = cos[0].to(device=device, dtype=dtype)
        self.sin_table = sin[0].to(device=device, dtype=dtype)

    forward = own_residual_forward

    @torch.no_grad()
    def load_hf_weights(self, state: Mapping[str, torch.Tensor], rope: Any = None, consume: bool = False) -> None:
        """Copy GPTNeoXForCausalLM weights into place (query_key_value rows regrouped); every weight must be used."""
        self._lm_head_fp32 = None
        slices = param_slices(self) if self.tensor_parallel is not None else {}
        copier = WeightCopier(state, consume, slices)
        heads = self.layers[0].self_attn.num_heads  # (a tensor-parallel rank's own heads)

        def copy(param: torch.Tensor, name: str, regroup: bool = False) -> None:
            copier(param, name)
            if regroup:  # rows per head [q | k | v] -> [all q | all k | all v] (a rank's heads: contiguous rows)
                param.copy_(param.reshape(heads, 3, -1, *param.shape[1:]).transpose(0, 1).reshape(param.shape).clone())

        copy(self.embed_tokens.weight, "gpt_neox.embed_in.weight")
        copy(self.norm.weight, "gpt_neox.final_layer_norm.weight")
        copy(self.norm.bias, "gpt_neox.final_layer_norm.bias")
        if self.lm_head is not None:
            copy(self.lm_head.weight, "embed_out.weight" if "embed_out.weight" in state else "lm_head.weight")
        for i, layer in enumerate(self.layers):
            p = f"gpt_neox.layers.{i}."
            attn = layer.self_attn
            for param, name in ((attn.qkv_proj.weight, "attention.query_key_value.weight"),
                                (attn.qkv_proj.bias, "attention.query_key_value.bias")):
                if param is not None:
                    copy(param, p + name, regroup=True)
            for module, name in ((attn.o_proj, "attention.dense"), (layer.up, "mlp.dense_h_to_4h"),
                                 (layer.down, "mlp.dense_4h_to_h"), (layer.input_layernorm, "input_layernorm"),
                                 (layer.post_attention_layernorm, "post_attention_layernorm")):
                copy(module.weight, p + name + ".weight")
                if module.bias is not None:
                    copy(module.bias, p + name + ".bias")
        copier.check_all_used(optional=("embed_out.weight", "lm_head.weight"),
                              ignored_suffixes=("rotary_emb.inv_freq", ".attention.bias", ".attention.masked_bias"))
        self.build_rotary_tables()
