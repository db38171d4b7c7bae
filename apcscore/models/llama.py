"""Our decoder for the Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3), fed Hugging Face weights.

The model works on a flattened batch: `input_ids [T]`, `positions [T]`; attention reads the step's
AttentionMetadata (apcscore.attention.metadata) and the layer's paged KV cache. Rotary tables use the
frequencies of transformers' own rotary embedding class, so every rope type it knows (default, llama3,
yarn, ...) gives exactly its cos/sin.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import torch
from torch import nn

from apcscore.attention.metadata import get_attention_metadata
from apcscore.errors import ApcscoreError
from apcscore.models.architecture import SUPPORTED_ARCHITECTURES, check_architecture
from apcscore.models.ops import Ops
from apcscore.kernels.silu_mul_torch import silu_mul_torch
from apcscore.models.rope import portable_math, rope_frequencies, rotary_tables
from apcscore.models.weights import WeightCopier, param_slices

Device = torch.device | str | None


class Linear(nn.Module):
    """y = x @ weight.T (+ bias) through the model's linear op (batch-invariant unless turned off)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, linear_fn: Callable[..., torch.Tensor],
                 device: Device = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, device=device), requires_grad=False) if bias else None
        self.linear_fn = linear_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fn(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, norm_fn: Callable[..., Any], device: Device = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=device))
        self.eps = eps
        self.norm_fn = norm_fn

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        return self.norm_fn(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    """Multi-head attention over the paged KV cache, with the attributes the KV pool and the model runner set and
    read (layer_idx, k_cache, v_cache, num_kv_heads, head_dim). Families change how q and k are normed
    (`norm_qk`), the scale, and Gemma's `window` and `softcap` (see the attention backends' forward)."""

    window: int | None = None
    softcap: float | None = None

    def __init__(self, cfg: Any, layer_idx: int, ops: Ops, qk_norm: bool, qkv_bias: bool, o_bias: bool,
                 device: Device = None) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        linear, norm_fn = ops.linear, ops.rms_norm
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, qkv_bias, linear, device)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, o_bias, linear, device)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, norm_fn, device) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, norm_fn, device) if qk_norm else None
        self.layer_idx = layer_idx
        self.attention_backend = ops.attention
        self.rotary = ops.rotary
        self.k_cache = torch.empty(0)  # [num_blocks, block_size, Hkv, D], set by the model runner
        self.v_cache = torch.empty(0)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, (Hq + 2 Hkv) * D]
        q, k, v = (x.reshape(num_tokens, -1, self.head_dim)  # [T, Hq or Hkv, D]
                   for x in qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1))
        if self.q_norm is not None:
            q, k = self.norm_qk(q, k)
        q, k = self.rotary(q, k, cos, sin)  # cos, sin [T, R]: R = D, or fewer (partial rotary: Phi-4-mini)
        out = self.attention_backend.forward(q, k, v.contiguous(), self.k_cache, self.v_cache,  # [T, Hq, D]
                                             get_attention_metadata(), self.scale, self.window, self.softcap)
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D] and k [T, Hkv, D] RMS-normed per head (Qwen3)."""
        return (self.q_norm(q.reshape(-1, self.head_dim)).view_as(q),
                self.k_norm(k.reshape(-1, self.head_dim)).view_as(k))


class MLP(nn.Module):
    """down(silu(gate) * up), gate and up from one fused projection; silu_mul is the ops' (Ops.silu_mul: the
    torch form, or on CUDA the fused Triton kernel with the torch form's bits)."""

    def __init__(self, cfg: Any, linear: Callable[..., torch.Tensor], device: Device = None,
                 silu_mul: Callable[..., torch.Tensor] = silu_mul_torch) -> None:
        super().__init__()
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ApcscoreError(f"unsupported activation {cfg.hidden_act!r}; only silu is supported")
        bias = getattr(cfg, "mlp_bias", False)
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias, linear, device)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias, linear, device)
        self.silu_mul = silu_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(self.silu_mul(gate, up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, ops: Ops, qk_norm: bool, qkv_bias: bool, o_bias: bool,
                 device: Device = None) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, ops, qk_norm, qkv_bias, o_bias, device)
        self.mlp = MLP(cfg, ops.linear, device, ops.silu_mul)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops.rms_norm, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops.rms_norm, device)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaDecoder(nn.Module):
    """Decoder-only transformer of the Llama family over a flattened, paged batch."""

    # whether the decoder masks a config's sliding window itself (else the engine caps the context at it)
    implements_sliding_window = False
    # long-rope (Phi-3): a sequence longer than this many tokens uses the long rotary frequencies at every
    # position; their cos/sin rows follow the short ones, at table row position + long_rope_after (the engine
    # offsets such a sequence's positions: apcscore.engine.step_inputs). None: one table, rows = positions.
    long_rope_after: int | None = None
    # tensor parallelism (apcscore.models.tensor_parallel.slice_decoder): this rank's rows [start, end) of the
    # vocabulary in the LM head, and the ranks; None: the whole model in this process
    vocab_range: tuple[int, int] | None = None
    tensor_parallel: Any = None

    def __init__(self, hf_config: Any, ops: Ops, max_positions: int | None = None,
                 device: Device = None) -> None:
        """ops: linear layers, attention and RMSNorm (apcscore.models.ops.select_ops). device
        "meta" builds it without memory (then `materialize` and `load_hf_weights`)."""
        super().__init__()
        cfg = hf_config
        family = SUPPORTED_ARCHITECTURES[check_architecture(cfg)]
        qk_norm = family == "qwen3"
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        qkv_bias = family == "qwen2" or attention_bias or bool(getattr(cfg, "qkv_bias", False))  # (Qwen2-MoE)
        o_bias = attention_bias and family != "qwen2"  # Qwen2: bias on q/k/v only
        layers = [DecoderLayer(cfg, i, ops, qk_norm, qkv_bias, o_bias, device) for i in range(cfg.num_hidden_layers)]
        self.init_modules(cfg, ops, layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops.rms_norm, device), device,
                          max_positions)

    def materialize(self, device: Device, dtype: torch.dtype) -> "LlamaDecoder":
        """Give a model built on "meta" uninitialised parameters of `dtype` on `device` (pages untouched until
        load_hf_weights writes them). Unlike Module.to_empty, this does not import torch's symbolic-shapes
        machinery (~0.7 s)."""
        for module in self.modules():
            for name, param in module.named_parameters(recurse=False):
                module._parameters[name] = nn.Parameter(torch.empty(param.shape, device=device, dtype=dtype),
                                                        requires_grad=False)
            for name, buf in module.named_buffers(recurse=False):
                module._buffers[name] = torch.empty(buf.shape, device=device, dtype=dtype)
        return self

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[V, H], or this rank's rows of it under tensor parallelism (a tied head: the rank's embedding rows)."""
        if self.lm_head is not None:
            return self.lm_head.weight
        if self.vocab_range is None or getattr(self.embed_tokens, "weight_slice", None) is not None:
            return self.embed_tokens.weight  # (a sliced embedding holds this rank's rows already)
        return self.embed_tokens.weight[self.vocab_range[0]:self.vocab_range[1]]

    def init_modules(self, cfg: Any, ops: Ops, layers: list[nn.Module], norm: nn.Module, device: Device,
                     max_positions: int | None, tie_default: bool = False) -> None:
        """What every decoder's constructor sets up around its `layers` and final `norm`: config, ops, the
        embedding, the LM head (None when tied to the embedding), the slot for its fp32 copy (CPU, half-precision
        models), the context length and the empty rotary tables."""
        self.config, self.ops = cfg, ops
        # _weight skips the random init (on "meta" it would import torch._dynamo: ~1 s)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size, device=device))
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", tie_default))
        self.lm_head = (None if self.tie_word_embeddings
                        else Linear(cfg.hidden_size, cfg.vocab_size, False, ops.linear, device))
        self._lm_head_fp32: torch.Tensor | None = None
        self.max_positions = max_positions or cfg.max_position_embeddings
        self.register_buffer("cos_table", torch.empty(0), persistent=False)
        self.register_buffer("sin_table", torch.empty(0), persistent=False)

    @portable_math()
    def build_rotary_tables(self, rope: Any = None) -> None:
        """cos/sin for every position, exactly transformers' values.

        rope: the inverse frequencies and scale transformers computed for this config (models/rope.Rope), or None
        to ask transformers' rotary embedding now. The tables are then built with its own arithmetic.
        """
        positions = torch.arange(self.max_positions)
        if rope is None:
            rope = rope_frequencies(self.config)
        if rope is None:  # a rope type that depends on the length: transformers' module computes the tables
            from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

            with torch.device("cpu"):
                rotary = LlamaRotaryEmbedding(self.config)
            cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions[None, :])  # [1, P, D] fp32
            cos, sin = cos[0], sin[0]
        else:  # LlamaRotaryEmbedding.forward's arithmetic
            cos, sin = rotary_tables(rope, self.max_positions)
        dtype, device = self.embed_tokens.weight.dtype, self.embed_tokens.weight.device
        self.cos_table = cos.to(device=device, dtype=dtype)
        self.sin_table = sin.to(device=device, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]."""
        hidden = self.embed_tokens(input_ids)  # [T, H]
        cos, sin = self.cos_table[positions], self.sin_table[positions]  # [T, D]
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos, sin)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, H] -> fp32 logits [N, vocab], whatever the model dtype, through a batch-invariant GEMM.

        A bf16 logit is rounded by up to 2^-8 of its size: ~0.06 nats at |logit| 20, too coarse to score with.
        How the head is multiplied is `logits_product`'s to say. `out` (fp32, rows: see Ops.linear) receives
        the logits if given.
        """
        linear, weight, rows_dtype = self.logits_product()
        return linear(hidden.to(rows_dtype), weight, out=out)

    def logits_product(self) -> tuple[Callable[..., torch.Tensor], torch.Tensor, torch.dtype]:
        """How compute_logits multiplies the LM head: (linear(x, weight, out=None) -> fp32 [N, vocab], weight,
        the dtype x is cast to). The start-up probe (engine/gemm_probe.py) checks exactly this product.

        On CUDA the Triton matmul reads the model dtype and accumulates and writes fp32 (without batch
        invariance, cuBLAS does the same: matmul_torch.library_logits); on the CPU a half-precision model's hidden
        states and LM head are upcast (the fp32 head is kept: vocab x hidden x 4 bytes), unless the linear
        multiplies fp32 rows by half weights exactly (`mixed_dtypes`).
        """
        weight = self.lm_head_weight
        if weight.device.type == "cuda":
            if not self.ops.batch_invariant:
                from apcscore.kernels.matmul_torch import library_logits

                return library_logits, weight, weight.dtype
            from apcscore.kernels.matmul import invariant_linear

            return functools.partial(invariant_linear, out_dtype=torch.float32), weight, weight.dtype
        if weight.dtype != torch.float32 and getattr(self.ops.linear, "mixed_dtypes", False):
            return self.ops.linear, weight, torch.float32  # fp32 rows x half weights: exact upcast
        if weight.dtype != torch.float32:
            if self._lm_head_fp32 is None:
                self._lm_head_fp32 = weight.float()
            weight = self._lm_head_fp32
        return self.ops.linear, weight, torch.float32

    @torch.no_grad()
    def load_hf_weights(self, state: Mapping[str, torch.Tensor], rope: Any = None, consume: bool = False) -> None:
        """Copy Hugging Face weights into place, tensor by tensor (q/k/v and gate/up are fused here). Every
        weight must be used.

        Sources may sit on any device in any dtype and consume=True frees `state` as it goes (see
        apcscore.models.weights.WeightCopier). Then builds the rotary tables (`rope`: see build_rotary_tables).
        """
        self._lm_head_fp32 = None
        copy = WeightCopier(state, consume, param_slices(self) if self.tensor_parallel is not None else None)
        copy(self.embed_tokens.weight, "model.embed_tokens.weight")
        copy(self.norm.weight, "model.norm.weight")
        if self.lm_head is not None:
            copy(self.lm_head.weight, "lm_head.weight")
        for i, layer in enumerate(self.layers):
            self.load_layer(layer, f"model.layers.{i}.", state, copy)
        copy.check_all_used()
        self.build_rotary_tables(rope)

    def load_layer(self, layer: nn.Module, prefix: str, state: Mapping[str, torch.Tensor],
                   copy: Callable[..., None]) -> None:
        """Load decoder layer `prefix` ("model.layers.N."): attention, MLP and the two norms. Families with other
        norms or MLPs override it (apcscore.models.gemma, olmo2)."""
        self.load_attention(layer.self_attn, prefix + "self_attn.", copy)
        self.load_mlp(layer.mlp, prefix + "mlp.", state, copy)
        copy(layer.input_layernorm.weight, prefix + "input_layernorm.weight")
        copy(layer.post_attention_layernorm.weight, prefix + "post_attention_layernorm.weight")

    @staticmethod
    def load_attention(attn: nn.Module, prefix: str, copy: Callable[..., None]) -> None:
        """q/k/v fused into qkv_proj, o_proj, optional biases and q/k norms (`prefix` "model.layers.N.self_attn.")."""
        load_linear(copy, attn.qkv_proj, *(prefix + f"{x}_proj" for x in "qkv"))
        load_linear(copy, attn.o_proj, prefix + "o_proj")
        if getattr(attn, "q_norm", None) is not None:
            copy(attn.q_norm.weight, prefix + "q_norm.weight")
            copy(attn.k_norm.weight, prefix + "k_norm.weight")

    def load_mlp(self, mlp: nn.Module, prefix: str, state: Mapping[str, torch.Tensor],
                 copy: Callable[..., None]) -> None:
        """Load one layer's MLP (`prefix` "model.layers.N.mlp."); copy(param, *names) fills fused rows in order.
        Sparse-MoE decoders override it (apcscore.models.moe)."""
        load_linear(copy, mlp.gate_up_proj, prefix + "gate_proj", prefix + "up_proj")
        load_linear(copy, mlp.down_proj, prefix + "down_proj")


def own_residual_forward(decoder: LlamaDecoder, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The forward of a decoder whose layers add their own residuals, layer(hidden, cos, sin) -> hidden (OLMo 2,
    GPT-NeoX): input_ids, positions [T] -> final hidden states [T, hidden]."""
    hidden = decoder.embed_tokens(input_ids)
    cos, sin = decoder.cos_table[positions], decoder.sin_table[positions]
    for layer in decoder.layers:
        hidden = layer(hidden, cos, sin)
    return decoder.norm(hidden)


def load_linear(copy: Callable[..., None], linear: Linear, *names: str) -> None:
    """A Linear's weight from the checkpoint's `<name>.weight` tensors (several: fused rows, in order), and its bias,
    if it has one, from their `<name>.bias`."""
    copy(linear.weight, *(name + ".weight" for name in names))
    if linear.bias is not None:
        copy(linear.bias, *(name + ".bias" for name in names))
