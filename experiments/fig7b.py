"""Collect experiments/latent_feedback_registers.sh's runs into Fig. 7b: probe accuracy
per sweep condition at depths 0, 1, 2 and 4 for every prefill regime (mean and min-max
over organism seeds), the paper's three claims checked, every number in one JSON.

    python experiments/fig7b.py runs/latent-feedback-fig7b --seeds 0 1 2

The organisms' training records and shape are those of the checkpoints the runs read.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import tyro

from probekit.analysis.across_runs import combine_runs, read_summary
from probekit.commands.common import script_error
from probekit.training.organism_cache import organism_record

#: What writes the run folders this script reads; its errors say to run it.
PRODUCER = "experiments/latent_feedback_registers.sh"
SWEEPS = {"register-sweep": "m", "overwrite-sweep": "writes"}
DEPTHS = (0, 1, 2, 4)


@dataclasses.dataclass(frozen=True)
class Args:
    run: tyro.conf.Positional[Path]
    seeds: tuple[int, ...] = (0, 1, 2)
    """the organisms' training seeds (the script's SEEDS)"""
    out: Path = Path("figures")


def main() -> int:
    args = tyro.cli(Args)
    try:
        runs, organisms, shape = collect(args)
    except ValueError as err:
        return script_error("fig7b", str(err))
    combined = {sweep: combine_runs(r)["mechanisms"]["latent-feedback"]
                for sweep, r in runs.items()}
    claims = _claims(combined)
    out = {"seeds": list(args.seeds), "shape": shape, "organisms": organisms,
           "claims": claims, "results": {sweep: c["datasets"] for sweep, c in combined.items()},
           "compute_seconds": {sweep: c["compute_seconds"] for sweep, c in combined.items()}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "latent-feedback-fig7b.json").write_text(json.dumps(out, indent=1))
    _plot(combined, len(args.seeds)).savefig(args.out / "latent-feedback-fig7b.png", dpi=120)
    for name, c in claims.items():
        print(f"{name}: {c['verdict']} ({c['evidence']})")
    print(f"wrote {args.out / 'latent-feedback-fig7b.png'} and .json")
    return 0


def collect(args: Args) -> tuple[dict, dict, dict]:
    """The runs' summaries per sweep, the training record of the organism each seed's runs
    read (from the checkpoint their summaries name) and the organisms' shape; a one-line
    ``ValueError`` for a run or organism the figure cannot use."""
    runs: dict[str, dict] = {sweep: {} for sweep in SWEEPS}
    organisms, recipes = {}, {}
    for s in args.seeds:
        read = set()
        for sweep in SWEEPS:
            path = args.run / f"seed{s}" / sweep / "summary.json"
            summary = read_summary(path, PRODUCER)
            ckpt = summary.get("mechanism", {}).get("checkpoint")
            if ckpt is None:
                raise ValueError(f"{path} names no latent-feedback checkpoint; give the run "
                                 f"folder of {PRODUCER}")
            try:
                _, rec = organism_record(ckpt)
            except ValueError as e:
                raise ValueError(f"{path}: {e}; rerun {PRODUCER}, which trains it again") \
                    from None
            read.add(str(Path(ckpt).resolve()))
            runs[sweep][f"latent-feedback-seed{s}"] = summary
        if len(read) > 1:
            raise ValueError(f"seed {s}'s two sweeps read different organisms "
                             f"({', '.join(sorted(read))}); rerun {PRODUCER}")
        train = dict(rec["recipe"]["train"])
        if train.pop("seed") != s:
            raise ValueError(f"seed {s}'s runs read an organism of seed "
                             f"{rec['recipe']['train']['seed']}; rerun {PRODUCER}")
        organisms[s] = {k: rec[k] for k in ("train_seconds", "task_accuracy", "steps")}
        recipe = {**rec["recipe"], "train": train}
        recipes[s] = json.dumps({"recipe": recipe, "steps": rec["steps"]}, sort_keys=True)
    if len(set(recipes.values())) > 1:
        raise ValueError(f"the seeds' organisms come from different recipes (seeds "
                         f"{', '.join(map(str, args.seeds))}); rerun {PRODUCER} with one "
                         f"TASKS, STEPS and SHAPE into one RUN folder")
    return runs, organisms, rec["recipe"]["shape"]


def _at(combined, sweep, regime, depth):
    """{condition value: mean probe accuracy at depth} for one sweep and regime."""
    name = SWEEPS[sweep]
    return {e["condition"][name]: e["regimes"][regime]["probe_mean"][depth]
            for e in combined[sweep]["datasets"].values()}


def _claims(combined) -> dict:
    """The paper's three readings of Fig. 7b, each with the numbers it rests on."""
    out = {}
    gains = {k: np.mean([_at(combined, s, f"last-{k}", d)[c] - _at(combined, s, "none", d)[c]
                         for s in SWEEPS for d in (0, 1, 2) for c in _at(combined, s, "none", d)])
             for k in (1, 2, 4)}
    out["last-k helps shallow layers"] = {
        "verdict": "reproduces" if min(gains.values()) > 0.02 else "does not reproduce",
        "evidence": "mean gain over none at depths 0-2: " + ", ".join(
            f"last-{k} {g:+.3f}" for k, g in gains.items())}
    ow = {w: np.mean([_at(combined, "overwrite-sweep", f"last-{k}", d)[w]
                      - _at(combined, "overwrite-sweep", "none", d)[w]
                      for k in (1, 2, 4) for d in (0, 1, 2)]) for w in (2, 4, 8)}
    out["last-k's gain shrinks with more overwrites"] = {
        "verdict": "reproduces" if ow[2] > ow[4] > ow[8] else "does not reproduce",
        "evidence": "mean last-k gain at depths 0-2 by writes per register: " + ", ".join(
            f"{w}: {g:+.3f}" for w, g in ow.items())}
    best = {r: np.mean([v for s in SWEEPS for d in (0, 1, 2)
                        for v in _at(combined, s, r, d).values()])
            for r in ("none", "last-1", "last-2", "last-4", "full")}
    out["full recurrence is best"] = {
        "verdict": "reproduces" if max(best, key=best.get) == "full" else "does not reproduce",
        "evidence": "mean probe accuracy at depths 0-2: " + ", ".join(
            f"{r} {v:.3f}" for r, v in best.items())}
    return out


def _plot(combined, n_seeds):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(DEPTHS), figsize=(3.6 * len(DEPTHS), 6.2), squeeze=False)
    for row, sweep in zip(axes, SWEEPS, strict=True):
        name = SWEEPS[sweep]
        entries = sorted(combined[sweep]["datasets"].values(), key=lambda e: e["condition"][name])
        x = np.arange(len(entries))
        for ax, depth in zip(row, DEPTHS, strict=True):
            for regime in entries[0]["regimes"]:
                rs = [e["regimes"][regime] for e in entries]
                (line,) = ax.plot(x, [r["probe_mean"][depth] for r in rs], marker="o",
                                  label=regime)
                ax.fill_between(x, [r["probe_min"][depth] for r in rs],
                                [r["probe_max"][depth] for r in rs], alpha=0.15,
                                color=line.get_color())
            ax.axhline(entries[0]["regimes"]["none"]["chance"], color="grey", ls="--", lw=1)
            ax.set_xticks(x, [str(e["condition"][name]) for e in entries])
            ax.set(title=f"{sweep}, depth {depth}", xlabel=name, ylim=(0.3, 1.02),
                   ylabel="probe accuracy")
        row[0].legend(fontsize=7)
    fig.suptitle(f"latent feedback on register organisms ({n_seeds} seeds: mean, min-max)",
                 fontsize=9)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    sys.exit(main())
