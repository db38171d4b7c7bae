"""The engine's logprob driver: hidden states are projected to the vocabulary and scored in row chunks, so
peak memory is O(chunk x vocab).

For each row: the target token's logprob (fp32 log_softmax), its rank (1 = argmax: one plus the number
of vocabulary entries with a strictly larger logprob) and the top-K ids and logprobs, sorted descending,
computed by the backend's logprob function (apcscore.kernels.logprobs_torch on the CPU, the fused
apcscore.kernels.logprobs on CUDA).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from apcscore.engine.step import TokenLogprobs
from apcscore.kernels.logprobs_torch import token_logprobs_torch

LogprobFn = Callable[..., tuple[torch.Tensor, ...]]  # (logits [N, V], targets [N], k, ranks=bool) -> 4 tensors


def chunked_token_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                           targets: torch.Tensor, k: int, chunk_size: int,
                           fn: LogprobFn = token_logprobs_torch, ranks: bool = True,
                           beside: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None) -> TokenLogprobs:
    """Project `hidden` [N, H] to the vocabulary chunk by chunk and score `targets` [N] (ranks: see fn).

    beside: called after each chunk with (its first row, its logits [chunk, V], its targets [chunk]), while
    the logits are alive (the reference model's divergence, engine/reference.py).
    """
    parts: list[tuple[torch.Tensor, ...]] = []
    for start in range(0, hidden.shape[0], chunk_size):
        logits = compute_logits(hidden[start:start + chunk_size])  # [chunk, V]
        parts.append(fn(logits, targets[start:start + chunk_size], k, ranks=ranks))
        if beside is not None:
            beside(start, logits, targets[start:start + chunk_size])
    if not parts:
        return TokenLogprobs.concat([], k)
    return to_token_logprobs(targets, *(torch.cat([p[i] for p in parts]) for i in range(4)))


def to_token_logprobs(targets: torch.Tensor, lp: torch.Tensor, ranks: torch.Tensor, top_ids: torch.Tensor,
                      top_lp: torch.Tensor) -> TokenLogprobs:
    """A logprob function's four outputs for `targets` [N] as host TokenLogprobs (int64 ids and ranks, fp32)."""
    return TokenLogprobs(
        token_ids=targets.cpu().numpy().astype(np.int64),
        token_logprobs=lp.float().cpu().numpy(),
        ranks=ranks.cpu().numpy().astype(np.int64),
        top_ids=top_ids.cpu().numpy().astype(np.int64),
        top_logprobs=top_lp.float().cpu().numpy(),
    )
