"""Print the checkpoint folder of one of probekit's organisms, training it first if the
cache lacks it (probekit.training.organism_cache): the experiments' way to name an
organism trained with a non-default schedule, fed-back state or task mix.

    python experiments/organism_checkpoint.py --seed 0
    python experiments/organism_checkpoint.py --seed 0 --schedule 0.75 0.25 --steps 3000
    python experiments/organism_checkpoint.py --seed 2 --weight-decay 0.1
    python experiments/organism_checkpoint.py --seed 3 --fixed-point 0.1
    python experiments/organism_checkpoint.py --seed 1 --lr-floor 0 --steps 3000
    python experiments/organism_checkpoint.py --seed 2 --copy-rows 0.25
    python experiments/organism_checkpoint.py --seed 0 --copy-rows 0.25 --n-examples 48000
    python experiments/organism_checkpoint.py --seed 0 --copy-rows 0.25 --long-rows 4
    python experiments/organism_checkpoint.py --seed 4 --copy-rows 0.5 --copy-from 0
    python experiments/organism_checkpoint.py --seed 0 --copy-rows 0.25 --ahead-loss 1
    python experiments/organism_checkpoint.py --seed 1 --copy-rows 0.5 --short-first 1500
    python experiments/organism_checkpoint.py --seed 0 --copy-rows 0.25 --fixed-point 0.25 \
        --fixed-point-rows long
    python experiments/organism_checkpoint.py --seed 0 --copy-rows 0.25 --recall-rows 0.25
    python experiments/organism_checkpoint.py --seed 0 --copy-rows 0.25 --close-pairs 0.25 \
        --close-pairs-rows short --close-pairs-batch added
    python experiments/organism_checkpoint.py --seed 0 --feed residual
    python experiments/organism_checkpoint.py --seed 0 --copy-rows 0.25 --ema 0.999
    python experiments/organism_checkpoint.py --seed 0 --copy-rows 0.25 --lam 2
    python experiments/organism_checkpoint.py --seed 0 --tasks registers
    python experiments/organism_checkpoint.py --seed 0 --tasks registers --d-model 256 \
        --n-heads 8
    python experiments/organism_checkpoint.py --seed 0 --tasks registers --d-model 256 \
        --n-heads 8 --init-std 0.06 --match-hint 5 --match-hint-steps 1000 \
        --match-hint-parts circuit --steps 1000
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Annotated, Literal

import tyro

from probekit.commands.common import FLAT, script_error
from probekit.training.config import OrganismConfig
from probekit.training.organism_cache import Recipe, sealed, trained_organism


@dataclasses.dataclass(frozen=True)
class Args:
    seed: int = 0
    """training seed"""
    schedule: tuple[float, ...] | None = None
    """probabilities of 1, 2, 3, ... passes (default: the recipe's 0.75 0.22 0.03)"""
    steps: int | None = None
    """training steps (default: the recipe's 2000)"""
    lr: float | None = None
    """peak learning rate (default: the recipe's 0.002)"""
    lr_floor: float | None = None
    """last step's learning rate as a share of the peak (default: the recipe's 0.1)"""
    weight_decay: float | None = None
    """AdamW weight decay on matrices (default: the recipe's 0.01)"""
    feedback_start: int | None = None
    """first step with feedback passes (default: the recipe's 600)"""
    lam: float | None = None
    """weight of the fused passes' losses, lambda of Eq. 12 (default: the recipe's 1)"""
    fixed_point: float | None = None
    """share of feedback batches fed the exact full-recurrence state (default: the recipe's 0)"""
    ahead_loss: float | None = None
    """weight of the loss that predicts the token two ahead (default: the recipe's 0)"""
    short_first: int | None = None
    """first steps that train on short rows only (0-8 null updates; default: the recipe's 0)"""
    close_pairs: float | None = None
    """share of feedback batches of completion rows of the 400 training pairs the organism
    holds closest (default: the recipe's 0)"""
    close_pairs_rows: Literal["all", "short"] | None = None
    """null-update counts of the close-pair batches: all, or short (0-8) only (default:
    the recipe's all)"""
    close_pairs_batch: Literal["instead", "added"] | None = None
    """a close-pair batch replaces the step's batch (instead) or trains beside it (added;
    default: the recipe's instead)"""
    ema: float | None = None
    """decay of the moving average of the weights the organism is saved as (default: the
    recipe's 0, the last weights)"""
    fixed_point_rows: Literal["all", "long"] | None = None
    """rows of the fixed-point batches: all, or long (16-256 null updates) only (default:
    the recipe's all)"""
    match_hint: float | None = None
    """weight at step 0 of the match hint on register lookups (default: the recipe's 0)"""
    match_hint_steps: int | None = None
    """steps over which the match hint decays to zero (default: the recipe's 500)"""
    match_hint_parts: Literal["match", "circuit"] | None = None
    """the heads the match hint trains: the match alone, or the whole lookup circuit
    (default: the recipe's match)"""
    feed: Literal["normed", "residual"] = "normed"
    """which top state is fed back"""
    tasks: tuple[Literal["completion", "memory", "registers"], ...] | None = None
    """training tasks (default: completion memory)"""
    copy_rows: float = 0.0
    """numeral copy rows added, as a share of the task rows (default 0: none)"""
    copy_from: int = 10
    """smallest numeral of the copy rows, which run to 99 (0: the digits too)"""
    long_rows: float = 1.0
    """times the default share of rows with 64-256 null updates (default 1)"""
    recall_rows: float = 0.0
    """numeral recall rows added, as a share of the task rows (default 0: none)"""
    n_examples: int | None = None
    """task rows to train on, drawn afresh (default: the recipe's 24000)"""
    shape: Annotated[OrganismConfig, FLAT] = OrganismConfig()
    """the organism's shape (--d-model, --n-heads, ...; default probekit's)"""


#: Training flags that override the default recipe only when given.
OVERRIDES = ("schedule", "lam", "steps", "lr", "lr_floor", "weight_decay", "feedback_start",
             "fixed_point", "ahead_loss", "short_first", "fixed_point_rows", "close_pairs",
             "close_pairs_rows", "close_pairs_batch", "ema", "match_hint", "match_hint_steps",
             "match_hint_parts")


def recipe_of(args: Args) -> Recipe:
    """The default recipe with the flags given in ``args``."""
    extra = {k: getattr(args, k) for k in OVERRIDES if getattr(args, k) is not None}
    return Recipe.default(args.seed, tasks=args.tasks, shape=args.shape, feed=args.feed,
                          copy_rows=args.copy_rows, copy_from=args.copy_from,
                          n_examples=args.n_examples, long_rows=args.long_rows,
                          recall_rows=args.recall_rows, **extra)


def main() -> int:
    try:  # a shape that cannot be built, a value TrainConfig refuses (e.g. --lr 0)
        recipe = recipe_of(tyro.cli(Args))
    except ValueError as err:
        return script_error("organism_checkpoint", str(err))
    ckpt = trained_organism(recipe, log=lambda line: print(line, file=sys.stderr))
    record = sealed(recipe)
    print(f"trained in {record['train_seconds']:.0f} s; task accuracy "
          f"{record['task_accuracy']}", file=sys.stderr)
    print(ckpt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
