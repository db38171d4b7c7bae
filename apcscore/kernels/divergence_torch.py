"""The exact divergence of a model from a reference at each scored row, from both models' logits of that row:
KL(reference || model) over the whole vocabulary, the reference's logprob of the target, delta p (the model's
probability of the target minus the reference's) and whether the two argmaxes agree. Imports no Triton.

KL(r || m) = sum_v p_r(v) (log p_r(v) - log p_m(v)), every term in double: each row less its maximum (exact in
double), its exps by our double exp on the CPU (torch's elsewhere), their sums and the sum over the vocabulary of
p_r times the logprob difference each a fixed pairwise tree of elementwise adds (`tree_sum`), and our double log:
the same operations, in the same order, for a row whatever else is in the batch, on every CPU and thread count
(and on CUDA, where torch's double exp and log are per GPU model anyway). Entries the reference gives probability 0
contribute 0. Both log-sum-exps are taken this way, not with the logprob path's fp32 exps: their ~1e-7 would move
a KL of 1e-3 by 1e-4 of itself. The reference's token logprob is the logprob path's (the bits the reference alone
gives).

Rows are taken `TILE_ROWS` at a time, so the double temporaries stay O(tile x vocab) within the caller's
O(chunk x vocab) logits.
"""

from __future__ import annotations

import torch

from apcscore.kernels import cpu_math, rowmath

TILE_ROWS = 32  # rows whose [rows, vocab] double temporaries live at once (rows are independent: any value works)


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sums over the last dimension of x [N, V] (float64), by a fixed pairwise tree: the row is zero-padded to a
    power of two, then halves are added elementwise until one column is left. Elementwise adds round the same on
    every device, vector width and thread count, and a row's sum never depends on the other rows."""
    width = 1 << max(0, (x.shape[-1] - 1).bit_length())
    if width != x.shape[-1]:
        x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x[..., 0]


def _map(fn: int, x: torch.Tensor) -> torch.Tensor:
    """exp or log (cpu_math.D_EXP / D_LOG) of a float64 tensor: ours on the CPU (the same bits everywhere),
    torch's elsewhere."""
    if rowmath.ours(x):
        return cpu_math.map_double(fn, x).view(x.shape)
    return torch.exp(x) if fn == cpu_math.D_EXP else torch.log(x)


def _shifted_exp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [n, V] fp32 -> x = logit - row max [n, V] f64 (exact), e = exp(x) [n, V] f64, S = tree_sum(e) [n]:
    every double, so log S, and with it each logprob x - log S, is good to ~1e-16 (why: the module doc)."""
    x = logits.double() - logits.amax(dim=-1, keepdim=True).double()
    e = _map(cpu_math.D_EXP, x)
    return x, e, tree_sum(e)


def row_divergence(logits: torch.Tensor, ref_logits: torch.Tensor, targets: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits, ref_logits [N, V] fp32 (the model's and the reference's for the same rows), targets [N] int64 ->
    KL(reference || model) [N] f64, the reference's target logprob [N] f32 (logit - lse in double, rounded once:
    the bits the logprob path gives the reference alone on the CPU), delta p [N] f64 (p_model(target) -
    p_ref(target)) and top-1 agreement [N] bool (the first argmax of each, compared)."""
    if logits.shape != ref_logits.shape or logits.ndim != 2 or targets.shape != (logits.shape[0],):
        raise ValueError(f"row_divergence: logits and ref_logits must be [N, V] and targets [N], got "
                         f"{tuple(logits.shape)}, {tuple(ref_logits.shape)} and {tuple(targets.shape)}")
    parts = [_tile(logits[i:i + TILE_ROWS], ref_logits[i:i + TILE_ROWS], targets[i:i + TILE_ROWS])
             for i in range(0, logits.shape[0], TILE_ROWS)]
    if not parts:
        empty = torch.empty(0, dtype=torch.float64, device=logits.device)
        return empty, empty.float(), empty, torch.empty(0, dtype=torch.bool, device=logits.device)
    kl, ref_lp, delta_p, agree = (torch.cat([p[i] for p in parts]) for i in range(4))
    return kl, ref_lp, delta_p, agree


def _tile(logits: torch.Tensor, ref_logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """row_divergence of at most TILE_ROWS rows. With x, y the two rows less their maxima, e = exp, S = sum e:
    KL = sum_v p_r (y - ln S_r - x + ln S_m) = (sum_v e_r (y - x)) / S_r + ln S_m - ln S_r (as sum p_r = 1)."""
    at = targets[:, None]
    x, e, s_m = _shifted_exp(logits)  # the model's
    p_target = e.gather(1, at)[:, 0] / s_m
    del e
    y, e_r, s_r = _shifted_exp(ref_logits)  # the reference's
    terms = torch.where(e_r > 0, e_r * (y - x), 0.0)  # 0 where the reference's probability is 0
    logs = _map(cpu_math.D_LOG, torch.stack([s_m, s_r]))  # [2, n]
    kl = tree_sum(terms) / s_r + (logs[0] - logs[1])  # [n]
    delta_p = p_target - e_r.gather(1, at)[:, 0] / s_r
    # the reference's token logprob as the logprob path computes it alone (its log-sum-exp), rounded once
    lse = rowmath.row_logsumexp(ref_logits) if rowmath.ours(ref_logits) else ref_logits.amax(-1).double() + logs[1]
    ref_lp = (ref_logits.gather(1, at)[:, 0].double() - lse).float()
    agree = logits.argmax(dim=-1) == ref_logits.argmax(dim=-1)
    return kl, ref_lp, delta_p, agree
