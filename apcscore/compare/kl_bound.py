"""KL(base || new) per position from two files' top-K logprobs: the smallest KL any pair of full distributions
consistent with both files could have (docs/compare.md, "The KL estimator")."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Doubt on a tail mass (1 - sum of the known probabilities): a float32 log-softmax over a 49152-token
# vocabulary sums to 1 only within ~1.6e-5 (measured on SmolLM2-135M), and stored logprobs are float32.
TAIL_TOL = 1e-5


@dataclass
class TopKLogprobs:
    """What one file knows of the next-token distribution at n positions: top_ids / top_logprobs [n, K] descending,
    padded with -1 / -inf (K may be 0); target_ids / target_logprobs [n], the scored token and its logprob."""

    target_ids: np.ndarray  # [n] int64
    target_logprobs: np.ndarray  # [n] float64
    top_ids: np.ndarray  # [n, K] int64, -1 = padding
    top_logprobs: np.ndarray  # [n, K] float64, -inf = padding


def _known(side: TopKLogprobs, vocab_size: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Known tokens of one side (top-K plus the target), their probabilities, tail mass and tail cap.

    Returns ids [n, K+1] (-1 = not a known token), probs [n, K+1] (0 there), tail [n] = 1 - sum(probs)
    clipped to [0, 1] (NaN where the known tokens cover the whole vocabulary: no tail exists), cap [n] = the
    smallest top-K probability, an upper bound on every token outside the top-K (1 when K = 0).
    """
    n = len(side.target_ids)
    top_ids = side.top_ids.reshape(n, -1)  # [n, K]
    top_p = np.where(top_ids >= 0, np.exp(side.top_logprobs.reshape(n, -1)), 0.0)  # [n, K]
    in_top = (top_ids == side.target_ids[:, None]).any(axis=1)  # [n]
    extra_id = np.where(in_top, -1, side.target_ids)  # [n]
    extra_p = np.where(in_top, 0.0, np.exp(side.target_logprobs))  # [n]
    ids = np.concatenate([top_ids, extra_id[:, None]], axis=1)  # [n, K+1]
    probs = np.concatenate([top_p, extra_p[:, None]], axis=1)  # [n, K+1]
    tail = np.clip(1.0 - probs.sum(axis=1), 0.0, 1.0)  # [n]
    if vocab_size is not None:
        tail = np.where((ids >= 0).sum(axis=1) >= vocab_size, np.nan, tail)
    cap = np.where(top_ids >= 0, top_p, np.inf).min(axis=1, initial=np.inf)  # [n]
    cap = np.where(np.isfinite(cap), cap, 1.0)
    return ids, probs, tail, cap


def _plogq(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Elementwise p * ln(p / q), 0 where p = 0 (q <= 0 with p > 0 is read as q = TAIL_TOL, not infinity)."""
    safe_q = np.where(q > 0, q, TAIL_TOL)
    safe_p = np.where(p > 0, p, 1.0)
    return np.where(p > 0, p * np.log(safe_p / safe_q), 0.0)


def _bisect(fn, m: int, lo: float = -60.0, hi: float = 60.0, steps: int = 64) -> np.ndarray:
    """Root in t of fn(t) for m independent decreasing functions (vectorized bisection on [lo, hi])."""
    lo_t = np.full(m, lo)
    hi_t = np.full(m, hi)
    for _ in range(steps):
        mid = 0.5 * (lo_t + hi_t)
        right = fn(mid) > 0  # decreasing: positive means the root lies to the right
        lo_t = np.where(right, mid, lo_t)
        hi_t = np.where(right, hi_t, mid)
    return 0.5 * (lo_t + hi_t)


def solve_unknown_masses(
    a: np.ndarray, cap_q: np.ndarray, b: np.ndarray, cap_p: np.ndarray, tail_p: np.ndarray, tail_q: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Choose the unknown masses that make KL(p || q) smallest, by the KKT conditions docs/compare.md, "The KL
    estimator", derives (A, B and the bucket R there).

    a [m, ka]: base probabilities of tokens base knows and new does not (0 = no token); their new
    probabilities x are unknown, each in [0, cap_q]. b [m, kb]: the same for new, y each in [0, cap_p].
    Returns x [m, ka], y [m, kb] and the bucket's masses PR = tail_p - sum(y), QR = tail_q - sum(x) [m].
    """
    m = len(tail_p)

    def x_of(r: np.ndarray, i: slice | np.ndarray = slice(None)) -> np.ndarray:  # [m, ka]
        return _fill(a[i], cap_q[i], 1.0 / r)

    def y_of(r: np.ndarray, i: slice | np.ndarray = slice(None)) -> np.ndarray:  # [m, kb]
        return _fill(b[i], cap_p[i], r)

    def g(t: np.ndarray) -> np.ndarray:  # PR - r QR, decreasing in r = e^t
        r = np.exp(t)
        return (tail_p - y_of(r).sum(axis=1)) - r * (tail_q - x_of(r).sum(axis=1))

    r = np.exp(_bisect(g, m))
    x, y = x_of(r), y_of(r)
    pr, qr = tail_p - y.sum(axis=1), tail_q - x.sum(axis=1)
    e = np.flatnonzero((pr < 0) | (qr < 0))  # no bucket: solve sum(x) = tail_q and sum(y) = tail_p separately
    if len(e):
        mu = np.exp(_bisect(lambda t: x_of(np.exp(t), e).sum(axis=1) - tail_q[e], len(e)))
        rho = np.exp(-_bisect(lambda t: y_of(np.exp(-t), e).sum(axis=1) - tail_p[e], len(e)))
        x[e], y[e], pr[e], qr[e] = x_of(mu, e), y_of(rho, e), 0.0, 0.0
    return x, y, np.maximum(pr, 0.0), np.maximum(qr, 0.0)


def _fill(v: np.ndarray, cap: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """[m, k] min(cap, scale * v) where v > 0, else 0 (cap and scale per row)."""
    return np.where(v > 0, np.minimum(cap[:, None], v * scale[:, None]), 0.0)


def _compact(v: np.ndarray) -> np.ndarray:
    """[m, k] -> [m, k'] with each row's positive entries first and k' = the largest count of them (>= 1)."""
    v = -np.sort(-v, axis=1)
    return v[:, : max(1, int((v > 0).sum(axis=1).max(initial=0)))]


def _match(ids: np.ndarray, other: np.ndarray) -> np.ndarray:
    """[n, K] column in `other`'s row of each known id (>= 0) of `ids`, -1 where that row lacks it or it is
    padding. A row's known ids are distinct. One sort of row-tagged keys: O(n x K) memory, not O(n x K x K')."""
    n = len(ids)
    if n == 0 or ids.shape[1] == 0 or other.shape[1] == 0:
        return np.full(ids.shape, -1, dtype=np.int64)
    span = int(max(ids.max(), other.max())) + 2  # keys: row * span + id + 1, distinct across rows
    rows = np.arange(n, dtype=np.int64)[:, None] * span  # [n, 1]
    keys = (rows + other + 1).ravel()  # [n * K']
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    wanted = (rows + ids + 1).ravel()  # [n * K]
    at = np.minimum(np.searchsorted(sorted_keys, wanted), len(sorted_keys) - 1)
    hit = (sorted_keys[at] == wanted) & (ids.ravel() >= 0)
    return np.where(hit, order[at] % other.shape[1], -1).reshape(ids.shape)


def kl_divergence_topk(base: TopKLogprobs, new: TopKLogprobs, vocab_size: int | None = None) -> np.ndarray:
    """Per-position KL(base || new) in nats, [n] float64: a lower bound of the true KL (never a false alarm), exact
    when each side's known tokens cover the vocabulary, 0 when both sides are equal. Tokens both sides know
    contribute p ln(p/q) exactly; `solve_unknown_masses` places the rest."""
    ids_p, p, tail_p, cap_p = _known(base, vocab_size)  # [n, Kp+1], [n, Kp+1], [n], [n]
    ids_q, q, tail_q, cap_q = _known(new, vocab_size)  # [n, Kq+1], ...
    # Rounding: float32 logprobs leave ~TAIL_TOL of doubt on a tail mass, so the new tail is taken as at least
    # min(TAIL_TOL, base tail): more room for q only lowers the minimum (still a lower bound), a tail rounded
    # to 0 cannot make the KL infinite, and noise-sized tails do not add negative terms. A covered vocabulary
    # has no tail at all.
    tail_p = np.where(np.isnan(tail_p), 0.0, tail_p)
    tail_q = np.where(np.isnan(tail_q), 0.0, np.maximum(tail_q, np.minimum(TAIL_TOL, tail_p)))
    col = _match(ids_p, ids_q)  # [n, Kp+1]: where each base token is among new's known tokens, -1 if not
    in_q, in_p = col >= 0, _match(ids_q, ids_p) >= 0  # [n, Kp+1], [n, Kq+1]
    q_of_p = np.take_along_axis(q, np.maximum(col, 0), axis=1)  # [n, Kp+1], meaningful where in_q
    kl = _plogq(np.where(in_q, p, 0.0), q_of_p).sum(axis=1)  # [n]: tokens both sides know
    a = np.where(in_q, 0.0, p)  # [n, Kp+1] base-only tokens
    b = np.where(in_p, 0.0, q)  # [n, Kq+1] new-only tokens
    open_ = (a > 0).any(axis=1) | (b > 0).any(axis=1)  # [n] positions whose known sets differ
    # Positions with the same known tokens: the two tails form one bucket.
    kl = kl + np.where(open_, 0.0, _plogq(tail_p, tail_q))
    if open_.any():
        i = np.flatnonzero(open_)
        ai, bi = _compact(a[i]), _compact(b[i])  # [m, ka], [m, kb]: usually a token or two differ
        x, y, pr, qr = solve_unknown_masses(ai, cap_q[i], bi, cap_p[i], tail_p[i], tail_q[i])
        kl[i] += _plogq(ai, x).sum(axis=1) + _plogq(y, bi).sum(axis=1) + _plogq(pr, qr)
    return np.maximum(kl, 0.0)
