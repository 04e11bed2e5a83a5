"""Delayed memory (latent-feedback paper, App. F "Delayed memory"; Sec. 4.4).

Each input assigns a binary state, then runs label-independent scratch operations (the
scratch context: a start value and five ``^=`` bits), then ``d`` null updates, and ends
at the shared colon of ``# final state:``::

    state = 1
    scratch = 0
    scratch ^= 0
    scratch ^= 1
    scratch ^= 1
    scratch ^= 0
    scratch ^= 1
    scratch += 0        (d lines, d in 0/8/32/128/256)
    # final state:

The target is ``zero`` or ``one`` by the initial state (``label_id`` = the bit). A
group is one scratch context; it holds both states for every distractor count, and
the two states with the same distractor count form a matched pair (identical but for
the state digit).

Choices where the paper is silent: five ``^=`` operations, as in the paper's example;
the scratch start value is drawn from 0..9 (not only 0 as printed) so that 10 * 2^5 =
320 distinct contexts exist, enough for the enlarged experiment's 128 groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from synthetic.dataset import NULL_UPDATE, Dataset, Example, validate

TASK = "memory"
LABEL_WORDS = ("zero", "one")
N_XOR = 5
N_CONTEXTS = 10 * 2**N_XOR


def memory_text(state: int, scratch: int, xor_bits: Sequence[int], distractors: int) -> str:
    """The input for one state and scratch context (ends at ``# final state:``)."""
    lines = [f"state = {state}", f"scratch = {scratch}"]
    lines += [f"scratch ^= {bit}" for bit in xor_bits]
    lines += [NULL_UPDATE] * distractors
    return "\n".join(lines + ["# final state:"])


def _context(index: int) -> tuple[int, list[int]]:
    """Scratch context ``index`` in 0..N_CONTEXTS-1: (start value, xor bits)."""
    start, bits = divmod(index, 2**N_XOR)
    return start, [(bits >> i) & 1 for i in range(N_XOR)]


def memory_dataset(
    tokenizer: Any,
    *,
    n_groups: int = 32,
    distractors: Sequence[int] = (0, 8, 32),
    seed: int = 0,
) -> Dataset:
    """``n_groups`` scratch contexts x 2 states x ``len(distractors)`` examples.

    Raises:
        ValueError: if ``n_groups`` is not in 1..320, or the result breaks a task
            invariant for ``tokenizer`` (see ``validate``).
    """
    if not 1 <= n_groups <= N_CONTEXTS:
        raise ValueError(f"n_groups must be in 1..{N_CONTEXTS}; got {n_groups}")
    rng = np.random.default_rng(seed)
    contexts = rng.choice(N_CONTEXTS, size=n_groups, replace=False)
    examples: list[Example] = []
    pair_id = 0
    for group, index in enumerate(contexts):
        scratch, bits = _context(int(index))
        for d in distractors:
            for state in (0, 1):
                examples.append(Example(
                    text=memory_text(state, scratch, bits, d),
                    label=LABEL_WORDS[state], label_id=state, group=group, pair=pair_id,
                    task=TASK, condition={"distractors": d},
                ))
            pair_id += 1
    dataset = Dataset(TASK, LABEL_WORDS, examples, metadata={
        "seed": seed, "n_groups": n_groups, "distractors": list(distractors),
        "paper": "latent-feedback App. F, delayed memory",
    })
    validate(dataset, tokenizer)
    return dataset
