"""Every recipe's Fig. 7a against the issue's per-seed targets, as one Markdown table:
which seeds meet them all (depth-0 probe and answers >= 99% under full recurrent
prefill, depth-0 probe near chance under standard prefill, both tasks, every length), and
the worst completion numbers. It reads the figures' JSONs (experiments/fig7a.py), so the
table is recomputed from the committed numbers, never copied by hand;
docs/latent-feedback.md ("Every recipe against the targets") is its output, and a test
checks that it still is.

    python experiments/fig7a_recipes.py                  # every committed Fig. 7a figure
    python experiments/fig7a_recipes.py figures/latent-feedback-fig7a-headline-recipe.json
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import tyro
from fig7a import seed_verdicts

from probekit.commands.common import script_error
from probekit.validation import flag

ROOT = Path(__file__).resolve().parents[1]
HEADER = ("| recipe (flags on the default recipe) | figure | CPU kernels | seeds | "
          "meet every target | completion, depth 0 under full (worst) | "
          "completion answered under full (worst) | memory, both under full (worst) |\n"
          "|---|---|---|---|---|---|---|---|")


@dataclasses.dataclass(frozen=True)
class Args:
    figures: tyro.conf.Positional[tuple[Path, ...]] = ()
    """Fig. 7a JSONs (experiments/fig7a.py), one per recipe, rows in the order given;
    none: every figures/latent-feedback-fig7a*.json, Fig. 7a's own first"""
    link: str = "../figures"
    """the folder the figure links point into (relative to where the table lands)"""


def committed_figures(folder: Path = ROOT / "figures") -> tuple[Path, ...]:
    """Every Fig. 7a JSON in ``folder``: Fig. 7a's recipe first, the others by name (which
    is by their flags, so related recipes sit together)."""
    main = folder / "latent-feedback-fig7a.json"
    return (main, *sorted(set(folder.glob("latent-feedback-fig7a*.json")) - {main}))


def flags(changes: dict[str, Any] | None) -> str:
    """``{"train.ahead_loss": 4.0, "steps": 4500}`` -> ``--ahead-loss 4 --steps 4500``,
    the flags of experiments/organism_checkpoint.py that make the recipe."""
    if changes is None:  # figures made before fig7a.py recorded the recipe
        return "not recorded"
    if not changes:
        return "the default recipe"
    return " ".join(f"{flag(key.rsplit('.', 1)[-1])} {f'{v:g}' if isinstance(v, float) else v}"
                    for key, v in changes.items())


def row(path: Path, link: str) -> str:
    """One table row from a Fig. 7a JSON."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror}); give the .json files "
                         f"experiments/fig7a.py writes") from None
    try:
        data = json.loads(text)
        per_seed = seed_verdicts(data)
        kernels = sorted({o.get("machine", {}).get("cpu_capability", "not recorded")
                          for o in data["organisms"].values()})
        completion = [v["completion"] for v in per_seed.values()]
        memory = [v["memory"] for v in per_seed.values()]
        worst = (min(c["depth0_full_min"] for c in completion),
                 min(c["answers_full_min"] for c in completion),
                 min(min(m["depth0_full_min"], m["answers_full_min"]) for m in memory))
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is not a Fig. 7a JSON ({type(e).__name__}: {e}); give the "
                         f".json files experiments/fig7a.py writes") from None
    seeds = data["seeds"]
    passed = [s for s, v in per_seed.items() if v["meets_targets"]]
    which = f" ({', '.join(passed)})" if passed else ""
    return (f"| `{flags(data.get('recipe_changes'))}` | [figure]({link}/{path.stem}.png) | "
            f"{', '.join(kernels)} | {', '.join(map(str, seeds))} | "
            f"**{len(passed)} of {len(seeds)}**{which} | "
            + " | ".join(f"{x:.3f}" for x in worst) + " |")


def table(paths: tuple[Path, ...], link: str = "../figures") -> str:
    return "\n".join([HEADER, *(row(p, link) for p in paths)])


def main() -> int:
    args = tyro.cli(Args)
    try:
        print(table(args.figures or committed_figures(), args.link))
    except ValueError as err:
        return script_error("fig7a_recipes", str(err))
    return 0


if __name__ == "__main__":
    sys.exit(main())
