"""Logprobs, ranks and top-K over a vocabulary-parallel LM head, without gathering [tokens, vocab].

Each rank holds the logits of its vocabulary rows [start, end) (models/tensor_parallel.vocab_range; each logit
is one fixed-order GEMM chain over the hidden size, so bitwise the logit degree 1 computes from the same hidden
state). Per row chunk, every rank computes
- its max m_r, its sum s_r = sum(exp(x - m_r)) and, on the rank that holds it, the target's logit;
- its top-K by (logit descending, token id ascending), padded to K;
and all of them are all-gathered once. The global max M is the max of the m_r (exact), the sum
S = sum_r s_r * exp(m_r - M) is added in rank order (fixed: it cannot depend on timing or message size), and
lse = M + log(S). The merged top-K is the first K of the gathered candidates in the same order as
kernels/logprobs_torch.top_k (every global top-K entry is in its own slice's top-K, so the merge is exact, ties by
lowest id across slices too). The rank is 1 + the sum over ranks of each slice's count of logits strictly above
the target's (integers: exact), one more gather. Everything per row, so batch invariant.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from apcscore.engine.step import TokenLogprobs
from apcscore.kernels.logprobs_torch import top_k
from apcscore.models.tensor_parallel import TensorParallel

LocalLogits = Callable[[torch.Tensor], torch.Tensor]  # hidden [N, H] -> fp32 logits of this rank's rows [N, Vr]


def _row_sums(x: torch.Tensor) -> torch.Tensor:
    """x [N, V] -> [N]: each row summed by itself. ATen splits a row across threads only in a call with one
    output row, so a single row is summed as a row of a two-row call (the same bits as in any larger call)."""
    if x.shape[0] == 1:
        return torch.cat([x, x]).sum(dim=-1)[:1]
    return x.sum(dim=-1)


def _chunk(tp: TensorParallel, logits: torch.Tensor, targets: torch.Tensor, k: int, ranks: bool, start: int,
           vocab: int) -> tuple[torch.Tensor, ...]:
    """One chunk: local logits [c, Vr] (this rank's vocabulary from `start`), targets [c] -> logprobs [c], ranks
    [c], top ids [c, k], top logprobs [c, k], the same on every rank."""
    c, local = logits.shape
    m = logits.amax(dim=-1)  # [c]
    s = _row_sums(torch.exp(logits - m[:, None]))  # [c]
    here = (targets >= start) & (targets < start + local)
    own = logits.gather(1, torch.where(here, targets - start, 0)[:, None])[:, 0]
    own = torch.where(here, own, float("-inf"))  # [c]: the target's logit on the rank that holds it
    kk = min(k, local)
    values, ids = top_k(logits, kk)  # [c, kk] each
    if kk < k:  # a slice smaller than K: padding sorts last (no finite logit is -inf)
        values = torch.cat([values, values.new_full((c, k - kk), float("-inf"))], dim=1)
        ids = torch.cat([ids, torch.full((c, k - kk), vocab, dtype=torch.int64, device=ids.device)], dim=1)
    # ids travel as fp32: exact below 2^24 (checked by the caller); [c, 3 + 2k]
    packed = torch.cat([m[:, None], s[:, None], own[:, None], values.float(), (ids + start).float()], dim=1)
    parts = tp.gather(packed)
    big_m = torch.stack([p[:, 0] for p in parts]).amax(dim=0)  # (a max: exact in any order)
    total = parts[0][:, 1] * torch.exp(parts[0][:, 0] - big_m)
    for p in parts[1:]:
        total = total + p[:, 1] * torch.exp(p[:, 0] - big_m)  # rank order
    lse = big_m + torch.log(total)  # [c]
    target_logit = torch.stack([p[:, 2] for p in parts]).amax(dim=0)  # one rank holds a valid target's logit
    valid = (targets >= 0) & (targets < vocab)
    logprobs = torch.where(valid, target_logit - lse, float("nan"))
    if ranks:
        above = (logits > target_logit[:, None]).sum(dim=1, dtype=torch.int64)  # [c]
        rank = torch.where(valid, torch.stack(tp.gather(above)).sum(dim=0) + 1, 0)  # integers: exact
    else:
        rank = torch.zeros_like(targets)
    cand_v = torch.cat([p[:, 3:3 + k] for p in parts], dim=1)  # [c, n * k]
    cand_i = torch.cat([p[:, 3 + k:] for p in parts], dim=1).long()
    # by id, then a stable sort by value keeps equal values in id order (the slices are ascending id ranges in
    # rank order, so the concatenation is already so for ties: this states the order rather than relying on it)
    by_id, order = cand_i.sort(dim=-1)
    vals, order2 = cand_v.gather(-1, order).sort(dim=-1, descending=True, stable=True)
    top_ids = by_id.gather(-1, order2)[:, :k]
    return logprobs, rank, top_ids, vals[:, :k] - lse[:, None]


def parallel_token_logprobs(tp: TensorParallel, local_logits: LocalLogits, hidden: torch.Tensor,
                            targets: torch.Tensor, k: int, chunk_size: int, ranks: bool, start: int,
                            vocab: int) -> TokenLogprobs:
    """The vocabulary-parallel counterpart of engine.logprobs.chunked_token_logprobs, run by every rank in step
    (the same hidden [N, H] and targets [N] on each): the same definitions of logprob, rank and top-K."""
    if vocab >= 2 ** 24:
        raise ValueError("tensor-parallel logprobs carry token ids as fp32: the vocabulary must be below 2^24")
    parts = [_chunk(tp, local_logits(hidden[i:i + chunk_size]), targets[i:i + chunk_size], k, ranks, start, vocab)
             for i in range(0, hidden.shape[0], chunk_size)]
    if not parts:
        return TokenLogprobs.concat([], k)
    lp, rank, top_ids, top_lp = (torch.cat([p[i] for p in parts]) for i in range(4))
    return TokenLogprobs(token_ids=targets.cpu().numpy().astype(np.int64), token_logprobs=lp.float().cpu().numpy(),
                         ranks=rank.cpu().numpy().astype(np.int64), top_ids=top_ids.cpu().numpy().astype(np.int64),
                         top_logprobs=top_lp.float().cpu().numpy())


def gathered_logits(tp: TensorParallel, local: torch.Tensor, vocab: int) -> torch.Tensor:
    """Every rank's logits [S, Vr] side by side: [S, vocab] (for sampling: S rows, one per sampling sequence).
    A concatenation, no arithmetic: the same values on every rank."""
    per = -(-vocab // tp.world_size)
    if local.shape[1] < per:  # the last slice may be shorter: pad to the common width
        local = torch.cat([local, local.new_full((local.shape[0], per - local.shape[1]), float("-inf"))], dim=1)
    return torch.cat(tp.gather(local), dim=1)[:, :vocab]
