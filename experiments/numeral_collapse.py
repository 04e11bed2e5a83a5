"""How far apart trained organisms keep the completion task's numerals: the cosine
similarity between the input embeddings of the numerals 10..99, with each organism's
sealed task accuracy (docs/latent-feedback.md, "The completion plateau").

    python experiments/numeral_collapse.py \\
        $(python experiments/organism_checkpoint.py --seed 2) \\
        $(python experiments/organism_checkpoint.py --seed 2 --copy-rows 0.25)

Each argument is an organism checkpoint folder (what ``organism_checkpoint.py`` prints);
``--init S`` adds a freshly initialised organism of seed ``S`` as the baseline.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

import numpy as np
import tyro

from probekit.commands.common import organisms_problem, script_error
from probekit.core import model_cache

usage_error = functools.partial(script_error, "numeral_collapse")


@dataclasses.dataclass(frozen=True)
class Args:
    checkpoints: tyro.conf.Positional[tuple[Path, ...]] = ()
    """organism checkpoint folders"""
    init: tuple[int, ...] = ()
    """seeds of freshly initialised organisms to show beside them"""


def _accuracy(checkpoint: Path) -> str:
    """The task accuracy sealed beside a cached organism's checkpoint ("-" outside the
    cache)."""
    record = model_cache.record(checkpoint.parent)
    if record is None:
        return "-"
    acc = record["task_accuracy"]
    return "; ".join(f"{task} " + " / ".join(f"{v:.2f}" for v in by.values())
                     for task, by in acc.items())


def main() -> int:
    args = tyro.cli(Args)
    if args.checkpoints and (problem := organisms_problem(args.checkpoints)):
        return usage_error(problem)  # --init alone needs no checkpoint
    from probekit.training.checkpoint import load_checkpoint
    from probekit.training.numerals import numeral_cosines
    from probekit.training.organism import new_organism

    models = [(f"initialised, seed {s}", new_organism(seed=s), "-") for s in args.init]
    models += [(str(ck), load_checkpoint(ck).model, _accuracy(ck)) for ck in args.checkpoints]
    print("| organism | numeral cosine: mean | sd | max | task accuracy (none / last-1 / "
          "full) |\n|---|---|---|---|---|")
    for name, model, accuracy in models:
        cos = numeral_cosines(model)
        off = cos[~np.eye(len(cos), dtype=bool)]
        print(f"| {name} | {off.mean():.2f} | {off.std():.2f} | {off.max():.2f} | "
              f"{accuracy} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
