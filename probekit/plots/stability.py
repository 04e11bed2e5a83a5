"""The stability figure of latent feedback (full-bandwidth paper Fig. 3;
``probekit feedback-stability``'s stability.png)."""

from __future__ import annotations

from typing import Any

import numpy as np


def plot_stability(curves: dict[str, Any], title: str = ""):
    """Loss of pass k, state update (absolute and relative) and (if measured) label
    accuracy against k; ``curves`` as :func:`probekit.analysis.stability.stability_curves`
    returns them."""
    return plot_stability_contrast({"": curves}, title)


def plot_stability_contrast(variants: dict[str, dict[str, Any]], title: str = ""):
    """Fig. 3 for one or several trained models side by side (e.g. two pass schedules):
    loss of pass k, the update ``||h(k) - h(k-1)||`` of the fed-back state, the same
    relative to ``||h(k)||`` and the label accuracy against k, one line per variant
    (``{label: stability_curves(...)}``; an empty label draws no legend)."""
    import matplotlib.pyplot as plt

    accuracy = any("answer_accuracy" in c for c in variants.values())
    ncols = 4 if accuracy else 3
    fig, axes = plt.subplots(1, ncols, figsize=(3.9 * ncols, 3.5))
    for label, curves in variants.items():
        k = np.array(curves["passes"])
        axes[0].plot(k, curves["loss"], marker=".", label=label or None)
        axes[1].plot(k[1:], curves["update"][1:], marker=".", label=label or None)
        axes[2].plot(k[1:], curves["relative_update"][1:], marker=".", label=label or None)
        if "answer_accuracy" in curves:
            axes[3].plot(k, curves["answer_accuracy"], marker=".", label=label or None)
    axes[0].set(xlabel="fused passes k", ylabel="loss of pass k", title="validation loss")
    axes[1].set(xlabel="fused passes k", ylabel="||h(k) - h(k-1)||", yscale="log",
                title="state update (positions >= n)")
    axes[2].set(xlabel="fused passes k", ylabel="||h(k) - h(k-1)|| / ||h(k)||",
                yscale="log", title="relative update")
    if accuracy:
        axes[3].set(xlabel="fused passes k", ylabel="accuracy", ylim=(0, 1.02),
                    title="label accuracy at the colon")
    if any(variants):
        for ax in axes:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig
