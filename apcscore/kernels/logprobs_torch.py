"""The torch reference of the logprob kernel (apcscore.kernels.logprobs), and the path the CPU engine runs.

For each row of logits and its target token: the target's logprob under an fp32 log_softmax, its rank
(1 + the number of vocabulary entries with a strictly greater logit, so 1 = argmax and ties share a rank),
and the top-k token ids with their logprobs, sorted by descending logit, equal logits by ascending token id
(`top_k`). Imports no Triton.

On the CPU (where apcscore's portable math is built) the log-softmax is not torch's: each row's log-sum-exp is
taken in double in a fixed order (apcscore.kernels.rowmath.row_logsumexp), and a logprob is logit - lse in
double, rounded once to fp32: the same bits on every CPU, and closer to the exact value than an fp32
log_softmax. Only the entries asked for (targets, top-k) are computed, so no [N, V] logprob tensor is made.
"""

from __future__ import annotations

from typing import Callable

import torch

from apcscore.kernels import rowmath
from apcscore.kernels.buffers import reused_buffer


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k values (input dtype) and ids of each row, sorted by descending logit: [N, k], [N, k] int64.

    Ties are ordered by token id, lowest first (a stable sort by descending logit), also where a tie crosses
    the k-th place: the k entries kept are the first k of that order. So top_ids[:, 0] is torch.argmax (its
    first maximum), on every device. torch.topk alone leaves the order of equal values unspecified (CUDA and
    CPU differ). A row with a tie across the k-th place costs a device sync and a pass over its row.
    """
    num_rows, vocab = logits.shape
    if k == 0:
        empty = logits.new_empty((num_rows, 0))
        return empty, torch.empty((num_rows, 0), dtype=torch.int64, device=logits.device)
    values, ids = torch.topk(logits, min(k + 1, vocab), dim=-1, largest=True, sorted=True)
    if k < vocab:
        crossing = values[:, k - 1] == values[:, k]  # the k-th value also lies outside the kept k
        values, ids = values[:, :k], ids[:, :k]
        if bool(crossing.any()):
            values, ids = values.clone(), ids.clone()
            for row in crossing.nonzero().flatten().tolist():
                kth = values[row, k - 1]
                above = (logits[row] > kth).nonzero().flatten()  # fewer than k entries
                tied = (logits[row] == kth).nonzero().flatten()[:k - above.shape[0]]  # lowest ids (ascending)
                ids[row] = torch.cat([above, tied])
                values[row] = logits[row, ids[row]]
    by_id, order = ids.sort(dim=-1)  # then a stable sort by value keeps equal values in id order
    values, order2 = values.gather(-1, order).sort(dim=-1, descending=True, stable=True)
    return values, by_id.gather(-1, order2)


def _logprobs_portable(logits: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """ids [N, j] -> their fp32 logprobs: logit - the row's log-sum-exp, in double, rounded once (module doc)."""
    lse = rowmath.row_logsumexp(logits)[:, None]  # [N, 1] fp64
    return lambda ids: (logits.gather(1, ids).double() - lse).float()


def _logprobs_torch(logits: torch.Tensor, reuse_buffers: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """ids [N, j] -> their logprobs under torch's fp32 log_softmax (materialised [N, V], in a reused buffer or not)."""
    if not reuse_buffers:
        log_probs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # [N, V]
    else:
        out = reused_buffer("log_softmax", logits.shape, torch.float32, logits.device)
        log_probs = torch._log_softmax(logits.float(), -1, False, out=out)
    return lambda ids: log_probs.gather(1, ids)


def token_logprobs_torch(logits: torch.Tensor, targets: torch.Tensor, k: int, ranks: bool = True,
                         reuse_buffers: bool = False) -> tuple[torch.Tensor, ...]:
    """logits [N, V] (any float dtype), targets [N] int64 -> logprobs [N] f32, ranks [N] i64, top ids [N, k] i64,
    top logprobs [N, k] f32. The reference the fused Triton kernel is tested against.

    Materialises [N, V] fp32 logprobs, so the caller passes row chunks. Ranks compare the input logits; a
    target outside [0, V) gets logprob NaN and rank 0 (checking would cost a device sync). ranks=False skips
    counting them (all 0). reuse_buffers: the [N, V] temporaries live in this thread's reused buffers
    (kernels/buffers.py; the same bits).
    """
    if logits.ndim != 2 or targets.shape != (logits.shape[0],):
        raise ValueError(f"token_logprobs_torch: logits must be [N, V] and targets [N], got "
                         f"{tuple(logits.shape)} and {tuple(targets.shape)}")
    if targets.dtype != torch.int64 or not logits.is_floating_point() or k < 0 or k > logits.shape[1]:
        raise ValueError(f"token_logprobs_torch: needs float logits, int64 targets and 0 <= k <= V; got "
                         f"{logits.dtype}, {targets.dtype}, k={k}")
    vocab = logits.shape[1]
    valid = (targets >= 0) & (targets < vocab)  # [N]
    safe = torch.where(valid, targets, 0)[:, None]  # [N, 1]
    logprobs_at = _logprobs_portable(logits) if rowmath.ours(logits) else _logprobs_torch(logits, reuse_buffers)
    logprobs = torch.where(valid, logprobs_at(safe).squeeze(1), float("nan"))
    if ranks:
        if not reuse_buffers:
            greater = (logits > logits.gather(1, safe)).sum(dim=1, dtype=torch.int32).long()  # [N]
        else:
            # 0/1 as fp32 into a reused buffer, summed in fp32: exact (counts < 2^24). Summing the bool
            # comparison instead first casts it to a fresh [N, V] integer tensor (a new mmap each chunk;
            # the cost: docs/benchmarks.md).
            if logits.shape[1] >= 2 ** 24:
                raise ValueError("token_logprobs_torch: fp32 rank counts need a vocabulary below 2^24")
            above = torch.gt(logits, logits.gather(1, safe),
                             out=reused_buffer("rank_count", logits.shape, torch.float32, logits.device))  # [N, V]
            greater = above.sum(dim=1).long()  # [N]
        rank = torch.where(valid, greater + 1, 0)
    else:
        rank = torch.zeros_like(targets)
    _, top_ids = top_k(logits, k)
    return logprobs, rank, top_ids, logprobs_at(top_ids)
