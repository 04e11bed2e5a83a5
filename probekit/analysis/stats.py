"""Statistics shared by every analysis: perplexity change and its bootstrap interval.

Windows (not tokens) are the independent units of every corpus analysis, so intervals
resample windows with replacement: ``scipy.stats.bootstrap`` draws the resamples (its
percentile method), and the interval is read off its bootstrap distribution with
``nanquantile``, so a resample in which a statistic has no token (a part-of-speech tag
absent from every drawn window) is left out of that statistic and counted.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
from scipy import stats


def pct_change_from_sums(base_sum, rec_sum, count):
    """``100 * (exp(mean NLL_rec - mean NLL_base) - 1)`` from sums of log-probs and the
    token count (arrays broadcast; NaN where ``count == 0``). Negative: recirculation helps."""
    base_sum, rec_sum, count = map(np.asarray, (base_sum, rec_sum, count))
    with np.errstate(invalid="ignore", divide="ignore"):
        return 100.0 * np.expm1((base_sum - rec_sum) / count)


def window_bootstrap(base_sum, rec_sum, count, *, n_boot: int = 1000, level: float = 0.95,
                     seed: int = 0, paired: Sequence[tuple[int, int]] = ()
                     ) -> dict[str, np.ndarray]:
    """Pooled % perplexity change and its percentile interval over windows.

    Args:
        base_sum, rec_sum, count: ``[W, G]`` (or ``[W]``) per-window sums of baseline and
            recirculated log-probs and token counts of ``G`` statistics; all ``G`` share
            the same resamples.
        paired: ``(i, j)`` pairs of statistics whose difference ``change[i] - change[j]``
            (percentage points, on the same resamples: a paired difference) is appended
            after the ``G`` statistics.

    Returns:
        ``{"change", "ci_low", "ci_high", "dropped"}``, each ``[G + len(paired)]`` (or
        scalar arrays for ``[W]`` inputs); fewer than two windows give a NaN interval.
    """
    if not isinstance(n_boot, int) or isinstance(n_boot, bool) or n_boot < 1:
        raise ValueError(f"--bootstrap must be an integer >= 1; got {n_boot!r}")
    if not 0 < level < 1:
        raise ValueError(f"the confidence level must lie in (0, 1); got {level}")
    base_sum, rec_sum, count = (np.asarray(a, float) for a in (base_sum, rec_sum, count))
    scalar = base_sum.ndim == 1
    if scalar:
        base_sum, rec_sum, count = base_sum[:, None], rec_sum[:, None], count[:, None]

    def with_pairs(pct):  # [..., G] -> [..., G + len(paired)]
        return np.concatenate([pct, *(pct[..., i, None] - pct[..., j, None] for i, j in paired)],
                              axis=-1)

    change = with_pairs(pct_change_from_sums(base_sum.sum(0), rec_sum.sum(0), count.sum(0)))
    n_windows, n_stats = base_sum.shape[0], change.shape[-1]
    nan = np.full(n_stats, np.nan)
    lo, hi, dropped = nan, nan.copy(), np.zeros(n_stats, int)
    if n_windows >= 2:
        def statistic(idx, axis=-1):  # idx: [..., W] resampled window indices
            idx = idx.astype(int)
            return np.moveaxis(with_pairs(pct_change_from_sums(
                base_sum[idx].sum(-2), rec_sum[idx].sum(-2), count[idx].sum(-2))), -1, 0)

        with warnings.catch_warnings():
            # scipy warns about NaN / degenerate resamples; they are handled below.
            warnings.simplefilter("ignore")
            res = stats.bootstrap((np.arange(n_windows),), statistic, vectorized=True,
                                  n_resamples=n_boot, method="percentile",
                                  confidence_level=level, rng=np.random.default_rng(seed))
            samples = np.asarray(res.bootstrap_distribution).reshape(n_stats, -1)
            lo, hi = np.nanquantile(samples, [(1 - level) / 2, (1 + level) / 2], axis=1)
        dropped = np.isnan(samples).sum(1)
    out = {"change": change, "ci_low": lo, "ci_high": hi, "dropped": dropped}
    return {k: v[0] for k, v in out.items()} if scalar else out
