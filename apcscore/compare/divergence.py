"""`apcscore compare`: llama.cpp's KL and delta p blocks (`llama-perplexity --kl-divergence`) on the per-position
arrays: mean with its standard error (positions taken as independent), RMS, max, min and percentiles."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# the percentiles llama.cpp's `llama-perplexity --kl-divergence` prints, highest first
KLD_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0, 0.1)
DELTA_P_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 75.0, 50.0, 25.0, 10.0, 5.0, 1.0, 0.1)


def mean_se(x: np.ndarray) -> float | None:
    """Standard error of the mean of x (positions taken as independent); None below two values."""
    return float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else None


def _percentiles(x: np.ndarray, which: tuple[float, ...]) -> dict[str, float]:
    """{"99.9": value, ...}: numpy's linear interpolation (llama.cpp takes the nearest sorted value instead,
    which differs only between neighbouring positions)."""
    return {f"{p:g}": float(v) for p, v in zip(which, np.percentile(x, which))}


@dataclass
class KldSummary:
    """Distribution of the per-position KL(base || new) lower bound, nats."""

    num_positions: int
    mean: float
    max: float
    percentiles: dict[str, float]  # "99.9", "99", "95", "90", "50", "10", "5", "1", "0.1" -> value
    min: float | None = None
    mean_se: float | None = None  # standard error of the mean (positions taken as independent)


@dataclass
class DeltaPSummary:
    """Distribution of delta p = p_new(target) - p_base(target) per position (probabilities, not percent)."""

    num_positions: int
    mean: float
    mean_se: float | None
    rms: float
    rms_se: float | None  # by the delta method, as llama.cpp: SE(mean(dp^2)) / (2 rms)
    max: float
    min: float
    percentiles: dict[str, float]  # "99.9" ... "0.1" -> value


def kld_summary(kl: np.ndarray) -> KldSummary | None:
    """The KL block of the finite per-position values kl [m]; None when empty."""
    if not len(kl):
        return None
    return KldSummary(len(kl), float(kl.mean()), float(kl.max()), _percentiles(kl, KLD_PERCENTILES),
                      float(kl.min()), mean_se(kl))


def delta_p_summary(dp: np.ndarray) -> DeltaPSummary | None:
    """The delta p block of the per-position values dp [m]; None when empty."""
    if not len(dp):
        return None
    rms = float(np.sqrt((dp * dp).mean()))
    sq_se = mean_se(dp * dp)
    rms_se = sq_se / (2 * rms) if sq_se is not None and rms > 0 else (0.0 if sq_se is not None else None)
    return DeltaPSummary(len(dp), float(dp.mean()), mean_se(dp), rms, rms_se, float(dp.max()), float(dp.min()),
                         _percentiles(dp, DELTA_P_PERCENTILES))


def share_se(share: float, n: int) -> float | None:
    """Binomial standard error of a share over n positions (the "same top p" uncertainty)."""
    return math.sqrt(share * (1 - share) / (n - 1)) if n > 1 else None
