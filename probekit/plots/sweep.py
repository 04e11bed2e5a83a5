"""Figures of the layer sweep (:mod:`probekit.analysis.sweep`): heatmaps of the %
perplexity change over source x destination, as in the recirculation paper's Fig. 5,
B.1 and (beside looping) Fig. 8. They draw a summary dict, never compute."""

from __future__ import annotations

import numpy as np

from probekit.analysis.sweep import SCHEMES


def _pyplot():
    import matplotlib.pyplot as plt

    return plt


def _heatmap(ax, fig, matrix, sources, dests, title, annotate=True):
    from matplotlib.colors import TwoSlopeNorm

    m = np.array([[np.nan if v is None else v for v in row] for row in matrix], dtype=float)
    lim = float(np.nanmax(np.abs(m))) if np.isfinite(m).any() else 1.0
    lim = lim or 1.0
    # Blue = lower perplexity (helps), red = higher, centred at 0 (paper Fig. 5).
    im = ax.imshow(m, origin="lower", cmap="RdBu_r", norm=TwoSlopeNorm(0.0, -lim, lim),
                   aspect="auto")
    ax.set_xticks(range(len(dests)), dests, fontsize=7)
    ax.set_yticks(range(len(sources)), sources, fontsize=7)
    ax.set_xlabel("destination block d")
    ax.set_ylabel("source block s")
    ax.set_title(title, fontsize=9)
    if annotate and m.size <= 400:
        for i in range(m.shape[0]):
            for j in range(m.shape[1]):
                if np.isfinite(m[i, j]):
                    dark = abs(m[i, j]) > 0.6 * lim  # white text on saturated cells
                    ax.text(j, i, f"{m[i, j]:.1f}", ha="center", va="center", fontsize=5,
                            color="white" if dark else "black")
    fig.colorbar(im, ax=ax, label="% perplexity change")


def plot_sweep(summary: dict, title: str):
    """Heatmaps: one per (alpha, scheme), schemes as rows and alphas as columns."""
    plt = _pyplot()
    alphas = sorted({p["alpha"] for p in summary["panels"]})
    schemes = [s for s in SCHEMES if any(p["scheme"] == s for p in summary["panels"])]
    fig, axes = plt.subplots(len(schemes), len(alphas), squeeze=False,
                             figsize=(4.6 * len(alphas), 3.8 * len(schemes)))
    for p in summary["panels"]:
        ax = axes[schemes.index(p["scheme"])][alphas.index(p["alpha"])]
        b = p["best"]
        _heatmap(ax, fig, p["matrix"], summary["sources"], summary["destinations"],
                 f"{p['scheme']}, alpha={p['alpha']:g}: best {b['source']}->{b['destination']} "
                 f"{b['percent_change']:+.2f}%")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_looping(summary: dict, title: str):
    """Paper Fig. 8: the recirculation panel holding the best cell beside looping."""
    plt = _pyplot()
    best = summary["best"]
    panel = next(p for p in summary["panels"]
                 if p["alpha"] == best["alpha"] and p["scheme"] == best["scheme"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    b = panel["best"]
    _heatmap(axes[0], fig, panel["matrix"], summary["sources"], summary["destinations"],
             f"recirculation ({panel['scheme']}, alpha={panel['alpha']:g}): best "
             f"{b['source']}->{b['destination']} {b['percent_change']:+.2f}%")
    lb = summary["looping"]["best"]
    _heatmap(axes[1], fig, summary["looping"]["matrix"], summary["sources"],
             summary["destinations"],
             f"looping (copy of l1+1..l2 after l2): best l1={lb['l1']}, l2={lb['l2']} "
             f"{lb['percent_change']:+.2f}%")
    axes[1].set_xlabel("l1 (destination role)")
    axes[1].set_ylabel("l2 (source role)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
