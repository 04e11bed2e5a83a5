"""Figures of part-of-speech attribution (:mod:`probekit.analysis.pos_attribution`): the
per-tag change (paper Fig. 9c) and selective recirculation (Fig. C.3). They draw the
summary's rows, never compute."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from probekit.analysis.pos_attribution import NUMBER_TAGS


def plot_tag_changes(rows: Sequence[dict], title: str, *, min_tokens: int = 20):
    """Bar plot of Part 1: tags sorted by % change, bootstrap intervals as error bars.
    Tags with fewer than ``min_tokens`` predicted tokens are named under the plot but not
    drawn (a handful of tokens gives a huge, meaningless bar)."""
    import matplotlib.pyplot as plt

    everything = next((r for r in rows if r["tag"] == "all"), None)
    rare = [r for r in rows if 0 < r["n_tokens"] < min_tokens and r["tag"] != "all"]
    rows = sorted((r for r in rows if r["n_tokens"] >= min_tokens and r["tag"] != "all"),
                  key=lambda r: r["change"])
    fig, ax = plt.subplots(figsize=(max(5.0, 0.6 * len(rows) + 1.5), 3.8))
    x = np.arange(len(rows))
    change = np.array([r["change"] for r in rows])
    ax.bar(x, change, color=["tab:blue" if c < 0 else "tab:red" for c in change],
           hatch=["//" if r["tag"] in NUMBER_TAGS else "" for r in rows], edgecolor="white")
    _error_bars(ax, x, rows, "change", "ci_low", "ci_high")
    ax.axhline(0, color="black", lw=0.8)
    if everything and everything["change"] is not None:
        ax.axhline(everything["change"], color="gray", ls="--", lw=1,
                   label=f"all tokens ({everything['change']:+.2f}%)")
        ax.legend(fontsize=8)
    ax.set_xticks(x, [f"{r['tag']}\n{r['n_tokens']}" for r in rows], fontsize=8)
    ax.set_ylabel("% change in perplexity\n(negative = recirculation helps)")
    label = "tag of the predicted token (count of tokens)"
    if rare:
        label += (f"\nnot shown (< {min_tokens} tokens): "
                  + ", ".join(f"{r['tag']} ({r['n_tokens']})" for r in rare))
    ax.set_xlabel(label)
    ax.set_title(title, fontsize=9)
    return fig


def plot_selective(rows: Sequence[dict], title: str):
    """Bar plot of Part 2, as paper Fig. C.3: blue = the tag's positions recirculated,
    grey = a count-matched random set; bootstrap intervals as error bars."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(rows) + 1.5), 3.8))
    x = np.arange(len(rows))
    w = 0.38
    for off, key, color, label in ((-w / 2, "tag", "tab:blue", "positions of the tag"),
                                   (w / 2, "random", "tab:gray", "count-matched random")):
        ax.bar(x + off, [r[f"{key}_change"] for r in rows], w, color=color, label=label)
        _error_bars(ax, x + off, rows, f"{key}_change", f"{key}_ci_low", f"{key}_ci_high")
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(x, [f"{r['tag']}\n{r['n_recirculated']}" for r in rows], fontsize=8)
    ax.set_ylabel("% change in perplexity (all tokens)\n(negative = helps)")
    ax.set_xlabel("recirculated tag (count of recirculated positions)")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    return fig


def _error_bars(ax, x, rows, mid, lo, hi) -> None:
    y = np.array([r[mid] for r in rows], float)
    low = np.array([np.nan if r[lo] is None else r[lo] for r in rows], float)
    high = np.array([np.nan if r[hi] is None else r[hi] for r in rows], float)
    ok = ~(np.isnan(low) | np.isnan(high))
    if ok.any():
        ax.errorbar(np.asarray(x)[ok], y[ok], yerr=[y[ok] - low[ok], high[ok] - y[ok]],
                    fmt="none", ecolor="black", capsize=3, lw=1)
