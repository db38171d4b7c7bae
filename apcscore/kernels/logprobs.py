"""Per-token logprobs over the vocabulary: a fused Triton kernel (its exact torch reference: logprobs_ref).

For each row of logits and its target token: the target's logprob under an fp32 log_softmax, its rank
(1 + the number of vocabulary entries with a strictly greater logit, so 1 = argmax and ties share a rank),
and the top-k token ids with their logprobs, sorted by descending logit, equal logits by ascending token id
(logprobs_ref.top_k). A target outside [0, V) gives logprob NaN and rank 0 in both implementations (no device
sync is spent on checking it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from apcscore.kernels._checks import (FLOAT_DTYPES, check_dtype, check_last_dim_contiguous, check_shape,
                                      check_tensors)
from apcscore.kernels.logprobs_ref import top_k

BLOCK_V = 4096  # vocabulary entries per chunk of the kernel's loop (untuned)
NUM_WARPS = 8


@triton.jit
def _token_logprobs_kernel(logits_ptr, targets_ptr, lse_ptr, logprobs_ptr, ranks_ptr, stride_row, vocab,
                           BLOCK_V: tl.constexpr):
    """One program per row: online log-sum-exp over vocabulary chunks, the target's logit and its rank."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    target = tl.load(targets_ptr + row).to(tl.int64)
    target_ok = (target >= 0) & (target < vocab)
    target_logit = tl.load(base + target, mask=target_ok, other=0.0).to(tl.float32)
    m = tl.full([], float("-inf"), tl.float32)  # running max
    s = tl.zeros([], tl.float32)  # running sum of exp(x - m)
    greater = tl.zeros([], tl.int32)  # entries with a logit strictly above the target's
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)  # [BLOCK_V]
        m_new = tl.maximum(m, tl.max(x, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: avoid -inf - -inf
        s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(x - m_ref), 0)
        m = m_new
        greater += tl.sum((x > target_logit).to(tl.int32), 0)
    lse = m + tl.log(s)
    tl.store(lse_ptr + row, lse)
    tl.store(logprobs_ptr + row, tl.where(target_ok, target_logit - lse, float("nan")))
    tl.store(ranks_ptr + row, tl.where(target_ok, greater.to(tl.int64) + 1, 0))


def _check_args(name: str, logits: torch.Tensor, targets: torch.Tensor, k: int) -> None:
    check_shape(name, "logits", logits, 2)
    check_dtype(name, "logits", logits, FLOAT_DTYPES)
    if logits.shape[1] == 0:
        raise ValueError(f"{name}: logits have an empty vocabulary dimension, shape {tuple(logits.shape)}")
    check_shape(name, "targets", targets, 1)
    check_dtype(name, "targets", targets, (torch.int64,))
    if targets.shape[0] != logits.shape[0]:
        raise ValueError(f"{name}: {targets.shape[0]} targets for {logits.shape[0]} rows of logits")
    if not isinstance(k, int) or not 0 <= k <= logits.shape[1]:
        raise ValueError(f"{name}: k must be an int in [0, vocab size {logits.shape[1]}], got {k!r}")


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int, ranks: bool = True, *,
                   block_v: int = BLOCK_V) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused logprobs of the target tokens, without materialising an [N, V] fp32 tensor.

    logits: [N, V] fp32/fp16/bf16 (rows may be strided, V contiguous); targets: [N] int64; k >= 0.
    Returns logprobs [N] f32, ranks [N] int64, top_ids [N, k] int64, top_logprobs [N, k] f32.
    The kernel computes the fp32 log-sum-exp, the target's logprob and rank in one pass over the vocabulary;
    the top-k uses torch.topk on the input logits, and its logprobs are those logits in fp32 minus the
    kernel's log-sum-exp. block_v: vocabulary entries per chunk (a power of two). ranks is accepted for the
    torch reference's signature: the kernel counts them in the same pass anyway.
    """
    name = "token_logprobs"
    check_tensors(name, logits=logits, targets=targets)
    _check_args(name, logits, targets, k)
    check_last_dim_contiguous(name, "logits", logits)
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"{name}: block_v must be a power of two >= 16, got {block_v}")
    num_rows, vocab = logits.shape
    lse = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    logprobs = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    ranks = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows > 0:
        _token_logprobs_kernel[(num_rows,)](logits, targets, lse, logprobs, ranks, logits.stride(0), vocab,
                                            BLOCK_V=min(block_v, triton.next_power_of_2(vocab)),
                                            num_warps=NUM_WARPS)
    top_values, top_ids = top_k(logits, k)
    top_logprobs = top_values.float() - lse[:, None]  # [N, k]
    return logprobs, ranks, top_ids, top_logprobs


