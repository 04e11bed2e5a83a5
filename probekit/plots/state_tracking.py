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


def plot_headline(results: dict[str, Any], task: str):
    """The headline figure for one task of
    :func:`probekit.analysis.across_runs.combine_runs`'s results: a column per mechanism
    (latent feedback on the organism, recirculation on the model), a row per dataset of
    the task; probe accuracy per depth for each prefill regime, the mean over runs
    (organism seeds) with a +-spread band, and the chance line."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from probekit.analysis.headline import mechanism_title

    mechs = results["mechanisms"]
    rows = max(sum(e["task"] == task for e in m["datasets"].values()) for m in mechs.values())
    fig, axes = plt.subplots(rows, len(mechs), figsize=(4.8 * len(mechs), 3.1 * rows),
                             squeeze=False)
    for col, (name, m) in enumerate(mechs.items()):
        entries = [e for e in m["datasets"].values() if e["task"] == task]
        for ax, e in zip(axes[:, col], entries, strict=False):
            for regime, r in e["regimes"].items():
                depths = np.arange(len(r["probe_mean"]))
                name_ = _REGIME_NAMES.get(regime, regime)
                label = f"{name_} (task acc {r['model_accuracy_mean']:.0%})"
                _band(ax, depths, r["probe_mean"], r["probe_spread"], label)
            chance = next(iter(e["regimes"].values()))["chance"]
            ax.axhline(chance, color="grey", ls="--", lw=1, label="chance")
            ax.set(title=f"{mechanism_title(name, m)}\n{e['title']}", ylim=(0.3, 1.02),
                   xlabel="residual depth (0 = input)", ylabel="probe accuracy")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.legend(fontsize=7)
        for ax in axes[len(entries):, col]:
            ax.axis("off")
    fig.tight_layout()
    return fig


_REGIME_NAMES = {"none": "standard prefill", "full": "full recurrent prefill"}


def plot_by_length(table: dict[str, dict[int, dict[str, dict[str, Any]]]], *, depth: int = 0,
                   title: str = ""):
    """Probe accuracy at ``depth`` against the number of distractors (latent-feedback paper
    Fig. 7a, across lengths): ``table[task][distractors][regime]`` holds combined regime
    results (:func:`probekit.analysis.across_runs.combine_runs`); one panel per task, the
    mean over runs with a min-max band, then the per-depth curves at the longest length."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    tasks = list(table)
    fig, axes = plt.subplots(2, len(tasks), figsize=(5.0 * len(tasks), 6.4), squeeze=False)
    for col, task in enumerate(tasks):
        counts = sorted(table[task])
        x = np.arange(len(counts))
        top, bottom = axes[0, col], axes[1, col]
        for regime in table[task][counts[0]]:
            rows = [table[task][d][regime] for d in counts]
            mean = [r["probe_mean"][depth] for r in rows]
            (line,) = top.plot(x, mean, marker="o", label=_REGIME_NAMES.get(regime, regime))
            top.fill_between(x, [r["probe_min"][depth] for r in rows],
                             [r["probe_max"][depth] for r in rows], alpha=0.2,
                             color=line.get_color())
            last = table[task][counts[-1]][regime]
            depths = np.arange(len(last["probe_mean"]))
            bottom.plot(depths, last["probe_mean"], marker=".", color=line.get_color(),
                        label=_REGIME_NAMES.get(regime, regime))
            bottom.fill_between(depths, last["probe_min"], last["probe_max"], alpha=0.2,
                                color=line.get_color())
        chance = table[task][counts[0]]["none"]["chance"]
        for ax in (top, bottom):
            ax.axhline(chance, color="grey", ls="--", lw=1, label="chance")
            ax.set(ylim=(0.3, 1.02), ylabel="probe accuracy")
            ax.legend(fontsize=7)
        top.set_xticks(x, [str(d) for d in counts])
        top.set(title=f"{task}: depth-{depth} probe", xlabel="distractors (null updates)")
        bottom.set(title=f"{task}, {counts[-1]} distractors: every depth",
                   xlabel="residual depth (0 = input)")
        bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig
