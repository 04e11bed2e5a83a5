"""Collect the runs of experiments/latent_feedback_organism.sh into Fig. 7a: probe
accuracy against length for every task and regime (mean and min-max over organism
seeds), with every number, the patching statistics and each organism's training record
in one JSON.

    python experiments/fig7a.py runs/latent-feedback-fig7a --counts 0 8 32 128 256 --seeds 0 1 3
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import tyro

from probekit.analysis.across_runs import combine_runs
from probekit.plots.state_tracking import plot_by_length
from probekit.training.organism_cache import Recipe, organism_folder, sealed

#: The paper's depth-0 probe accuracy under full recurrent prefill (Sec. 4.4, Fig. 7a).
PAPER = {"completion": 0.996, "memory": 1.0}


@dataclasses.dataclass(frozen=True)
class Args:
    run: tyro.conf.Positional[Path]
    """the script's run folder (seed<S>/<task>-d<count>/ per seed, task and length)"""
    counts: tuple[int, ...] = (0, 8, 32, 128, 256)
    seeds: tuple[int, ...] = (0, 1, 3)
    out: Path = Path("figures")


def main() -> int:
    args = tyro.cli(Args)
    table: dict = {}
    seconds: dict = {}
    for task in ("completion", "memory"):
        for d in args.counts:
            runs = {f"latent-feedback-seed{s}": json.loads(
                (args.run / f"seed{s}" / f"{task}-d{d}" / "summary.json").read_text())
                for s in args.seeds}
            m = combine_runs(runs)["mechanisms"]["latent-feedback"]
            (entry,) = m["datasets"].values()
            table.setdefault(task, {})[d] = entry["regimes"]
            seconds.setdefault(task, {})[d] = m["wall_seconds"]
    organisms = {}
    for seed in args.seeds:
        rec = sealed(Recipe.default(seed))
        organisms[seed] = {k: rec[k] for k in ("train_seconds", "task_accuracy", "steps",
                                               "final_val_pass_losses", "data")}
        organisms[seed]["folder"] = organism_folder(Recipe.default(seed)).name
    verdicts = {}
    for task, rows in table.items():
        full0 = [r["full"]["probe_min"][0] for r in rows.values()]
        none0 = [r["none"]["probe_max"][0] for r in rows.values()]
        verdicts[task] = {
            "paper_depth0_full": PAPER[task],
            "worst_seed_depth0_full": min(full0), "best_seed_depth0_none": max(none0),
            "reproduces": min(full0) >= 0.99 and max(none0) <= 0.6,
        }
    out = {"seeds": list(args.seeds), "counts": list(args.counts), "organisms": organisms,
           "verdicts": verdicts, "wall_seconds": seconds, "results": table}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "latent-feedback-fig7a.json").write_text(json.dumps(out, indent=1))
    fig = plot_by_length(table, title=f"latent feedback on probekit's organism "
                                      f"({len(args.seeds)} training seeds: mean, min-max)")
    fig.savefig(args.out / "latent-feedback-fig7a.png", dpi=120)
    for task, v in verdicts.items():
        print(f"{task}: depth-0 probe under full recurrence >= {v['worst_seed_depth0_full']:.3f} "
              f"at every length and seed (paper {v['paper_depth0_full']}); under standard "
              f"prefill <= {v['best_seed_depth0_none']:.3f}")
    print(f"wrote {args.out / 'latent-feedback-fig7a.png'} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
