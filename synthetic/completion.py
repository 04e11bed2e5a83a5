"""Completion tracking (latent-feedback paper, App. F "Completion tracking"; Sec. 4.4).

Each input states a required count ``a`` and a completed count ``b``, then a scratch
context and ``d`` null updates, and ends at the shared colon of ``Status:``::

    required = 41
    completed = 97
    scratch = 7
    scratch += 0        (d lines, d in 0/8/32/128/256)
    Status:

The target is ``done`` if ``a == b`` and ``more`` otherwise (``label_words =
("more", "done")``, so ``label_id`` 1 means done). Each unordered numeral pair
``{a, b}`` is one cross-validation group and yields all four assignments
``(a,a), (a,b), (b,a), (b,b)`` for every distractor count, balancing every numeral
across fields and labels. Matched pairs share the required count, scratch context and
distractors and differ only in the completed count: ``(a,b)/(a,a)`` and ``(b,a)/(b,b)``.

Choices where the paper is silent: numerals are the two-digit numbers 10..99 (the paper
needs at least 80 distinct pairs, more than single digits give, and equal-width
numerals keep matched partners the same token length); a group's scratch start value
(0..9) is drawn once and shared by all its examples.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations
from typing import Any

import numpy as np

from synthetic.dataset import Dataset, Example, scratch_lines, validate

TASK = "completion"
LABEL_WORDS = ("more", "done")
NUMERALS = tuple(range(10, 100))


def completion_text(required: int, completed: int, scratch: int, distractors: int) -> str:
    """The input for one assignment (no trailing newline; ends at ``Status:``)."""
    lines = [f"required = {required}", f"completed = {completed}"]
    lines += scratch_lines(scratch, distractors)
    return "\n".join(lines + ["Status:"])


def completion_dataset(
    tokenizer: Any,
    *,
    n_groups: int = 16,
    distractors: Sequence[int] = (0, 8, 32),
    numerals: Sequence[int] = NUMERALS,
    seed: int = 0,
) -> Dataset:
    """``n_groups`` numeral pairs x 4 assignments x ``len(distractors)`` examples.

    Raises:
        ValueError: if ``n_groups`` exceeds the number of numeral pairs, or the result
            breaks a task invariant for ``tokenizer`` (see ``validate``).
    """
    all_pairs = list(combinations(sorted(set(numerals)), 2))
    if not 1 <= n_groups <= len(all_pairs):
        raise ValueError(
            f"n_groups must be in 1..{len(all_pairs)} for these numerals; got {n_groups}"
        )
    rng = np.random.default_rng(seed)
    chosen = rng.choice(len(all_pairs), size=n_groups, replace=False)
    examples: list[Example] = []
    pair_id = 0
    for group, k in enumerate(chosen):
        a, b = all_pairs[k]
        scratch = int(rng.integers(0, 10))
        for d in distractors:
            # Partners share the required count: (a,b)/(a,a), then (b,a)/(b,b).
            for required, other in ((a, b), (b, a)):
                for completed in (other, required):
                    done = int(required == completed)
                    examples.append(Example(
                        text=completion_text(required, completed, scratch, d),
                        label=LABEL_WORDS[done], label_id=done, group=group, pair=pair_id,
                        task=TASK, condition={"distractors": d},
                    ))
                pair_id += 1
    dataset = Dataset(TASK, LABEL_WORDS, examples, metadata={
        "seed": seed, "n_groups": n_groups, "distractors": list(distractors),
        "paper": "latent-feedback App. F, completion tracking",
    })
    validate(dataset, tokenizer)
    return dataset
