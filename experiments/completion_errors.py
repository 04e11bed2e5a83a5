"""Which completion pairs an organism gets wrong: task accuracy on the held-out numeral
pairs per null-update count and prefill regime, and the pairs behind every error
(docs/latent-feedback.md, "Where the errors sit").

    python experiments/completion_errors.py \\
        $(python experiments/organism_checkpoint.py --seed 0 --copy-rows 0.25 \\
          --fixed-point 0.1 --steps 3000 --lr-floor 0)
    python experiments/completion_errors.py CKPT --groups 80 --null-updates 0 8 128 256

Each argument is an organism checkpoint folder (what ``organism_checkpoint.py`` prints).
``--groups 16 --null-updates 0 8`` (the default) is the probe set an organism's sealed
task accuracy is measured on; 80 groups are Fig. 7a's. Every pair of these sets is held
out of training (``probekit.training.organism.held_out_pairs``). ``--pairs trained``
measures pairs the organism did train on instead (any ``--groups``; the rows are
regenerated from the recipe in the organism's cache record), so that misses on unseen
pairs can be told from misses on seen ones:

    python experiments/completion_errors.py CKPT --pairs trained --groups 2000 --null-updates 0

A pair has four assignments (``required`` / ``completed`` = a/b, a/a, b/a, b/b);
``24-99 (2/4)`` means two of them were answered wrongly. The 95% interval resamples pairs
(the four assignments of a pair fail together more often than apart), with
``scipy.stats.bootstrap``. The last column gives each missed pair's cosine between the two
numerals' input embeddings (``probekit.training.numerals.numeral_cosines``) and, in
brackets, the percentage of the 4,005 numeral pairs whose numerals lie further apart:
``0.64 (98%)`` is a pair the organism keeps closer than 98% of all pairs.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path
from typing import Literal

import numpy as np
import tyro

from probekit.commands.common import organisms_problem, regimes_problem, script_error

usage_error = functools.partial(script_error, "completion_errors")
REGIMES = ("none", "last-1", "full")


@dataclasses.dataclass(frozen=True)
class Args:
    checkpoints: tyro.conf.Positional[tuple[Path, ...]] = ()
    """organism checkpoint folders"""
    groups: int = 16
    """numeral pairs (16: the sealed probe set; 32, 64, 80: larger held-out sets)"""
    null_updates: tuple[int, ...] = (0, 8)
    """null-update counts (distractors) to measure at"""
    regimes: tuple[str, ...] = REGIMES
    """prefill regimes: none, last-<k> (the plain model up to the last k positions, which
    are fused), full or passes=<n>"""
    pairs: Literal["held-out", "trained"] = "held-out"
    """held-out: the probe sets' pairs, which training never shows; trained: the first
    --groups (in a fixed random order) of the pairs the organism's training rows hold"""


def _problem(args: Args) -> str | None:
    from probekit.training.organism import HELD_OUT_GROUPS

    if args.pairs == "held-out" and args.groups not in HELD_OUT_GROUPS:
        return (f"--groups must be one of {', '.join(map(str, HELD_OUT_GROUPS))} (the "
                f"held-out pair sets); got {args.groups}")
    if args.groups < 1:
        return f"--groups must be >= 1; got {args.groups}"
    if not args.null_updates or min(args.null_updates) < 0:
        return f"--null-updates must be counts >= 0; got {' '.join(map(str, args.null_updates))}"
    problem = regimes_problem(args.regimes) or organisms_problem(args.checkpoints)
    if problem:
        return problem
    for ck in args.checkpoints:
        if args.pairs == "trained":
            from probekit.training.organism_cache import organism_record

            try:
                organism_record(ck)
            except ValueError as e:  # the recipe says which rows it trained on
                return (f"--pairs trained needs a cached organism's recipe, but {e}; give a "
                        f"checkpoint folder that organism_checkpoint.py printed")
    return None


def trained_pairs(checkpoint: Path, tokenizer) -> set[frozenset[int]]:
    """The unordered numeral pairs (a != b) of the organism's completion training rows,
    regenerated as ``train_organism`` generates them, from the recipe in its cache record."""
    from probekit.training.config import DataConfig
    from probekit.training.data import organism_data
    from probekit.training.organism import completion_numerals
    from probekit.training.organism_cache import organism_record

    recipe = organism_record(checkpoint)[1]["recipe"]
    data = DataConfig(**{k: tuple(v) if k == "tasks" else v
                         for k, v in recipe["data"].items()})
    # copy and recall rows hold no completion row, and adding them leaves the task rows be
    rows = organism_data(tokenizer, tasks=data.tasks, n_examples=data.n_examples,
                         seed=recipe["train"]["seed"], long_rows=data.long_rows).train
    # the word-level tokenizer decodes a newline with a space either side
    numerals = [completion_numerals(text.replace(" \n ", "\n"))
                for text in tokenizer.batch_decode(rows) if text.startswith("required =")]
    return {frozenset(pair) for pair in numerals if pair[0] != pair[1]}


def pair_examples(checkpoint: Path, tokenizer, args: Args) -> list:
    """The completion examples of ``--pairs``: a held-out probe set, or the first
    ``--groups`` trained pairs of all 4,005 in the order of ``completion_dataset(seed=0)``.
    Raises ValueError (one line) when training held fewer pairs than ``--groups``."""
    from probekit.training.organism import completion_numerals
    from synthetic.completion import NUMERALS, completion_dataset

    if args.pairs == "held-out":
        return completion_dataset(tokenizer, n_groups=args.groups,
                                  distractors=args.null_updates, seed=0).examples
    trained = trained_pairs(checkpoint, tokenizer)
    if len(trained) < args.groups:
        raise ValueError(f"--groups {args.groups}: the training rows of {checkpoint} hold "
                         f"only {len(trained)} completion pairs")
    every = len(NUMERALS) * (len(NUMERALS) - 1) // 2
    examples = completion_dataset(tokenizer, n_groups=every, distractors=args.null_updates,
                                  seed=0).examples
    first = {}  # group -> its first example, the a/b assignment (generation order)
    for ex in examples:
        first.setdefault(ex.group, ex)
    keep = [g for g, ex in first.items()
            if frozenset(completion_numerals(ex.text)) in trained][: args.groups]
    wanted = set(keep)
    return [ex for ex in examples if ex.group in wanted]


def pair_interval(right: np.ndarray) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the mean of ``right`` ``[pairs, 4]``, pairs
    resampled; ``(1, 1)`` when every pair is right (the bootstrap is degenerate there)."""
    from scipy.stats import bootstrap

    per_pair = right.mean(axis=1)
    if np.ptp(per_pair) == 0:
        return float(per_pair[0]), float(per_pair[0])
    ci = bootstrap((per_pair,), np.mean, confidence_level=0.95, n_resamples=10_000,
                   method="percentile", random_state=0).confidence_interval
    return float(ci.low), float(ci.high)


def closeness(cosines: np.ndarray, a: int, b: int) -> str:
    """``"0.64 (98%)"``: the cosine of numerals ``a`` and ``b`` in ``cosines`` (10..99's,
    :func:`probekit.training.numerals.numeral_cosines`) and the share of all numeral pairs
    with a smaller one."""
    from synthetic.completion import NUMERALS

    i, j = NUMERALS.index(a), NUMERALS.index(b)
    every = cosines[np.triu_indices(len(NUMERALS), 1)]
    return f"{cosines[i, j]:.2f} ({100 * np.mean(every < cosines[i, j]):.0f}%)"


def errors(checkpoint: Path, args: Args) -> list[tuple[int, str, float, tuple[float, float],
                                                        str, str]]:
    """(null updates, regime, accuracy, its 95% interval, missed pairs, their numerals'
    closeness) of one organism."""
    from probekit.core.engine import StepEngine
    from probekit.training.checkpoint import load_checkpoint
    from probekit.training.numerals import numeral_cosines
    from probekit.training.organism import completion_numerals, label_predictions
    from synthetic.completion import LABEL_WORDS
    from synthetic.dataset import label_token_ids

    ck = load_checkpoint(checkpoint)
    tok, engine = ck.model.tokenizer, StepEngine(ck.model)
    examples = pair_examples(checkpoint, tok, args)
    ids = label_token_ids(tok, LABEL_WORDS)
    pairs = {}  # group -> (a, b), from its a/b assignment
    for ex in examples:
        req, comp = completion_numerals(ex.text)
        if req < comp:
            pairs[ex.group] = (req, comp)
    cosines = numeral_cosines(ck.model)
    out = []
    for d in args.null_updates:
        exs = [ex for ex in examples if ex.condition["distractors"] == d]
        rows = tok([ex.text for ex in exs], add_special_tokens=False)["input_ids"]
        labels = np.array([ex.label_id for ex in exs])
        groups = np.array([ex.group for ex in exs])
        order = sorted(set(groups))
        for regime in args.regimes:
            try:
                wrong = label_predictions(engine, ck.gate, rows, ids, regime) != labels
            except ValueError as e:  # last-k on rows of k tokens or fewer
                raise ValueError(f"--regimes {regime} at {d} null updates: {e}") from None
            right = np.stack([~wrong[groups == g] for g in order])  # [pairs, 4]
            missed = [(pairs[g], n) for g, n in zip(order, (~right).sum(axis=1), strict=True)
                      if n]
            out.append((d, regime, 1 - wrong.mean(), pair_interval(right),
                        ", ".join(f"{a}-{b} ({n}/4)" for (a, b), n in missed) or "-",
                        ", ".join(closeness(cosines, a, b) for (a, b), _ in missed) or "-"))
    return out


def main() -> int:
    args = tyro.cli(Args)
    problem = _problem(args)
    if problem:
        return usage_error(problem)
    for i, ck in enumerate(args.checkpoints):
        try:
            got = errors(ck, args)
        except ValueError as e:  # fewer trained pairs than --groups; last-k on short rows
            return usage_error(str(e))
        if i == 0:
            print("| organism | null updates | regime | accuracy | 95% interval | pairs missed "
                  "| their numerals' cosine (pairs further apart) |\n"
                  "|---|---|---|---|---|---|---|")
        for d, regime, acc, (low, high), missed, close in got:
            print(f"| {ck} | {d} | {regime} | {acc:.3f} | {low:.3f}-{high:.3f} | {missed} | "
                  f"{close} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
