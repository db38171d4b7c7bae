"""The exact divergence of a model from a reference at each scored row, from both models' logits of that row:
KL(reference || model) over the whole vocabulary, the reference's logprob of the target, delta p (the model's
probability of the target minus the reference's) and whether the two argmaxes agree. Imports no Triton.

KL(r || m) = sum_v p_r(v) (log p_r(v) - log p_m(v)), every term in double: each row's log-sum-exp as the
logprob path takes it (apcscore.kernels.rowmath.row_logsumexp: fp64 in a fixed order on the CPU), the
logprobs as logit - lse in double, p_r by our double exp on the CPU (torch's elsewhere), and the sum over the
vocabulary a fixed pairwise tree of elementwise adds (`tree_sum`): the same operations, in the same order, for a
row whatever else is in the batch, on every CPU and thread count (and on CUDA, where torch's double exp and log
are per GPU model anyway). Entries the reference gives probability 0 contribute 0.

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


def _lse(logits: torch.Tensor) -> torch.Tensor:
    """The row log-sum-exp [N] in float64: the logprob path's on the CPU (rowmath.row_logsumexp), elsewhere
    max + log(tree_sum(exp(x - max))) in double."""
    if rowmath.ours(logits):
        return rowmath.row_logsumexp(logits)
    x = logits.double()
    top = x.amax(dim=-1, keepdim=True)  # [N, 1]
    return (top + torch.log(tree_sum(torch.exp(x - top))[:, None]))[:, 0]


def _exp(x: torch.Tensor) -> torch.Tensor:
    """exp of a float64 tensor: our double exp on the CPU (the same bits everywhere), torch's elsewhere."""
    if rowmath.ours(x):
        return cpu_math.map_double(cpu_math.D_EXP, x).view(x.shape)
    return torch.exp(x)


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
    """row_divergence of at most TILE_ROWS rows."""
    lp = logits.double() - _lse(logits)[:, None]  # [n, V] f64: the model's logprobs
    ref_lp = ref_logits.double() - _lse(ref_logits)[:, None]  # [n, V] f64: the reference's
    ref_p = _exp(ref_lp)  # [n, V]
    terms = torch.where(ref_p > 0, ref_p * (ref_lp - lp), 0.0)  # p_r (log p_r - log p_m); 0 where p_r is 0
    kl = tree_sum(terms)  # [n]
    del terms
    at = targets[:, None]
    target_lp, target_ref_lp = lp.gather(1, at), ref_lp.gather(1, at)  # [n, 1] f64
    delta_p = (_exp(target_lp) - _exp(target_ref_lp))[:, 0]
    agree = logits.argmax(dim=-1) == ref_logits.argmax(dim=-1)
    return kl, target_ref_lp[:, 0].float(), delta_p, agree
