"""Figure of a lag analysis (:mod:`probekit.analysis.lag_summary`), paper Fig. 9a,b. It
draws summary dicts, never computes."""

from __future__ import annotations

import math

import numpy as np

from probekit.analysis.lag_summary import EARLY_POSITIONS


def plot_lag_analysis(single: dict, complement: dict | None, title: str):
    """Paper Fig. 9a,b: (a) the lag curve on log axes with its power-law fit, (b) the same
    curve with +-2 standard errors on a linear scale (what a log axis cannot show: the
    sign and the noise), (c) the ``(t, k)`` map, (d) the per-position effect with
    ``t < 10`` shaded. The complementary curve is drawn beside the single-token one."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    curves = [(r, n, c) for r, n, c in ((single, "single token t", "C0"),
                                        (complement, "all but t (complement)", "C3"))
              if r is not None]
    lags = np.asarray(single["lags"])[1:]

    ax = axes[0, 0]
    for res, name, color in curves:
        curve = np.asarray(res["mean_curve"])[1:]
        pos = curve > 0
        ax.plot(lags[pos], curve[pos], "o", ms=3, color=color, label=f"{name}: mean > 0")
        if (~pos).any():
            ax.plot(lags[~pos], -curve[~pos], "x", ms=4, color=color, alpha=0.6,
                    label=f"{name}: -mean where mean <= 0 ({int((~pos).sum())} lags)")
        fit = res["fit"]
        if math.isfinite(fit["b"]):
            ax.plot(lags, fit["a"] * lags ** -fit["b"], "-", color=color, lw=1,
                    label=f"fit a k^-b on mean > 0: b={fit['b']:.2f}, R²={fit['r2']:.2f}")
    ax.set_yscale("log")
    _label(ax, "(a) mean benefit over lag, log axes")

    ax = axes[0, 1]
    ax.axhline(0, color="k", lw=0.6)
    for res, name, color in curves:
        curve, se = (np.asarray(res[k])[1:] for k in ("mean_curve", "stderr"))
        ax.fill_between(lags, curve - 2 * se, curve + 2 * se, color=color, alpha=0.2, lw=0)
        ax.plot(lags, curve, ".-", ms=3, color=color, label=f"{name} (±2 s.e.)")
    _label(ax, "(b) the same, linear scale, with its noise")

    ax = axes[1, 0]
    heat = np.asarray(single["heatmap"])[:, 1:].T  # [K, positions]
    lim = float(np.nanmax(np.abs(heat))) or 1.0
    # pcolormesh: sampled positions may be unevenly spaced (e.g. dense early positions).
    im = ax.pcolormesh(np.asarray(single["positions"]), lags, heat, shading="nearest",
                       cmap="RdBu", norm=TwoSlopeNorm(0.0, -lim, lim))
    fig.colorbar(im, ax=ax, label="mean Δ log p (blue = benefit)")
    ax.set_xlabel("recirculated position t")
    ax.set_ylabel("lag k")
    ax.set_title("(c) single-token benefit at (t, k)")

    ax = axes[1, 1]
    ax.axvspan(-0.5, EARLY_POSITIONS - 0.5, color="0.85", label=f"t < {EARLY_POSITIONS}")
    ax.axhline(0, color="k", lw=0.6)
    for res, name, color in curves:
        ax.plot(res["positions"], res["per_position"], ".-", ms=3, color=color, label=name)
    ax.set_xlabel("recirculated position t")
    ax.set_ylabel("mean Δ log p over lags 1..K")
    ax.set_title("(d) early-position effect")
    ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def _label(ax, title: str) -> None:
    """Axes of a curve over lags on a log lag axis (panels a, b)."""
    ax.set_xscale("log")
    ax.set_xlabel("lag k")
    ax.set_ylabel("mean Δ log p (nats)")
    ax.set_title(title)
    ax.legend(fontsize=7)
