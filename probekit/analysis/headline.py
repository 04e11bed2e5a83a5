"""What the headline figure shows, in words: a table and one sentence per panel.

``probekit run state-tracking`` prints them under its combined figure
(:func:`probekit.analysis.across_runs.combine_runs`' results): the probe accuracy at
depths 0, 1, 2, 4 and the best depth per mechanism, dataset and regime, then, for each
mechanism and task, the depth-0 probe under standard and recurrent prefill and what
changed. The thresholds of the verdicts (0.9 for "carries the state", 0.05 for "no
change") are stated in the sentences themselves.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def mechanism_title(name: str, m: dict[str, Any]) -> str:
    """A panel's title: the mechanism, its model and its main parameters."""
    model = m["model"]["name"]
    if name == "latent-feedback":
        what = "organism" if "organism" in model else model
        runs = f", mean of {m['n_runs']} seeds" if m["n_runs"] > 1 else ""
        return f"latent feedback ({what}, {m['model']['n_blocks']} blocks{runs})"
    params = {k: v for k, v in m["mechanism"].items() if k in ("source", "destination", "alpha")}
    return f"{name} ({model}, " + ", ".join(f"{k}={v}" for k, v in params.items()) + ")"


def headline_sentences(results: dict[str, Any]) -> list[str]:
    """The combined table, then one sentence per mechanism saying what its panel shows."""

    lines = [headline_table(results), ""]
    for name, m in results["mechanisms"].items():
        tasks = dict.fromkeys(e["task"] for e in m["datasets"].values())
        for task in tasks:
            entries = [e for e in m["datasets"].values() if e["task"] == task]
            sentence = panel_sentence(entries)
            if sentence:
                lines.append(f"{mechanism_title(name, m)}, {task}: {sentence}.")
    return lines


def panel_sentence(entries: list[dict[str, Any]]) -> str | None:
    """What one mechanism's panel shows for one task (its datasets ``entries``): the
    depth-0 probe under standard and recurrent prefill, then the verdict (the state
    carried into the input; no change of 0.05 or more at any depth; or the largest
    change and where)."""
    regimes = list(entries[0]["regimes"])
    other = "full" if "full" in regimes else regimes[-1]
    if other == "none":
        return None
    base = [e["regimes"]["none"] for e in entries]
    rec = [e["regimes"][other] for e in entries]
    b0 = [r["probe_mean"][0] for r in base]
    r0 = [r["probe_mean"][0] for r in rec]
    diff = np.array([np.subtract(r["probe_mean"], b["probe_mean"])
                     for r, b in zip(rec, base, strict=True)])
    chance = base[0]["chance"]

    def span(v: list[float]) -> str:
        return f"{min(v):.2f}" if max(v) - min(v) < 0.005 else f"{min(v):.2f}-{max(v):.2f}"

    where = (f"the depth-0 probe reads the state with {span(b0)} accuracy under standard "
             f"prefill (chance {chance:.2f}) and {span(r0)} under {other} prefill")
    if min(r0) >= 0.9 and max(b0) <= chance + 0.1:
        return f"{where}: the fed-back state carries the task state into the input"
    if np.abs(diff).max() < 0.05:
        return f"{where}; {other} prefill changes no depth's accessibility by 0.05 or more"
    i, r = np.unravel_index(np.abs(diff).argmax(), diff.shape)
    return (f"{where}; the largest change is {diff[i, r]:+.2f} at depth {r}"
            + (f" ({entries[i]['title']})" if len(entries) > 1 else ""))


def headline_table(results: dict[str, Any]) -> str:
    """One row per mechanism, dataset and regime: probe accuracy at depths 0, 1, 2, 4 and
    the best depth (mean over runs, with the range over runs when there are several),
    and the model's task accuracy."""
    rows = [(name, e["title"], regime, r) for name, m in results["mechanisms"].items()
            for e in m["datasets"].values() for regime, r in e["regimes"].items()]
    w = [max([len(h)] + [len(x[i]) for x in rows])
         for i, h in enumerate(("mechanism", "dataset", "regime"))]
    head = (f"{'mechanism':<{w[0]}} {'dataset':<{w[1]}} {'regime':<{w[2]}} {'task':>5} "
            f"{'probe@0':>13} {'@1':>5} {'@2':>5} {'@4':>5} {'best (depth)':>12}")
    lines = [head, "-" * len(head)]
    for name, title, regime, r in rows:
        acc = np.array(r["probe_mean"])
        best = int(np.argmax(acc))
        lo, hi = r["probe_min"][0], r["probe_max"][0]
        p0 = f"{acc[0]:.2f}" + (f" [{lo:.2f},{hi:.2f}]" if len(r["probe_per_run"]) > 1 else "")
        at = [f"{acc[i]:5.2f}" if i < acc.size else "    -" for i in (1, 2, 4)]
        lines.append(f"{name:<{w[0]}} {title:<{w[1]}} {regime:<{w[2]}} "
                     f"{r['model_accuracy_mean']:>5.2f} {p0:>13} {at[0]} {at[1]} {at[2]} "
                     f"{acc[best]:>5.2f} ({best:>2})")
    return "\n".join(lines)
