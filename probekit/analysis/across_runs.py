"""State-tracking results of several runs side by side: mechanisms, and seeds within one.

``probekit run state-tracking`` runs each mechanism in its own run folder, and latent
feedback once per organism training seed. :func:`combine_runs` puts those summaries
(:func:`probekit.analysis.state_tracking.summarize`) together: per mechanism, dataset
and regime, the probe accuracy per depth as the mean over seeds with its spread
(sample std, min and max; with one seed the spread is the folds' std), the model's
task accuracy per seed, and the causal patching statistics per seed. A claim about the
organism should hold for every seed, so the min and max are kept, not only the mean.
:func:`read_summary` reads one run's summary for it, refusing in one line one it cannot use.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def read_summary(path: Path, producer: str,
                 keys: tuple[str, ...] = ("compute_seconds",)) -> dict[str, Any]:
    """A run's ``summary.json``, or a one-line ``ValueError`` naming the file and ``producer``.

    ``producer`` is the command that writes the summary ("experiments/x.sh with the same
    SEEDS"): the error tells the user to run it. ``keys`` are the fields the reader needs;
    a summary without them was written by an older probekit (the default: a state-tracking
    summary from before :func:`combine_runs` could add up a resumed run's compute), and
    rerunning the producer rewrites it and reuses every finished part.
    """
    try:
        summary = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read it ({e}); run {producer} first") from None
    if not isinstance(summary, dict) or any(k not in summary for k in keys):
        raise ValueError(f"{path}: written by an older probekit; rerun {producer} "
                         f"(its finished parts are reused)")
    return summary


def mechanism_of(label: str) -> str:
    """The mechanism a run label names: ``latent-feedback-seed2`` -> ``latent-feedback``."""
    head, sep, tail = label.rpartition("-seed")
    return head if sep and tail.isdigit() else label


def combine_runs(runs: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """``{"mechanisms": {name: combined}, "runs": runs}`` from ``{label: summary}``."""
    groups: dict[str, list[tuple[str, Mapping[str, Any]]]] = {}
    for label, res in runs.items():
        groups.setdefault(mechanism_of(label), []).append((label, res))
    return {"mechanisms": {name: _combine(members) for name, members in groups.items()},
            "runs": dict(runs)}


def _combine(members: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    first = members[0][1]
    out: dict[str, Any] = {
        "runs": [label for label, _ in members], "n_runs": len(members),
        "mechanism": first["mechanism"], "model": first["model"],
        "models": [res["model"] for _, res in members], "notes": first["notes"],
        "wall_seconds": float(sum(res["wall_seconds"] for _, res in members)),
        "compute_seconds": float(sum(res["compute_seconds"] for _, res in members)),
        "datasets": {},
    }
    for key, entry in first["datasets"].items():
        combined = {k: entry[k] for k in ("task", "title", "condition", "n_examples",
                                          "n_groups", "lengths")}
        combined["regimes"] = {}
        for regime in entry["regimes"]:
            per_run = [res["datasets"][key]["regimes"][regime] for _, res in members]
            combined["regimes"][regime] = _combine_regime(per_run)
        out["datasets"][key] = combined
    return out


def _combine_regime(per_run: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    acc = np.array([r["probe"]["accuracy_mean"] for r in per_run], float)  # [runs, depths]
    spread = (acc.std(0, ddof=1) if len(acc) > 1
              else np.asarray(per_run[0]["probe"]["accuracy_std"], float))
    model = np.array([r["model_accuracy"] for r in per_run], float)
    return {
        "probe_mean": acc.mean(0).tolist(), "probe_spread": spread.tolist(),
        "spread_is": "std over runs" if len(acc) > 1 else "std over folds",
        "probe_min": acc.min(0).tolist(), "probe_max": acc.max(0).tolist(),
        "probe_per_run": acc.tolist(), "chance": per_run[0]["probe"]["chance"],
        "model_accuracy_mean": float(model.mean()), "model_accuracy_min": float(model.min()),
        "model_accuracy_per_run": model.tolist(),
        "causal_per_run": [r["causal"] for r in per_run],
    }
