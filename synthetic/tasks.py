"""Task registry: ``make_task(name, tokenizer, ...)`` for every App. F task.

=================  ==========================  ===================  ====================
name               returns                     default size         ``enlarged=True``
=================  ==========================  ===================  ====================
completion         Dataset                     192 (16 groups x     1,600 (80 groups x
                                               4 x distractors       4 x 5 distractor
                                               0/8/32)               counts)
memory             Dataset                     192 (32 groups x     1,280 (128 groups x
                                               2 x 0/8/32)           2 x 5 counts)
registers          Dataset (m=8, 16 writes)    256 (16 groups)      2,048 (128 groups)
register-sweep     {m: Dataset}, m=1,2,4,8     480 in all           3,840 in all
                   (180 tokens each)           (16 groups per m)    (128 groups per m)
overwrite-sweep    {writes: Dataset}, 2/4/8    768 in all (256      6,144 in all (2,048
                   (180/276/468 tokens)        per setting)         per setting)
=================  ==========================  ===================  ====================

``n_examples`` is the total over everything returned (for the sweeps, over all
conditions, as the paper's "3,840 examples per prefill condition" is) and must be a
multiple of the examples per group. ``distractors`` is the list of null-update counts
for completion and memory (``None``: 0/8/32, or all of 0/8/32/128/256 when enlarged)
and the single null-update count for the register tasks (``None``: 8). Other keyword
options go to the task's generator (e.g. ``m=4`` for ``registers``; ``pairing="query"``
(default) or ``"complement"`` for the three register tasks, see ``synthetic.registers``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from synthetic.completion import completion_dataset
from synthetic.dataset import DISTRACTOR_COUNTS, Dataset
from synthetic.memory import memory_dataset
from synthetic.registers import (
    OVERWRITE_LENGTHS,
    REGISTER_COUNTS,
    overwrite_sweep,
    register_sweep,
    registers_dataset,
)

TaskResult = Dataset | dict[int, Dataset]

#: Distractor counts of the small default completion and memory tasks.
DEFAULT_DISTRACTORS = (0, 8, 32)
#: Null updates of the register tasks (App. F: "eight label-independent scratch updates").
REGISTER_DISTRACTORS = 8


def _n_groups(name: str, n_examples: int | None, per_group: int, default: int) -> int:
    if n_examples is None:
        return default
    if n_examples < per_group or n_examples % per_group:
        raise ValueError(
            f"n_examples for task {name!r} must be a positive multiple of {per_group} "
            f"(examples per group with these options); got {n_examples}"
        )
    return n_examples // per_group


def _counts(distractors: int | Sequence[int] | None, enlarged: bool) -> tuple[int, ...]:
    if distractors is None:
        return DISTRACTOR_COUNTS if enlarged else DEFAULT_DISTRACTORS
    return (distractors,) if isinstance(distractors, int) else tuple(distractors)


def _single_count(name: str, distractors: int | Sequence[int] | None) -> int:
    if distractors is None:
        return REGISTER_DISTRACTORS
    if not isinstance(distractors, int):
        raise TypeError(
            f"distractors for task {name!r} is one null-update count (int); got {distractors!r}"
        )
    return distractors


def _completion(tokenizer: Any, *, n_examples: int | None, seed: int,
                distractors: int | Sequence[int] | None, enlarged: bool, **options: Any) -> Dataset:
    counts = _counts(distractors, enlarged)
    n_groups = _n_groups("completion", n_examples, 4 * len(counts), 80 if enlarged else 16)
    return completion_dataset(
        tokenizer, n_groups=n_groups, distractors=counts, seed=seed, **options
    )


def _memory(tokenizer: Any, *, n_examples: int | None, seed: int,
            distractors: int | Sequence[int] | None, enlarged: bool, **options: Any) -> Dataset:
    counts = _counts(distractors, enlarged)
    n_groups = _n_groups("memory", n_examples, 2 * len(counts), 128 if enlarged else 32)
    return memory_dataset(tokenizer, n_groups=n_groups, distractors=counts, seed=seed, **options)


def _registers(tokenizer: Any, *, n_examples: int | None, seed: int,
               distractors: int | Sequence[int] | None, enlarged: bool, **options: Any) -> Dataset:
    m = options.pop("m", 8)
    n_groups = _n_groups("registers", n_examples, 2 * m, 128 if enlarged else 16)
    return registers_dataset(tokenizer, m=m, distractors=_single_count("registers", distractors),
                             n_groups=n_groups, seed=seed, **options)


def _register_sweep(tokenizer: Any, *, n_examples: int | None, seed: int,
                    distractors: int | Sequence[int] | None, enlarged: bool,
                    **options: Any) -> dict[int, Dataset]:
    counts = options.pop("register_counts", REGISTER_COUNTS)
    n_groups = _n_groups("register-sweep", n_examples, 2 * sum(counts), 128 if enlarged else 16)
    return register_sweep(tokenizer, register_counts=counts, n_groups=n_groups, seed=seed,
                          distractors=_single_count("register-sweep", distractors), **options)


def _overwrite_sweep(tokenizer: Any, *, n_examples: int | None, seed: int,
                     distractors: int | Sequence[int] | None, enlarged: bool,
                     **options: Any) -> dict[int, Dataset]:
    m = options.pop("m", 8)
    lengths = options.pop("lengths", OVERWRITE_LENGTHS)
    n_groups = _n_groups("overwrite-sweep", n_examples, 2 * m * len(lengths),
                         128 if enlarged else 16)
    return overwrite_sweep(tokenizer, m=m, lengths=lengths, n_groups=n_groups, seed=seed,
                           distractors=_single_count("overwrite-sweep", distractors), **options)


#: Task name -> builder ``(tokenizer, *, n_examples, seed, distractors, enlarged, **options)``.
TASKS: dict[str, Callable[..., TaskResult]] = {
    "completion": _completion,
    "memory": _memory,
    "registers": _registers,
    "register-sweep": _register_sweep,
    "overwrite-sweep": _overwrite_sweep,
}


def make_task(
    name: str,
    tokenizer: Any,
    *,
    n_examples: int | None = None,
    seed: int = 0,
    distractors: int | Sequence[int] | None = None,
    enlarged: bool = False,
    **options: Any,
) -> TaskResult:
    """Generate task ``name`` for ``tokenizer`` (sizes and options: module docstring).

    The result is validated (``synthetic.dataset.validate``) for ``tokenizer``.

    Raises:
        ValueError: for an unknown ``name``, a bad size or option, or a tokenizer in
            which the task's invariants cannot hold.
        TypeError: for a sequence of ``distractors`` given to a register task.
    """
    if name not in TASKS:
        raise ValueError(f"name must be one of {sorted(TASKS)}; got {name!r}")
    return TASKS[name](tokenizer, n_examples=n_examples, seed=seed, distractors=distractors,
                       enlarged=enlarged, **options)
