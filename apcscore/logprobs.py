"""Logprobs of chosen tokens, computed in row chunks so peak memory is O(chunk x vocab).

For each row: the target token's logprob (fp32 log_softmax), its rank (1 = argmax: one plus the number
of vocabulary entries with a strictly larger logprob) and the top-K ids and logprobs, sorted descending.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from apcscore.sequence import TokenLogprobs

LogprobFn = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, ...]]


def token_logprobs_torch(logits: torch.Tensor, targets: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """logits [N, V] (any float dtype), targets [N] -> logprobs [N] f32, ranks [N] i64, top ids [N, k], top logprobs [N, k]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V] fp32, one chunk
    target = logprobs.gather(1, targets[:, None])  # [N, 1]
    ranks = (logprobs > target).sum(dim=-1) + 1
    if k > 0:
        top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    else:
        top_logprobs = logprobs.new_zeros((logits.shape[0], 0))
        top_ids = targets.new_zeros((logits.shape[0], 0))
    return target[:, 0], ranks, top_ids, top_logprobs


def chunked_token_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                           targets: torch.Tensor, k: int, chunk_size: int,
                           fn: LogprobFn = token_logprobs_torch) -> TokenLogprobs:
    """Project `hidden` [N, H] to the vocabulary chunk by chunk and score `targets` [N]."""
    parts: list[tuple[torch.Tensor, ...]] = []
    for start in range(0, hidden.shape[0], chunk_size):
        logits = compute_logits(hidden[start:start + chunk_size])  # [chunk, V]
        parts.append(fn(logits, targets[start:start + chunk_size], k))
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
