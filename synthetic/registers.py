"""Multi-register latest-write tracking and its sweeps (latent-feedback paper, App. F).

An input assigns binary values to registers ``r0 .. r{m-1}`` in a random schedule,
runs the scratch context (``scratch = s`` and ``d = 8`` null updates), optionally a
padding block, then queries one register and ends at the shared colon of ``Value:``::

    r4 = 0
    r4 = 1
    r0 = 1
    ...                 (16 assignments: each register written 16/m times)
    scratch = 7
    scratch += 0        (8 null updates)
    scratch += 0        (padding: extra null updates, then "# pad pad ..." if needed)
    query = r0
    Value:

The target is ``zero`` or ``one`` by the queried register's latest assignment
(``label_id`` = that bit). A group is one schedule: the schedule, its bitwise value
complement, and a query for every register (``2 m`` examples, labels balanced within the
group). The matched pair is (schedule, complement) with the same query: the inputs are
identical but for the assigned values, and the labels are always opposite.

Sweeps ("Register-count and overwrite sweeps"):

- register-count: ``m in {1, 2, 4, 8}``, 16 assignments, 8 null updates, padded to
  exactly 180 tokens, so only the number of registers varies;
- overwrite: ``m = 8`` with 2, 4 or 8 writes per register, padded to 180, 276 and 468
  tokens (the paper's lengths; ``r4 = 0`` is 6 tokens as in the paper's tokenizer).

Choices where the paper is silent: every register is written exactly
``assignments / m`` times (so every query is defined and m = 8 of the register sweep
is the 2-writes setting of the overwrite sweep); assigned values are independent fair
bits; "eight null updates" are eight ``scratch += 0`` lines after ``scratch = s``, the
reading that counts distractors the same way in every task; the padding block sits
after the null updates, right before the query; each sweep condition draws its own
schedules (groups are numbered from 0 within a condition).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from synthetic.dataset import Dataset, Example, pad_to_length, scratch_lines, validate

LABEL_WORDS = ("zero", "one")
REGISTER_COUNTS = (1, 2, 4, 8)
OVERWRITE_LENGTHS = {2: 180, 4: 276, 8: 468}


def register_text(
    schedule: Sequence[tuple[int, int]],
    scratch: int,
    distractors: int,
    query: int,
) -> tuple[str, str]:
    """(head, tail) of one input: the padding block, if any, goes between them."""
    lines = [f"r{reg} = {value}" for reg, value in schedule]
    lines += scratch_lines(scratch, distractors)
    return "\n".join(lines) + "\n", f"query = r{query}\nValue:"


def random_schedule(
    rng: np.random.Generator, m: int, writes_per_register: int
) -> list[tuple[int, int]]:
    """Each of ``m`` registers written ``writes_per_register`` times, in random order."""
    registers = np.repeat(np.arange(m), writes_per_register)
    rng.shuffle(registers)
    values = rng.integers(0, 2, size=registers.size)
    return [(int(r), int(v)) for r, v in zip(registers, values)]


def latest_value(schedule: Sequence[tuple[int, int]], register: int) -> int:
    """The value of ``register`` after the schedule (its last assignment)."""
    return [value for reg, value in schedule if reg == register][-1]


def registers_dataset(
    tokenizer: Any,
    *,
    m: int = 8,
    writes_per_register: int = 2,
    distractors: int = 8,
    length: int | None = None,
    n_groups: int = 16,
    seed: int | Sequence[int] = 0,
    task: str = "registers",
) -> Dataset:
    """``n_groups`` schedules x {schedule, complement} x ``m`` queries.

    Args:
        length: pad every input to exactly this many tokens, or None for no padding.

    Raises:
        ValueError: on a bad size, a ``length`` the content does not fit, or a result
            that breaks a task invariant for ``tokenizer`` (see ``validate``).
    """
    for name, value in (("m", m), ("writes_per_register", writes_per_register),
                        ("n_groups", n_groups)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1; got {value}")
    if distractors < 0:
        raise ValueError(f"distractors must be >= 0; got {distractors}")
    rng = np.random.default_rng(seed)
    cache: dict[int, str] = {}
    examples: list[Example] = []
    for group in range(n_groups):
        schedule = random_schedule(rng, m, writes_per_register)
        complement = [(reg, 1 - value) for reg, value in schedule]
        scratch = int(rng.integers(0, 10))
        for query in range(m):
            pair_id = group * m + query
            for is_complement, sched in ((False, schedule), (True, complement)):
                head, tail = register_text(sched, scratch, distractors, query)
                text = (head + tail if length is None
                        else pad_to_length(head, tail, length, tokenizer, cache=cache))
                bit = latest_value(sched, query)
                examples.append(Example(
                    text=text, label=LABEL_WORDS[bit], label_id=bit, group=group,
                    pair=pair_id, task=task,
                    condition={"m": m, "writes_per_register": writes_per_register,
                               "distractors": distractors, "query": query,
                               "complement": is_complement},
                ))
    dataset = Dataset(task, LABEL_WORDS, examples, length=length, metadata={
        "seed": list(np.atleast_1d(seed).tolist()), "n_groups": n_groups, "m": m,
        "writes_per_register": writes_per_register, "distractors": distractors,
        "length": length, "paper": "latent-feedback App. F, multi-register latest-write",
    })
    validate(dataset, tokenizer)
    return dataset


def register_sweep(
    tokenizer: Any,
    *,
    register_counts: Sequence[int] = REGISTER_COUNTS,
    assignments: int = 16,
    distractors: int = 8,
    length: int = 180,
    n_groups: int = 16,
    seed: int = 0,
) -> dict[int, Dataset]:
    """Register-count sweep: one padded Dataset per register count ``m``."""
    out = {}
    for m in register_counts:
        if assignments % m:
            raise ValueError(f"register_counts must divide assignments={assignments}; got m={m}")
        out[m] = registers_dataset(
            tokenizer, m=m, writes_per_register=assignments // m, distractors=distractors,
            length=length, n_groups=n_groups, seed=(seed, 1, m), task="register-sweep",
        )
    return out


def overwrite_sweep(
    tokenizer: Any,
    *,
    m: int = 8,
    lengths: dict[int, int] = OVERWRITE_LENGTHS,
    distractors: int = 8,
    n_groups: int = 16,
    seed: int = 0,
) -> dict[int, Dataset]:
    """Overwrite sweep: one padded Dataset per writes-per-register count (keys of
    ``lengths``, which maps it to the exact input length)."""
    return {
        writes: registers_dataset(
            tokenizer, m=m, writes_per_register=writes, distractors=distractors,
            length=length, n_groups=n_groups, seed=(seed, 2, writes), task="overwrite-sweep",
        )
        for writes, length in lengths.items()
    }
