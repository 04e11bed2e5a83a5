"""The stability figure of latent feedback (full-bandwidth paper Fig. 3;
``probekit feedback-stability``'s stability.png)."""

from __future__ import annotations

from typing import Any

import numpy as np


def plot_stability(curves: dict[str, Any], title: str = ""):
    """Loss of pass k, relative state update and (if measured) label accuracy against k;
    ``curves`` as :func:`probekit.analysis.stability.stability_curves` returns them."""
    import matplotlib.pyplot as plt

    k = np.array(curves["passes"])
    ncols = 3 if "answer_accuracy" in curves else 2
    fig, axes = plt.subplots(1, ncols, figsize=(4.2 * ncols, 3.4))
    axes[0].plot(k, curves["loss"], marker=".")
    axes[0].set(xlabel="fused passes k", ylabel="loss of pass k", title="validation loss")
    axes[1].plot(k[1:], curves["relative_update"][1:], marker=".")
    axes[1].set(xlabel="fused passes k", ylabel="||h(k) - h(k-1)|| / ||h(k)||", yscale="log",
                title="state update (positions >= n)")
    if ncols == 3:
        axes[2].plot(k, curves["answer_accuracy"], marker=".")
        axes[2].set(xlabel="fused passes k", ylabel="accuracy", ylim=(0, 1.02),
                    title="label accuracy at the colon")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def plot_stability_contrast(variants: dict[str, dict[str, Any]], title: str = ""):
    """Fig. 3 for several trained models side by side (e.g. two pass schedules): loss of
    pass k, relative state update and label accuracy against k, one line per variant
    (``{label: stability_curves(...)}``)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for label, curves in variants.items():
        k = np.array(curves["passes"])
        axes[0].plot(k, curves["loss"], marker=".", label=label)
        axes[1].plot(k[1:], curves["relative_update"][1:], marker=".", label=label)
        if "answer_accuracy" in curves:
            axes[2].plot(k, curves["answer_accuracy"], marker=".", label=label)
    axes[0].set(xlabel="fused passes k", ylabel="loss of pass k", title="validation loss")
    axes[1].set(xlabel="fused passes k", ylabel="||h(k) - h(k-1)|| / ||h(k)||", yscale="log",
                title="state update (positions >= n)")
    axes[2].set(xlabel="fused passes k", ylabel="accuracy", ylim=(0, 1.02),
                title="label accuracy at the colon")
    for ax in axes:
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig
