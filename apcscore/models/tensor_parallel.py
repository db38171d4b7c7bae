"""Tensor-parallel layers: one rank's slice of a decoder, and the cross-rank sums in a fixed order.

Megatron's split, as vLLM's: column-parallel qkv and gate/up, row-parallel o and down, a vocabulary-parallel LM head
(apcscore.engine.parallel.logprobs combines logprobs without gathering [tokens, vocab]) and input embedding (a tied
head is its rows); norms are replicated, so after each sum every rank holds the same full hidden state.

**The sum is not an all-reduce**, whose order of additions the library picks by message size: `gather_sum`
all-gathers the partials and adds them in rank order, so a row's bits are a function of its own partials and the
batch-invariance contract holds within a degree (why, and what each family splits: docs/decisions.md, "Tensor
parallelism").

`slice_decoder` turns a decoder built on "meta" into rank r's slice before its weights are read; the checkpoint
slices each rank reads are the parameters' `SliceSpec`s (models/weights.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from apcscore.errors import ApcscoreError
from apcscore.models.llama import MLP, Attention, Linear, LlamaDecoder, RMSNorm
from apcscore.models.weights import SliceSpec

# the decoder classes whose layers slice_decoder knows: every native one (a decoder added later is refused until it
# is taught here). Gemma's soft-caps, windows and q/k norms are per head or per logit, so they run on a rank's heads
# or vocabulary rows unchanged
SLICEABLE = ("LlamaDecoder", "Phi3Decoder", "GemmaDecoder", "Olmo2Decoder", "GPTNeoXDecoder", "MoeDecoder")
# decoders whose q/k norms span the whole projection (all heads): a rank gathers q and k to norm them (GatheredRMSNorm)
WHOLE_PROJECTION_NORMS = ("Olmo2Decoder",)


class RanksFailed(ApcscoreError):
    """A collective failed: another rank ended or stopped answering. The run cannot go on (exit 1); the driver
    keeps the finished rows."""

    def __init__(self, cause: BaseException | str) -> None:
        why = str(cause).strip().splitlines()[0][:300] if str(cause).strip() else type(cause).__name__
        super().__init__(f"a tensor-parallel rank ended or stopped answering ({why}); the run cannot go on without "
                         "it — rerun the same command plus --resume to continue from the rows saved", exit_code=1)


@dataclass(frozen=True)
class TensorParallel:
    """This process's place among the ranks: `rank` of `world_size`, over `group` (None: torch.distributed's
    default group)."""

    rank: int
    world_size: int
    group: Any = None

    def gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `x` (same shape and dtype on all), in rank order."""
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        try:
            dist.all_gather(parts, x, group=self.group)
        except RuntimeError as e:  # gloo / NCCL: a peer died (connection reset) or timed out
            raise RanksFailed(e) from e
        return parts

    def gather_sum(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x`, added in rank order (never a ring all-reduce: see the module doc)."""
        parts = self.gather(x)
        out = parts[0]
        for part in parts[1:]:
            out = out + part  # elementwise, correctly rounded: the order is the code's
        return out


def vocab_range(vocab: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank `rank`'s rows [start, end) of a vocabulary split in contiguous ranges of ceil(vocab / N)."""
    per = -(-vocab // world_size)
    return min(vocab, rank * per), min(vocab, (rank + 1) * per)


def check_tensor_parallel(hf_config: Any, decoder: type, world_size: int) -> None:
    """Refuse (ApcscoreError) to run hf_config with `decoder` split over `world_size` ranks where it cannot be,
    before any weights are read."""
    if world_size == 1:
        return
    n = world_size
    if decoder.__name__ not in SLICEABLE:
        raise ApcscoreError(f"--tensor-parallel is implemented for the Llama family (Llama, Mistral, Qwen2, Qwen3), "
                            f"Phi-3, Gemma 2/3, OLMo 2, GPT-NeoX, Mixtral and Qwen2-MoE, not for {decoder.__name__}; "
                            "run it with --tensor-parallel 1")
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % n:
        raise ApcscoreError(f"--tensor-parallel {n} does not divide the model's {heads} attention heads; choose a "
                            f"divisor of {heads}")
    if kv % n and n % kv:
        raise ApcscoreError(f"--tensor-parallel {n} and the model's {kv} KV heads: one must divide the other (each "
                            f"rank holds whole KV heads, replicated when there are fewer than ranks)")
    for key in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        size = getattr(hf_config, key, None) or 0
        if size % n:
            raise ApcscoreError(f"--tensor-parallel {n} does not divide the model's {key} {size}; choose a divisor "
                                "of it")
    if vocab_range(hf_config.vocab_size, n - 1, n)[0] >= hf_config.vocab_size:
        raise ApcscoreError(f"--tensor-parallel {n} leaves a rank no rows of the model's {hf_config.vocab_size}-entry "
                            "vocabulary")


class ColumnParallelLinear(Linear):
    """This rank's output rows of `full`, a projection of the whole model (`weight_slice`: which rows of the full,
    fused weight; the bias alike)."""

    def __init__(self, full: Linear, rank_slice: SliceSpec, device: Any = None) -> None:
        bias = full.bias is not None
        super().__init__(full.weight.shape[1], sum(n for _, n in rank_slice.ranges), bias, full.linear_fn, device)
        self.weight_slice = rank_slice
        self.bias_slice = rank_slice if bias else None


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows [start, end) of the input embedding. A token's row comes from the rank that holds it, the
    others give zeros, and the ranks' rows are summed in rank order: x + 0 = x exactly, so the embedding gives
    degree 1's values (a zero's sign aside)."""

    def __init__(self, full: nn.Embedding, start: int, end: int, tp: TensorParallel, device: Any) -> None:
        dim = full.embedding_dim
        super().__init__(end - start, dim, _weight=torch.empty(end - start, dim, device=device))
        self.weight_slice = SliceSpec(0, ((start, end - start),), full.num_embeddings)
        self.start, self.end, self.tp = start, end, tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        here = (input_ids >= self.start) & (input_ids < self.end)  # [T]
        rows = super().forward(torch.where(here, input_ids - self.start, 0))  # [T, H]
        return self.tp.gather_sum(torch.where(here[:, None], rows, torch.zeros((), dtype=rows.dtype,
                                                                              device=rows.device)))


class RowParallelLinear(Linear):
    """This rank's input columns of `full`, a projection of the whole model; the partial products are summed across
    ranks in rank order, then the (replicated) bias is added once, as the full layer adds it after its sum."""

    def __init__(self, full: Linear, rank_slice: SliceSpec, tp: TensorParallel, device: Any = None) -> None:
        super().__init__(sum(n for _, n in rank_slice.ranges), full.weight.shape[0], full.bias is not None,
                         full.linear_fn, device)
        self.weight_slice = rank_slice
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.gather_sum(self.linear_fn(x, self.weight, None))  # [T, out]
        return out if self.bias is None else out + self.bias


class GatheredRMSNorm(RMSNorm):
    """An RMSNorm over a projection split across ranks (OLMo 2's q/k norms span all heads): the ranks' parts are
    gathered into the whole projection (a concatenation: no arithmetic), normed as on one device, and this rank's
    columns kept. `sources`: the ranks whose parts make up the whole, in order (replicated KV heads once each)."""

    def __init__(self, norm: RMSNorm, tp: TensorParallel, sources: list[int], device: Any) -> None:
        super().__init__(norm.weight.shape[0], norm.eps, norm.norm_fn, device)
        self.tp, self.sources = tp, sources
        # this rank's place in the whole: its own part, or (a replicated KV head) that of the first rank holding it
        self.at = max(i for i, r in enumerate(sources) if r <= tp.rank)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        parts = self.tp.gather(x)  # [T, local] each
        whole = torch.cat([parts[r] for r in self.sources], dim=-1)  # [T, full]
        local = x.shape[-1]
        return super().forward(whole)[..., self.at * local:(self.at + 1) * local]


def _gather_qk_norms(attn: nn.Module, tp: TensorParallel, kv: int) -> None:
    n = tp.world_size
    kv_sources = list(range(n)) if kv >= n else [j * (n // kv) for j in range(kv)]
    device = attn.q_norm.weight.device
    attn.q_norm = GatheredRMSNorm(attn.q_norm, tp, list(range(n)), device)
    attn.k_norm = GatheredRMSNorm(attn.k_norm, tp, kv_sources, device)


def _slice_attention(attn: Attention | nn.Module, tp: TensorParallel, device: Any, neox: bool = False) -> None:
    """This rank's heads of `attn`: qkv rows, o columns. neox: GPT-NeoX's checkpoint holds [q | k | v] per head, so
    a rank's heads are one contiguous block of qkv rows (models.gpt_neox regroups them after reading)."""
    heads, kv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    n, r = tp.world_size, tp.rank
    hq = heads // n
    hkv = hq if neox else max(1, kv // n)
    k0 = r * hkv if kv >= n else (r * hq) // (heads // kv)  # the KV head(s) this rank's query heads read
    full = heads * d + 2 * kv * d
    qkv = SliceSpec(0, ((r * hq * 3 * d, hq * 3 * d),) if neox else
                    ((r * hq * d, hq * d), (heads * d + k0 * d, hkv * d), (heads * d + kv * d + k0 * d, hkv * d)), full)
    attn.qkv_proj = ColumnParallelLinear(attn.qkv_proj, qkv, device)
    attn.o_proj = RowParallelLinear(attn.o_proj, SliceSpec(1, ((r * hq * d, hq * d),), heads * d), tp, device)
    attn.num_heads, attn.num_kv_heads = hq, hkv  # the forward reshapes to these: [T, hq, D], [T, hkv, D]
    attn.q_size, attn.kv_size = hq * d, hkv * d


def _slice_mlp(mlp: MLP | nn.Module, tp: TensorParallel, device: Any) -> None:
    """The gate/up and down projections of `mlp` (a module with gate_up_proj, down_proj and intermediate: Llama's
    MLP, or a Gemma layer itself)."""
    inter, n, r = mlp.intermediate, tp.world_size, tp.rank
    part = inter // n
    gate_up = SliceSpec(0, ((r * part, part), (inter + r * part, part)), 2 * inter)  # rows of [gate | up]
    mlp.gate_up_proj = ColumnParallelLinear(mlp.gate_up_proj, gate_up, device)
    mlp.down_proj = RowParallelLinear(mlp.down_proj, SliceSpec(1, ((r * part, part),), inter), tp, device)
    mlp.intermediate = part


def _slice_experts(moe: nn.Module, tp: TensorParallel) -> None:
    """A sparse-MoE layer (models.moe.SparseMoe): every expert's intermediate split as a dense MLP's (gate/up rows,
    down columns); the router and the routing are replicated, so every rank picks the same experts; the ranks'
    partial outputs (each the weighted sum of its parts of the experts) are summed in rank order once per layer."""
    inter, n, r = moe.intermediate, tp.world_size, tp.rank
    part = inter // n
    e, h = moe.num_experts, moe.down_proj.shape[1]
    device = moe.down_proj.device
    moe.gate_up_proj = nn.Parameter(torch.empty(e, 2 * part, h, device=device), requires_grad=False)
    moe.down_proj = nn.Parameter(torch.empty(e, h, part, device=device), requires_grad=False)
    moe.expert_slices = (SliceSpec(0, ((r * part, part), (inter + r * part, part)), 2 * inter),
                         SliceSpec(1, ((r * part, part),), inter))
    moe.intermediate = part
    moe.tp = tp
    if moe.shared_expert is not None:
        _slice_mlp(moe.shared_expert, tp, device)


def _slice_neox_layer(layer: nn.Module, tp: TensorParallel, device: Any) -> None:
    """GPT-NeoX: its attention's contiguous heads (_slice_attention), and the MLP up / down with biases."""
    _slice_attention(layer.self_attn, tp, device, neox=True)
    n, r = tp.world_size, tp.rank
    inter = layer.up.weight.shape[0]
    part = inter // n
    layer.up = ColumnParallelLinear(layer.up, SliceSpec(0, ((r * part, part),), inter), device)
    layer.down = RowParallelLinear(layer.down, SliceSpec(1, ((r * part, part),), inter), tp, device)


def slice_decoder(model: LlamaDecoder, tp: TensorParallel) -> LlamaDecoder:
    """Make `model` (built on "meta", before `materialize`) rank tp.rank's slice: its layers' projections and
    head hold this rank's parts, which `load_hf_weights` then reads (models.weights.param_slices)."""
    check_tensor_parallel(model.config, type(model), tp.world_size)
    device = model.embed_tokens.weight.device
    whole_norms = type(model).__name__ in WHOLE_PROJECTION_NORMS
    for layer in model.layers:
        if type(model).__name__ == "GPTNeoXDecoder":
            _slice_neox_layer(layer, tp, device)
            continue
        kv = layer.self_attn.num_kv_heads  # (before slicing)
        _slice_attention(layer.self_attn, tp, device)
        if whole_norms:
            _gather_qk_norms(layer.self_attn, tp, kv)
        mlp = getattr(layer, "mlp", layer)
        if hasattr(mlp, "expert_slices"):
            _slice_experts(mlp, tp)
        else:
            _slice_mlp(mlp, tp, device)
    vocab = model.config.vocab_size
    start, end = vocab_range(vocab, tp.rank, tp.world_size)
    model.vocab_range = (start, end)
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, start, end, tp, device)
    if model.lm_head is not None:  # a tied head is the (sliced) embedding itself (lm_head_weight)
        model.lm_head = ColumnParallelLinear(model.lm_head, SliceSpec(0, ((start, end - start),), vocab), device)
    model.tensor_parallel = tp
    return model
