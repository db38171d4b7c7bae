"""Our sparse mixture-of-experts decoders: Mixtral and Qwen2-MoE, the Llama decoder with MoE MLPs.

Attention, norms, rotary tables and the LM head are Llama's (apcscore.models.llama); each MoE layer's MLP is
a router (a linear layer), a softmax over the experts, the top-k experts per token and their weighted sum,
exactly as transformers computes them:

- Mixtral: softmax in fp32 of the router logits, top-k, the k weights renormalised to sum to 1 (kept fp32).
- Qwen2-MoE: the same softmax and top-k, renormalised only with `norm_topk_prob`, the weights cast to the
  model dtype; plus a shared expert (a dense SiLU MLP) scaled by sigmoid(shared_expert_gate(x)) and added.
  Layers in `mlp_only_layers` or off the `decoder_sparse_step` grid have a dense MLP.

Batch invariance: routing is per token, and each expert runs as a plain grouped loop over the experts in
ascending order: the tokens routed to expert e are gathered and multiplied with its weights through the
ops's batch-invariant `linear` (a row's bits do not depend on how many rows share the GEMM), then
added into the output with index_add_ (a token's contributions land in ascending expert order, from zero).
So a token's result depends on its own hidden state only, never on which other tokens share the batch.

Weights load from either checkpoint layout: per-expert tensors (`experts.N.w1/w2/w3` for Mixtral under
`block_sparse_moe.`, `experts.N.gate_proj/up_proj/down_proj` for Qwen2-MoE) or transformers 5's stacked
`experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I].
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable, Mapping

import torch
from torch import nn

from apcscore.kernels import rowmath
from apcscore.models.architecture import SUPPORTED_ARCHITECTURES, native_architecture
from apcscore.models.ops import Ops
from apcscore.models.llama import MLP, Device, Linear, LlamaDecoder


class SparseMoe(nn.Module):
    """Top-k routed experts (and Qwen2-MoE's gated shared expert) over a flat batch of tokens [T, H]."""

    def __init__(self, cfg: Any, family: str, ops: Ops, device: Device = None) -> None:
        super().__init__()
        qwen = family == "qwen2_moe"
        self.num_experts = cfg.num_experts if qwen else cfg.num_local_experts
        self.intermediate = cfg.moe_intermediate_size if qwen else cfg.intermediate_size
        self.top_k = cfg.num_experts_per_tok
        self.normalize = bool(cfg.norm_topk_prob) if qwen else True
        self.weights_in_model_dtype = qwen  # Mixtral keeps the routing weights in fp32
        self.linear = ops.linear
        self.act = rowmath.activation(cfg.hidden_act)  # elementwise
        e, i, h = self.num_experts, self.intermediate, cfg.hidden_size
        self.gate = Linear(h, e, False, ops.linear, device)  # the router
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h, device=device), requires_grad=False)  # [gate|up]
        self.down_proj = nn.Parameter(torch.empty(e, h, i, device=device), requires_grad=False)
        self.shared_expert = (MLP(SimpleNamespace(hidden_size=h, intermediate_size=cfg.shared_expert_intermediate_size,
                                                  hidden_act=cfg.hidden_act), ops.linear, device, ops.silu_mul)
                              if qwen else None)  # a dense SiLU MLP (Llama's)
        self.shared_expert_gate = Linear(h, 1, False, ops.linear, device) if qwen else None
        # tensor parallelism (models.tensor_parallel): this rank's part of every expert's intermediate, and the
        # ranks whose partial outputs are summed; None: the whole layer here
        self.expert_slices: tuple[Any, Any] | None = None  # SliceSpecs of one expert's gate_up [2I, H], down [H, I]
        self.tp: Any = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (routing weights [T, k], expert ids [T, k]), row by row as transformers' router."""
        logits = self.gate(x)  # [T, E]
        probs = rowmath.softmax(logits)  # fp32
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / rowmath.row_sum(weights)[:, None]
        if self.weights_in_model_dtype:
            weights = weights.to(logits.dtype)
        return weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        out = torch.zeros_like(x)  # [T, H]
        for e in torch.unique(experts).tolist():  # ascending, only the experts some token picked
            rows, slot = torch.where(experts == e)  # the tokens routed to e, and where e is in their top-k
            gate, up = self.linear(x[rows], self.gate_up_proj[e]).split(self.intermediate, dim=-1)
            y = self.linear(self.act(gate) * up, self.down_proj[e])  # [n_e, H]
            out.index_add_(0, rows, (y * weights[rows, slot, None]).to(out.dtype))
        if self.tp is not None:  # each rank summed its part of every expert's down projection: add them in rank order
            out = self.tp.gather_sum(out)
        if self.shared_expert is not None:
            out = out + sigmoid_rows(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def sigmoid_rows(g: torch.Tensor) -> torch.Tensor:
    """sigmoid of g [T, 1], each row's bits independent of T.

    torch's CPU elementwise kernels run whole SIMD vectors (32 floats at a time) and finish a tensor's last
    numel % 32 elements with a scalar loop whose exp may round differently: on [T, 1] which rows take the
    scalar path would depend on T. Padded to 32 columns, every element is computed by the vector path.
    """
    if rowmath.ours(g):  # the portable sigmoid: element by element, whatever the shape
        return rowmath.sigmoid(g)
    return torch.sigmoid(nn.functional.pad(g, (0, 31)))[:, :1]


def is_sparse_layer(cfg: Any, family: str, layer_idx: int) -> bool:
    """Whether layer `layer_idx` has a sparse MoE MLP (every Mixtral layer; Qwen2-MoE's rule)."""
    if family != "qwen2_moe":
        return True
    return (layer_idx not in (cfg.mlp_only_layers or []) and cfg.num_experts > 0
            and (layer_idx + 1) % cfg.decoder_sparse_step == 0)


class MoeDecoder(LlamaDecoder):
    """MixtralForCausalLM and Qwen2MoeForCausalLM: LlamaDecoder with SparseMoe MLPs where the config has them."""

    def __init__(self, hf_config: Any, ops: Ops, max_positions: int | None = None,
                 device: Device = None) -> None:
        super().__init__(hf_config, ops, max_positions, device)  # dense MLPs first (on "meta": free)
        self.family = SUPPORTED_ARCHITECTURES[native_architecture(hf_config) or ""]
        for i, layer in enumerate(self.layers):
            if is_sparse_layer(hf_config, self.family, i):
                layer.mlp = SparseMoe(hf_config, self.family, ops, device)

    def load_mlp(self, mlp: nn.Module, prefix: str, state: Mapping[str, torch.Tensor],
                 copy: Callable[..., None]) -> None:
        """Router, experts (per-expert or stacked tensors) and the shared expert of one layer."""
        if not isinstance(mlp, SparseMoe):
            return super().load_mlp(mlp, prefix, state, copy)
        if self.family == "mixtral" and prefix + "gate.weight" not in state:
            prefix = prefix[:-len("mlp.")] + "block_sparse_moe."  # the original Mixtral checkpoints' name
        copy(mlp.gate.weight, prefix + "gate.weight")
        slices = mlp.expert_slices  # a tensor-parallel rank reads its rows / columns of every expert

        def put(param: torch.Tensor, spec: Any, *names: str) -> None:
            copy(param, *names) if spec is None else copy.copy_slice(param, spec, names)

        gu_spec, down_spec = slices or (None, None)
        if prefix + "experts.gate_up_proj" in state:  # transformers 5's stacked layout [E, ...]: one more dim
            lift = (lambda sp: None if sp is None else type(sp)(sp.dim + 1, sp.ranges, sp.full))  # noqa: E731
            put(mlp.gate_up_proj, lift(gu_spec), prefix + "experts.gate_up_proj")
            put(mlp.down_proj, lift(down_spec), prefix + "experts.down_proj")
        else:
            gate, up, down = ("w1", "w3", "w2") if self.family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
            for e in range(mlp.num_experts):
                p = f"{prefix}experts.{e}."
                put(mlp.gate_up_proj[e], gu_spec, f"{p}{gate}.weight", f"{p}{up}.weight")
                put(mlp.down_proj[e], down_spec, f"{p}{down}.weight")
        if mlp.shared_expert is not None:
            super().load_mlp(mlp.shared_expert, prefix + "shared_expert.", state, copy)
            copy(mlp.shared_expert_gate.weight, prefix + "shared_expert_gate.weight")
