"""Collect experiments/latent_feedback_stability.sh's runs into Fig. 3 (stability over 30
fused passes per training variant) and the fed-back-state comparison, with each
organism's training record.

    python experiments/fig3.py runs/latent-feedback-fig3 --seed 0
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Literal

import tyro

from probekit.analysis.across_runs import read_summary
from probekit.commands.common import script_error
from probekit.plots.stability import plot_stability_contrast
from probekit.training.organism_cache import organism_record

#: What writes the run folders this script reads; its errors say to run it.
PRODUCER = "experiments/latent_feedback_stability.sh with the same SEED and VARIANTS"
#: Each variant's label; its training flags live in the script (the organism's record
#: is read from the checkpoint its runs name).
VARIANTS = {
    "default-75-22-3": "75/22/3% 1/2/3 passes (default), 2,000 steps",
    "paper-75-25": "75/25% 1/2 passes, 2,000 steps",
    "schedule-50-35-15": "50/35/15% 1/2/3 passes, 4,000 steps",
    "feed-residual": "default, un-normed residual fed back",
}
#: A name of VARIANTS (tyro refuses any other by listing these).
Variant = Literal[tuple(VARIANTS)]


@dataclasses.dataclass(frozen=True)
class Args:
    run: tyro.conf.Positional[Path]
    seed: int = 0
    variants: tuple[Variant, ...] = tuple(VARIANTS)
    """which variants ran (names of VARIANTS)"""
    out: Path = Path("figures")


def main() -> int:
    args = tyro.cli(Args)
    try:
        out, curves = collect(args)
    except ValueError as err:
        return script_error("fig3", str(err))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "latent-feedback-fig3.json").write_text(json.dumps(out, indent=1))
    fig = plot_stability_contrast(curves, f"probekit's organism (seed {args.seed}): 30 fused "
                                          f"Jacobi passes on the probe sets' rows")
    fig.savefig(args.out / "latent-feedback-fig3.png", dpi=120)
    for name, v in out["variants"].items():
        s = v["stability"]
        print(f"{name}: loss pass 1 {s['loss'][0]:.4f}, pass 30 {s['loss'][-1]:.4f}; relative "
              f"update pass 2 {s['relative_update'][1]:.2e}, pass 30 "
              f"{s['relative_update'][-1]:.2e}")
    print(f"wrote {args.out / 'latent-feedback-fig3.png'} and .json")
    return 0


def collect(args: Args) -> tuple[dict, dict]:
    """The figure's JSON and its curves by label, from the run folders and the cache; a
    one-line ``ValueError`` for a run or organism that is not there."""
    curves, out = {}, {"seed": args.seed, "variants": {}}
    for name in args.variants:
        label = VARIANTS[name]
        stab = read_summary(args.run / name / "stability" / "summary.json", PRODUCER,
                            keys=("loss", "relative_update", "checkpoint"))
        st = read_summary(args.run / name / "state-tracking" / "summary.json", PRODUCER,
                          keys=("datasets", "mechanism"))
        ckpt, other = stab["checkpoint"]["checkpoint"], st["mechanism"].get("checkpoint")
        if other is None or Path(other).resolve() != Path(ckpt).resolve():
            raise ValueError(f"{name}: its stability and state-tracking runs read different "
                             f"organisms ({ckpt}, {other}); rerun {PRODUCER}")
        try:
            _, rec = organism_record(ckpt)
        except ValueError as e:
            raise ValueError(f"{name}: {e}; rerun {PRODUCER}, which trains it again") from None
        seed = rec["recipe"]["train"]["seed"]
        if seed != args.seed:
            raise ValueError(f"{name}: its organism was trained with seed {seed}; give "
                             f"--seed {seed} (the script's SEED)")
        curves[label] = stab
        probes = {key: {r: {"probe_mean": v["probe"]["accuracy_mean"],
                            "model_accuracy": v["model_accuracy"], "causal": v["causal"]}
                        for r, v in e["regimes"].items()}
                  for key, e in st["datasets"].items()}
        out["variants"][name] = {
            "label": label, "stability": stab, "state_tracking": probes,
            "training": {k: rec[k] for k in ("train_seconds", "task_accuracy",
                                             "final_val_pass_losses", "steps")},
            "history_val": [h for h in _history(stab) if "val_pass_losses" in h],
        }
    return out, curves


def _history(stability: dict) -> list[dict]:
    """The training history of the checkpoint a stability run read."""
    path = Path(stability["checkpoint"]["checkpoint"]) / "history.json"
    return json.loads(path.read_text()) if path.is_file() else []


if __name__ == "__main__":
    sys.exit(main())
