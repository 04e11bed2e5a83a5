"""The state-tracking figure (latent-feedback paper Fig. 7; ``probekit run state-tracking``'s
``state-tracking-<task>.png``)."""

from __future__ import annotations

from typing import Any

import numpy as np


def plot_state_tracking(results: dict[str, Any], task: str):
    """Figure for one task of :func:`probekit.analysis.state_tracking.summarize`'s results:
    a row per dataset (sweep condition); probe accuracy per depth (+-1 std over folds,
    dashed chance line), then, if patching ran, the flip rate and the mean logit shift
    toward the partner's label per patched depth (+-1 standard error)."""
    import matplotlib.pyplot as plt

    entries = [e for e in results["datasets"].values() if e["task"] == task]
    causal = any(r["causal"] for e in entries for r in e["regimes"].values())
    ncols = 3 if causal else 1
    fig, axes = plt.subplots(len(entries), ncols, figsize=(4.6 * ncols, 3.2 * len(entries)),
                             squeeze=False)
    for row, e in zip(axes, entries, strict=True):
        for regime, r in e["regimes"].items():
            p = r["probe"]
            depths = np.arange(len(p["accuracy_mean"]))
            color = _band(row[0], depths, p["accuracy_mean"], p["accuracy_std"], regime)
            if causal and r["causal"]:
                c = r["causal"]
                label = f"{regime} (model acc {r['model_accuracy']:.0%})"
                _band(row[1], depths, c["flip_rate"], c["flip_se"], label, color)
                _band(row[2], depths, c["shift"], c["shift_se"], regime, color)
        chance = next(iter(e["regimes"].values()))["probe"]["chance"]
        row[0].axhline(chance, color="grey", ls="--", lw=1, label="chance")
        row[0].set(title=f"{e['title']}: linear probe ({e['n_examples']} ex., "
                         f"{e['n_groups']} groups)", xlabel="residual depth (0 = input)",
                   ylabel="accuracy", ylim=(0.3, 1.02))
        if causal:
            row[1].set(title="patch the partner's residual", ylim=(-0.02, 1.02),
                       xlabel="residual depth patched", ylabel="flip rate to partner's label")
            row[2].axhline(0, color="grey", lw=0.8)
            row[2].set(title="logit shift toward partner's label",
                       xlabel="residual depth patched", ylabel="mean change (logits)")
        for ax in row:
            ax.legend(fontsize=8)
    mech = results["mechanism"]
    params = ", ".join(f"{k}={v}" for k, v in mech.items() if k != "mechanism")
    fig.suptitle(f"{mech['mechanism']} ({params})", fontsize=9)
    fig.tight_layout()
    return fig


def _band(ax, x, mean, spread, label, color=None) -> str:
    """A line with a +-spread band; returns its colour."""
    mean, spread = np.asarray(mean, float), np.asarray(spread, float)
    (line,) = ax.plot(x, mean, marker=".", label=label, color=color)
    ax.fill_between(x, mean - spread, mean + spread, alpha=0.2, color=line.get_color())
    return line.get_color()
