"""`apcscore compare`: paired statistics on the compared records (numpy and the standard library only): McNemar's
exact test and the exact bounds of an accuracy drop, the paired bootstrap over records, the minimum detectable
effects and the margin tests; docs/compare.md, "Paired statistics" and "Margins", gives the methods and formulas."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np
import pyarrow as pa

from apcscore.compare.metrics import Positions, choice_correct, column, token_counts

POWER = 0.8  # the power the minimum detectable effect is given at
DEFAULT_ALPHA = 0.05  # the level of the reported tests and intervals when --significance is not given
DEFAULT_SAMPLES = 2000  # bootstrap resamples
DEFAULT_SEED = 0
_CHUNK = 1 << 22  # resampled indices drawn at once (32 MiB of int64)


@dataclass
class McNemar:
    """Exact McNemar test of one correctness column ("acc": correct, "acc_norm": correct_norm)."""

    kind: str
    num_records: int  # records with a prediction on both sides
    lost: int  # right in the baseline, wrong in the candidate
    gained: int  # wrong in the baseline, right in the candidate
    p_value: float  # exact, two-sided
    mde: float | None  # smallest accuracy drop (fraction) detectable at alpha with POWER; None: no flips at all
    # one-sided bounds at 1 - alpha of the accuracy drop (base - new, fraction): exact, conditional on the flips
    drop_lower: float = math.nan
    drop_upper: float = math.nan


@dataclass
class Interval:
    """Paired bootstrap of one per-record figure (a delta candidate - baseline, or a distance)."""

    figure: str  # "ln PPL ratio" | "mean KL" | "top-1 agreement" | "accuracy" | "acc_norm"
    num_records: int
    estimate: float  # the figure on the records as they are
    low: float  # two-sided percentile interval at the reported confidence 1 - alpha
    high: float
    se: float  # standard deviation of the bootstrap replicates (ddof=1)
    mde: float  # (z_(1-alpha/2) + z_POWER) * se
    worse_if: str  # "positive" (NLL or KL rises) | "negative" (accuracy or agreement falls)
    lower: float = math.nan  # one-sided bounds at 1 - alpha: the alpha and 1 - alpha quantiles of the replicates
    upper: float = math.nan


@dataclass
class PairedStats:
    """Every paired statistic of a comparison and the settings that produced it."""

    alpha: float
    confidence: float  # 1 - alpha, of the bootstrap intervals
    samples: int
    seed: int
    power: float = POWER
    mcnemar: list[McNemar] = field(default_factory=list)
    intervals: list[Interval] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # where the sample is too small to decide


def _log_binom_pmf_half(n: int) -> np.ndarray:
    """ln P(X = k) for X ~ Binomial(n, 1/2), k = 0..n. [n + 1]"""
    k = np.arange(1, n + 1)
    return np.concatenate([[0.0], np.cumsum(np.log((n - k + 1) / k))]) - n * math.log(2)


def mcnemar_exact_p(lost: int, gained: int) -> float:
    """Two-sided exact McNemar p: the binomial test of lost among lost + gained discordant pairs at 1/2."""
    n = lost + gained
    if n == 0 or lost == gained:
        return 1.0
    logs = _log_binom_pmf_half(n)[: min(lost, gained) + 1]  # [min + 1] the lower tail
    top = logs.max()
    return float(min(1.0, 2 * math.exp(top) * np.exp(logs - top).sum()))


def mcnemar_mde(n: int, discordant: int, alpha: float, power: float = POWER) -> float | None:
    """Smallest accuracy drop (fraction) McNemar's test detects at two-sided `alpha` with `power` for n records with
    `discordant` flips (normal approximation, Connor 1987; docs/compare.md). None when there are no flips."""
    if n <= 0 or discordant <= 0:
        return None
    psi, za, zb = discordant / n, NormalDist().inv_cdf(1 - alpha / 2), NormalDist().inv_cdf(power)
    a = 1 + zb * zb / n  # the quadratic in u = sqrt(n) d: a u^2 - 2 za sqrt(psi) u + (za^2 - zb^2) psi = 0
    disc = za * za * psi - a * (za * za - zb * zb) * psi
    u = (za * math.sqrt(psi) + math.sqrt(max(disc, 0.0))) / a
    return u / math.sqrt(n)


def binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), summed in log space (lgamma), exact to rounding for n in the millions."""
    if k < 0:
        return 0.0
    if k >= n or p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    i = np.arange(k + 1)
    logs = (math.lgamma(n + 1) - np.array([math.lgamma(x + 1) + math.lgamma(n - x + 1) for x in i])
            + i * math.log(p) + (n - i) * math.log1p(-p))  # [k + 1]
    top = logs.max()
    return float(min(1.0, math.exp(top) * np.exp(logs - top).sum()))


def clopper_pearson(k: int, n: int, alpha: float) -> tuple[float, float]:
    """One-sided exact (Clopper-Pearson) bounds (lower, upper) at 1 - alpha of a proportion from k successes in n
    trials, by bisection (scipy.stats.binomtest(k, n).proportion_ci(method="exact") at 1 - 2 alpha)."""

    def solve(j: int, target: float) -> float:  # the p where P(X <= j; p) = target (decreasing in p)
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if binom_cdf(j, n, mid) > target else (lo, mid)
        return (lo + hi) / 2

    lower = 0.0 if k == 0 else solve(k - 1, 1 - alpha)  # P(X >= k; p) = alpha
    upper = 1.0 if k == n else solve(k, alpha)
    return lower, upper


def mcnemar(kind: str, correct_base: np.ndarray, correct_new: np.ndarray, alpha: float) -> McNemar:
    """The exact McNemar test of two aligned boolean arrays [n], with the exact one-sided bounds of the accuracy drop
    (the Clopper-Pearson bounds of lost / (lost + gained): docs/compare.md, "Paired statistics")."""
    lost = int(np.sum(correct_base & ~correct_new))
    gained = int(np.sum(~correct_base & correct_new))
    n = len(correct_base)
    t = McNemar(kind, n, lost, gained, mcnemar_exact_p(lost, gained), mcnemar_mde(n, lost + gained, alpha))
    if n:
        t.drop_lower, t.drop_upper = drop_bounds(lost, gained, n, alpha)
    return t


def drop_bounds(lost: int, gained: int, n: int, alpha: float) -> tuple[float, float]:
    """One-sided exact bounds at 1 - alpha of the accuracy drop (lost - gained) / n = m (2 q - 1) / n, from the
    Clopper-Pearson bounds of q = lost / m, m = lost + gained."""
    m = lost + gained
    q_lower, q_upper = clopper_pearson(lost, m, alpha) if m else (0.5, 0.5)
    return m * (2 * q_lower - 1) / n, m * (2 * q_upper - 1) / n


def bootstrap_replicates(num: np.ndarray, den: np.ndarray, samples: int, seed: int) -> np.ndarray:
    """sum(num[i]) / sum(den[i]) over `samples` resamples drawn as default_rng(seed).integers(0, n, (samples, n)), the
    draws of scipy.stats.bootstrap, in chunks that bound the memory. [samples]"""
    n = len(num)
    rng = np.random.default_rng(seed)
    out = np.empty(samples)
    rows = max(1, _CHUNK // max(n, 1))
    for start in range(0, samples, rows):
        idx = rng.integers(0, n, (min(rows, samples - start), n))  # [rows, n]
        out[start:start + len(idx)] = num[idx].sum(axis=1) / den[idx].sum(axis=1)
    return out


def paired_interval(figure: str, num: np.ndarray, den: np.ndarray, worse_if: str, alpha: float, samples: int,
                    seed: int) -> Interval | None:
    """Percentile bootstrap interval at 1 - alpha of sum(num) / sum(den), records resampled in pairs
    (num [n] the per-record delta sums, den [n] their weights). None below two records."""
    if len(num) < 2:
        return None
    reps = bootstrap_replicates(num, den, samples, seed)
    low, lower, upper, high = np.quantile(reps, [alpha / 2, alpha, 1 - alpha, 1 - alpha / 2])
    se = float(reps.std(ddof=1))
    z = NormalDist().inv_cdf(1 - alpha / 2) + NormalDist().inv_cdf(POWER)
    return Interval(figure, len(num), float(num.sum() / den.sum()), float(low), float(high), se, z * se, worse_if,
                    float(lower), float(upper))


def margin_verdict(estimate: float, op: str, limit: float, lower: float | None, upper: float | None,
                   strict: bool) -> tuple[bool, float]:
    """Judge a figure by its one-sided bounds; returns (passed, bound used). `op` "<=": larger is worse.

    Margin mode fails only when the optimistic bound is past the limit; strict mode passes only when the pessimistic
    bound is within it (docs/compare.md, "Margins"). Without bounds the estimate itself is judged."""
    larger_is_worse = op == "<="
    optimistic, pessimistic = (lower, upper) if larger_is_worse else (upper, lower)
    bound = pessimistic if strict else optimistic
    if bound is None or not math.isfinite(bound):
        bound = estimate
    return (bound <= limit if larger_is_worse else bound >= limit), bound


def judge(estimate: float, op: str, limit: float, bounds: tuple[float, float] | None, decision: str | None,
          alpha: float) -> tuple[bool, str | None]:
    """Whether `estimate op limit` holds, judged by the (lower, upper) one-sided bounds at 1 - alpha
    (`margin_verdict`), and the bound judged, e.g. "lower 95% bound 1.0012"; without bounds or with `decision`
    "point", the estimate itself (label None)."""
    if bounds is None or decision == "point":
        return margin_verdict(estimate, op, limit, None, None, False)[0], None
    strict = decision == "strict"
    passed, bound = margin_verdict(estimate, op, limit, *bounds, strict)
    # the optimistic bound in margin mode, the pessimistic one in strict mode (lower is optimistic for "<=")
    side = ("upper" if strict else "lower") if op == "<=" else ("lower" if strict else "upper")
    return passed, f"{side} {100 * (1 - alpha):g}% bound {bound:.6g}"


def _sum_deltas(base: pa.Table, new: pa.Table) -> tuple[np.ndarray, np.ndarray] | None:
    """Per record, without per-token logprobs: (sum of nll_new - nll_base, token count) from sum_logprob and
    `token_counts`, as the overall figures are computed; None when the files lack them."""
    slp_b, slp_n, den = column(base, "sum_logprob"), column(new, "sum_logprob"), token_counts(base)
    if slp_b is None or slp_n is None or den is None:
        return None
    num = slp_b - slp_n
    ok = np.isfinite(num) & np.isfinite(den) & (den > 0)
    return num[ok], den[ok]


def paired_stats(base: pa.Table, new: pa.Table, pos: Positions | None, alpha: float = DEFAULT_ALPHA,
                 samples: int = DEFAULT_SAMPLES, seed: int = DEFAULT_SEED) -> PairedStats:
    """McNemar tests and bootstrap intervals of aligned tables (row i of each = the same record, all ok)."""
    s = PairedStats(alpha, 1 - alpha, samples, seed)
    figures = []  # (figure, per-record num [n], den [n], worse_if)
    if pos is not None and len(pos.record):
        every = np.ones(len(pos.record), bool)
        for figure, values, known, worse_if in (("ln PPL ratio", pos.base_lp - pos.new_lp, every, "positive"),
                                                ("mean KL", pos.kld, ~np.isnan(pos.kld), "positive"),
                                                ("top-1 agreement", pos.top1, pos.top1 >= 0, "negative")):
            den = np.bincount(pos.record[known], minlength=base.num_rows).astype(np.float64)  # positions with it
            num = np.bincount(pos.record[known], weights=values[known].astype(np.float64), minlength=base.num_rows)
            figures.append((figure, num[den > 0], den[den > 0], worse_if))
    elif (sums := _sum_deltas(base, new)) is not None:
        figures.append(("ln PPL ratio", *sums, "positive"))
    for kind, cb, cn in choice_correct(base, new):
        t = mcnemar(kind, cb, cn, alpha)
        s.mcnemar.append(t)
        if t.mde is None or t.mde > (t.lost + t.gained) / t.num_records:
            s.notes.append(f"{kind}: with {t.lost + t.gained} flip(s) between right and wrong in {t.num_records} "
                           f"records, no accuracy drop can be detected at alpha {alpha:g} with power {POWER:g} "
                           "(minimum detectable drop above the discordant rate): the sample is too small to decide")
        figures.append(("accuracy" if kind == "acc" else kind, cn.astype(np.float64) - cb, np.ones(len(cb)),
                        "negative"))
    intervals = (paired_interval(f, num, den, worse_if, alpha, samples, seed) for f, num, den, worse_if in figures)
    s.intervals = [iv for iv in intervals if iv is not None]  # None: fewer than two records
    return s
