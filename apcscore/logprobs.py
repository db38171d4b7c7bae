"""Logprobs of chosen tokens, computed in row chunks so peak memory is O(chunk x vocab).

For each row: the target token's logprob (fp32 log_softmax), its rank (1 = argmax: one plus the number
of vocabulary entries with a strictly larger logprob) and the top-K ids and logprobs, sorted descending.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from apcscore.sequence import TokenLogprobs

LogprobFn = Callable[..., tuple[torch.Tensor, ...]]  # (logits [N, V], targets [N], k, ranks=bool) -> 4 tensors


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k values (input dtype) and ids of each row, sorted by descending logit: [N, k], [N, k] int64."""
    if k == 0:
        empty = logits.new_empty((logits.shape[0], 0))
        return empty, torch.empty((logits.shape[0], 0), dtype=torch.int64, device=logits.device)
    return torch.topk(logits, k, dim=-1, largest=True, sorted=True)


def token_logprobs_torch(logits: torch.Tensor, targets: torch.Tensor, k: int, ranks: bool = True
                         ) -> tuple[torch.Tensor, ...]:
    """logits [N, V] (any float dtype), targets [N] int64 -> logprobs [N] f32, ranks [N] i64, top ids [N, k] i64,
    top logprobs [N, k] f32. The reference the fused Triton kernel is tested against.

    Materialises [N, V] fp32 logprobs, so the caller passes row chunks. Ranks compare the input logits; a
    target outside [0, V) gets logprob NaN and rank 0 (checking would cost a device sync). ranks=False skips
    counting them (all 0).
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
    log_probs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # [N, V]
    logprobs = torch.where(valid, log_probs.gather(1, safe).squeeze(1), float("nan"))
    if ranks:
        greater = (logits > logits.gather(1, safe)).sum(dim=1, dtype=torch.int32).long()  # [N] (int32: faster)
        rank = torch.where(valid, greater + 1, 0)
    else:
        rank = torch.zeros_like(targets)
    _, top_ids = top_k(logits, k)
    return logprobs, rank, top_ids, log_probs.gather(1, top_ids)


def chunked_token_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                           targets: torch.Tensor, k: int, chunk_size: int,
                           fn: LogprobFn = token_logprobs_torch, ranks: bool = True) -> TokenLogprobs:
    """Project `hidden` [N, H] to the vocabulary chunk by chunk and score `targets` [N] (ranks: see fn)."""
    parts: list[tuple[torch.Tensor, ...]] = []
    for start in range(0, hidden.shape[0], chunk_size):
        logits = compute_logits(hidden[start:start + chunk_size])  # [chunk, V]
        parts.append(fn(logits, targets[start:start + chunk_size], k, ranks=ranks))
    if not parts:
        return TokenLogprobs.concat([], k)
    lp, ranks, top_ids, top_lp = (torch.cat([p[i] for p in parts]) for i in range(4))
    return TokenLogprobs(
        token_ids=targets.cpu().numpy().astype(np.int64),
        token_logprobs=lp.float().cpu().numpy(),
        ranks=ranks.cpu().numpy().astype(np.int64),
        top_ids=top_ids.cpu().numpy().astype(np.int64),
        top_logprobs=top_lp.float().cpu().numpy(),
    )
