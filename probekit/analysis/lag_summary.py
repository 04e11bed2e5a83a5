"""Summaries of a lag analysis (:mod:`probekit.analysis.lag`): the mean curve over lags,
its power-law fit, the ``(t, k)`` map, the early-position effect, and how the single-token
and all-but-one benefits compare (``papers/recirculation.md`` Sec. 4.4.4, Fig. 9a,b).

**Power law.** The mean benefit over windows and ``t`` per lag ``k >= 1`` is fitted as
``a * k^-b`` by least squares on ``log(mean) = log(a) - b log(k)``. Only lags with a
strictly positive mean enter the fit (a log needs it); the number left out is reported
with the fit, and ``R^2`` is computed in log space over the fitted lags.

**Means over t.** A position grid may be sparse and uneven (``--positions 0:20
20:190:5``); each sampled ``t`` is weighted by the positions it stands for
(:func:`position_weights`), so the curve estimates the plain mean over every ``t`` in the
range, as the paper's is. The summary carries an approximate standard error per lag
(treating (window, t) samples as independent) and counts the lags more than two standard
errors from zero: on a small sample the curve is mostly noise, and the figure shows it.

**Early positions.** The paper found recirculating the first ~10 tokens harmful on
Gemma3 1B (but not on 4B/12B); the summary reports the mean benefit over lags for
``t < 10`` and ``t >= 10`` separately (None for a side with no sampled position), and
the figure shades ``t < 10``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

EARLY_POSITIONS = 10  # the paper's "roughly t < 10" (Sec. 4.4.4)


@dataclass(frozen=True)
class PowerLawFit:
    """``benefit ~ a * k^-b``, fitted in log-log space.

    Attributes:
        a, b: the fitted amplitude and decay exponent (NaN if fewer than 2 lags fit).
        r2: coefficient of determination of the log-log regression.
        n_fit: lags used (mean benefit > 0); n_excluded: lags left out (mean <= 0).
    """

    a: float
    b: float
    r2: float
    n_fit: int
    n_excluded: int

    def to_dict(self) -> dict:
        return asdict(self)


def fit_power_law(lags: np.ndarray, values: np.ndarray) -> PowerLawFit:
    """Least squares of ``log(values) = log(a) - b log(lags)`` over strictly positive values."""
    lags = np.asarray(lags, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    if lags.shape != values.shape or lags.ndim != 1:
        raise ValueError("lags and values must be 1-D arrays of the same length")
    if np.any(lags <= 0):
        raise ValueError("lags must be >= 1 (log k is undefined at k = 0)")
    keep = np.isfinite(values) & (values > 0)
    n_fit, n_excluded = int(keep.sum()), int((~keep).sum())
    if n_fit < 2:
        return PowerLawFit(math.nan, math.nan, math.nan, n_fit, n_excluded)
    x, y = np.log(lags[keep]), np.log(values[keep])
    slope, intercept = np.polyfit(x, y, 1)
    resid = y - (intercept + slope * x)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((resid**2).sum()) / ss_tot if ss_tot > 0 else 1.0
    return PowerLawFit(float(math.exp(intercept)), float(-slope), r2, n_fit, n_excluded)


def position_weights(positions: Sequence[int]) -> np.ndarray:
    """How many positions each sampled ``t`` stands for, so that a weighted mean over a
    sparse grid (e.g. ``0:20,20:190:5``) estimates the plain mean over every ``t`` of the
    range: half the distance between its neighbours (the adjacent gap at either end);
    equal weights on an evenly spaced grid."""
    p = np.asarray(positions, dtype=np.float64)
    if p.size == 1:
        return np.ones(1)
    if np.any(np.diff(p) <= 0):
        raise ValueError("positions must be strictly increasing")
    w = np.empty_like(p)
    w[1:-1] = (p[2:] - p[:-2]) / 2
    w[0], w[-1] = p[1] - p[0], p[-1] - p[-2]
    return w


def summarize(benefit: np.ndarray, positions: Sequence[int]) -> dict:
    """Mean curve over lags, the ``(t, k)`` map, its power-law fit and the early-position effect.

    The mean over ``t`` weights each sampled position by :func:`position_weights`, so a
    grid that samples early positions densely does not over-weight them (the paper's
    curve is a plain mean over every ``t``).

    Args:
        benefit: ``[windows, positions, K+1]``; ``positions`` strictly increasing.
    """
    benefit = np.asarray(benefit, dtype=np.float64)
    positions = np.asarray(positions)
    K = benefit.shape[2] - 1
    lags = np.arange(1, K + 1)
    weights = position_weights(positions)
    by_t = benefit.mean(axis=0)  # [positions, K+1]
    curve = weights @ by_t / weights.sum()  # [K+1]
    per_t = by_t[:, 1:].mean(axis=1)  # mean over lags 1..K, per t
    early = positions < EARLY_POSITIONS

    def wmean(sel):
        return float(weights[sel] @ per_t[sel] / weights[sel].sum()) if sel.any() else None

    # Approximate standard error of the weighted mean, treating the (window, t) samples
    # as independent (neighbouring t of one window are correlated: it is a lower bound).
    omega = weights / weights.sum()
    sd = benefit.reshape(-1, K + 1).std(axis=0, ddof=1) if benefit[..., 0].size > 1 else \
        np.full(K + 1, np.nan)
    se = sd * np.sqrt((omega**2).sum() / benefit.shape[0])
    fit = fit_power_law(lags, curve[1:])
    return {
        "lags": np.arange(K + 1),
        "positions": positions,
        "position_weights": weights,
        "mean_curve": curve,
        "stderr": se,
        # lags whose mean is more than two standard errors from zero, by sign
        "n_lags_above_2se": int((curve[1:] > 2 * se[1:]).sum()),
        "n_lags_below_2se": int((curve[1:] < -2 * se[1:]).sum()),
        "heatmap": by_t,
        "per_position": per_t,
        "fit": fit.to_dict(),
        "lag0_max_abs": float(np.abs(benefit[..., 0]).max()),
        "early": {
            "threshold": EARLY_POSITIONS,
            "mean_early": wmean(early),
            "mean_late": wmean(~early),
            "n_early": int(early.sum()),
            "n_late": int((~early).sum()),
        },
        "n_windows": int(benefit.shape[0]),
    }


def compare(single: np.ndarray, positions: Sequence[int], complement: np.ndarray,
            complement_positions: Sequence[int]) -> dict | None:
    """Single-token ``B`` against all-but-one ``C`` (``[windows, positions, K+1]`` each) on
    the positions both sampled: the correlation over (window, t, k >= 1) cells and both
    means. If benefits add up in log-likelihood, ``C ~ B``. None if no position is shared."""
    positions, complement_positions = list(positions), list(complement_positions)
    common = sorted(set(positions) & set(complement_positions))
    if not common:
        return None
    si = [positions.index(t) for t in common]
    ci = [complement_positions.index(t) for t in common]
    a = np.asarray(single)[:, si, 1:].ravel()
    b = np.asarray(complement)[:, ci, 1:].ravel()
    return {
        "positions": common,
        "correlation": float(np.corrcoef(a, b)[0, 1]),
        "mean_single": float(a.mean()),
        "mean_complement": float(b.mean()),
    }
