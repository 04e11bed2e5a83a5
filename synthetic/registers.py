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
group).

Matched pairs (``Example.pair``), two ways:

- ``pairing="query"`` (default, the paper's definition: matched inputs "share the
  complete update history and differ only in the queried register"): within one
  schedule (and, separately, within its complement) register ``r_i`` is paired with
  ``r_j`` when their latest values differ, so the labels are opposite. Rule: scan
  ``i = 0 .. m-1``; an ``r_i`` not yet paired takes the first not-yet-paired ``r_j``,
  ``j > i``, whose latest value differs. Every example is in at most one pair, and the
  pairs are as many as possible (``min(#zeros, #ones)`` of the latest values); the
  rest stay unpaired (``pair = -1``), e.g. every query of a schedule whose registers all
  end equal. The complement has the same pairs, since complementing flips every
  latest value. With ``m = 1`` there is no other register to query, so the paper's
  pair cannot exist: such a dataset falls back to the complement pairs below (its
  ``metadata["pairing"]`` says ``"complement"``), so every sweep condition keeps a
  causal contrast.
- ``pairing="complement"``: the schedule and its complement under the same query. The
  inputs differ only in the assigned values, so patching measures where the model
  holds the *value* with the query held fixed (every example is paired); with
  ``"query"`` the history is held fixed and the patch must carry which register was
  asked for as well as its value.

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

Training text for the model organism (:func:`training_examples`; :func:`training_texts`
gives the rows ``input + " " + label``): independent random inputs of varied shape,
unpadded, whose schedules are never one of the probe sets' schedules
(:func:`probe_schedules`); half of them read registers along the way
(``query = r2`` / ``Value: one`` after an assignment: :data:`TRAINING_READ_RULE`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from synthetic.dataset import Dataset, Example, filler_line, pad_to_length, scratch_lines, validate

LABEL_WORDS = ("zero", "one")
REGISTER_COUNTS = (1, 2, 4, 8)
OVERWRITE_LENGTHS = {2: 180, 4: 276, 8: 468}
#: How matched pairs are formed (module docstring); the first is the default.
PAIRINGS = ("query", "complement")
#: Random streams: each sweep condition and the training text draw from their own.
SWEEP_STREAM, OVERWRITE_STREAM, TRAINING_STREAM = 1, 2, 3
#: Groups per condition of the largest probe set (``enlarged=True``); a seed's smaller
#: sets draw the same schedules first, so excluding these excludes every default size.
PROBE_GROUPS = 128
#: Shapes of the training text: registers, writes per register, null updates.
TRAINING_REGISTERS = (1, 2, 4, 8)
TRAINING_WRITES = (1, 2, 4, 8, 16)
#: Null-update counts of training rows, with their weights: up to the 50 lines that pad the
#: 468-token sweep inputs, so the sweeps' padded shape is a trained one, but mostly short
#: (0-8 take 63% of the rows). Short rows teach the task: with counts uniform over 0-50 an
#: organism still missed even a single register written once after 1,400 steps; with
#: mostly short rows it had it by step 800 (docs/latent-feedback.md).
TRAINING_DISTRACTOR_WEIGHTS = {**dict.fromkeys(range(9), 8), **dict.fromkeys(range(9, 51), 1)}
#: The counts alone: in every organism recipe's cache key since before the weights were.
TRAINING_DISTRACTORS = tuple(TRAINING_DISTRACTOR_WEIGHTS)
#: Intermediate reads in the training rows: this share of the rows (the rest have the probe
#: sets' exact shape) follows each assignment, with probability TRAINING_READ_RATE, by a
#: read of a register written so far, ``query = r2\nValue: one``. A row with one final
#: answer teaches one target; reads give it many, the dense supervision of multi-query
#: associative recall (Arora et al. 2023, "Zoology"). (No organism has learned register
#: binding yet, with or without them: docs/latent-feedback.md, Fig. 7b.)
TRAINING_READ_ROWS = 0.5
TRAINING_READ_RATE = 0.5
#: Which register a read asks for (part of the organism cache key): never the one just
#: written, whose value is the answer of the shortcut "the latest write, whatever the
#: register", so on reads only the register binding pays.
TRAINING_READ_RULE = "a register written so far, not the one just written"
#: Share of the training rows with the sweeps' padding remainder line (``# pad pad``) before
#: the query, so that the padded sweep inputs have a trained shape. It also moves the query
#: off fixed distances from the assignments, which rules out reading them by position and
#: in our runs doubled the plateau before the organism found the queried register
#: (docs/latent-feedback.md).
TRAINING_PAD_ROWS = 0.5

Schedule = list[tuple[int, int]]


def register_text(
    schedule: Sequence[tuple[int, int]],
    scratch: int,
    distractors: int,
    query: int,
    reads: Sequence[tuple[int, int]] = (),
) -> tuple[str, str]:
    """(head, tail) of one input: the padding block, if any, goes between them.

    ``reads``: ``(i, register)`` inserts a read of ``register`` with its answer after the
    ``i``-th assignment (training text only; the probe sets have none)."""
    after: dict[int, list[int]] = {}
    for i, reg in reads:
        after.setdefault(i, []).append(reg)
    lines = []
    for i, (reg, value) in enumerate(schedule):
        lines.append(f"r{reg} = {value}")
        for read in after.get(i, ()):
            bit = latest_value(schedule[: i + 1], read)
            lines += [f"query = r{read}", f"Value: {LABEL_WORDS[bit]}"]
    lines += scratch_lines(scratch, distractors)
    return "\n".join(lines) + "\n", f"query = r{query}\nValue:"


def random_schedule(rng: np.random.Generator, m: int, writes_per_register: int) -> Schedule:
    """Each of ``m`` registers written ``writes_per_register`` times, in random order."""
    registers = np.repeat(np.arange(m), writes_per_register)
    rng.shuffle(registers)
    values = rng.integers(0, 2, size=registers.size)
    return [(int(r), int(v)) for r, v in zip(registers, values)]


def latest_value(schedule: Sequence[tuple[int, int]], register: int) -> int:
    """The value of ``register`` after the schedule (its last assignment)."""
    return [value for reg, value in schedule if reg == register][-1]


def query_pairs(latest: Sequence[int]) -> list[tuple[int, int]]:
    """Registers ``(i, j)``, ``i < j``, with different latest values, paired by the rule of
    the module docstring: each unpaired ``r_i`` in turn takes the first unpaired ``r_j``,
    ``j > i``, whose value differs (a maximum matching: ``min(#zeros, #ones)`` pairs)."""
    paired = [False] * len(latest)
    out = []
    for i, value in enumerate(latest):
        if paired[i]:
            continue
        for j in range(i + 1, len(latest)):
            if not paired[j] and latest[j] != value:
                paired[i] = paired[j] = True
                out.append((i, j))
                break
    return out


def local_pair_ids(pairing: str, latest: Sequence[int]) -> dict[tuple[bool, int], int]:
    """``{(is_complement, query): id}`` within one group, ids in ``0 .. m-1``; queries
    left out are unpaired. ``latest``: the schedule's latest value of every register."""
    m = len(latest)
    if pairing == "complement" or m == 1:
        return {(c, q): q for q in range(m) for c in (False, True)}
    ids = {}
    for k, (i, j) in enumerate(query_pairs(latest)):
        for c in (False, True):
            ids[(c, i)] = ids[(c, j)] = 2 * k + c
    return ids


def schedules(seed: Any, m: int, writes_per_register: int,
              n_groups: int) -> Iterator[tuple[Schedule, int]]:
    """``(schedule, scratch start)`` of each group: the draws of :func:`registers_dataset`."""
    rng = np.random.default_rng(seed)
    for _ in range(n_groups):
        schedule = random_schedule(rng, m, writes_per_register)
        yield schedule, int(rng.integers(0, 10))


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
    pairing: str = "query",
) -> Dataset:
    """``n_groups`` schedules x {schedule, complement} x ``m`` queries.

    Args:
        length: pad every input to exactly this many tokens, or None for no padding.
        pairing: ``"query"`` (same history, different queried register; m = 1 falls back
            to complement pairs) or ``"complement"`` (module docstring).

    Raises:
        ValueError: on a bad size or ``pairing``, a ``length`` the content does not fit,
            or a result that breaks a task invariant for ``tokenizer`` (see ``validate``).
    """
    for name, value in (("m", m), ("writes_per_register", writes_per_register),
                        ("n_groups", n_groups)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1; got {value}")
    if distractors < 0:
        raise ValueError(f"distractors must be >= 0; got {distractors}")
    if pairing not in PAIRINGS:
        raise ValueError(f"pairing must be one of {PAIRINGS}; got {pairing!r}")
    cache: dict[int, str] = {}
    examples: list[Example] = []
    drawn = schedules(seed, m, writes_per_register, n_groups)
    for group, (schedule, scratch) in enumerate(drawn):
        complement = [(reg, 1 - value) for reg, value in schedule]
        ids = local_pair_ids(pairing, [latest_value(schedule, q) for q in range(m)])
        for query in range(m):
            for is_complement, sched in ((False, schedule), (True, complement)):
                head, tail = register_text(sched, scratch, distractors, query)
                text = (head + tail if length is None
                        else pad_to_length(head, tail, length, tokenizer, cache=cache))
                bit = latest_value(sched, query)
                local = ids.get((is_complement, query))
                examples.append(Example(
                    text=text, label=LABEL_WORDS[bit], label_id=bit, group=group,
                    pair=-1 if local is None else group * m + local, task=task,
                    condition={"m": m, "writes_per_register": writes_per_register,
                               "distractors": distractors, "query": query,
                               "complement": is_complement},
                ))
    dataset = Dataset(task, LABEL_WORDS, examples, length=length, metadata={
        "seed": list(np.atleast_1d(seed).tolist()), "n_groups": n_groups, "m": m,
        "writes_per_register": writes_per_register, "distractors": distractors,
        "length": length, "pairing": "complement" if m == 1 else pairing,
        "paper": "latent-feedback App. F, multi-register latest-write",
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
    pairing: str = "query",
) -> dict[int, Dataset]:
    """Register-count sweep: one padded Dataset per register count ``m``."""
    out = {}
    for m in register_counts:
        if assignments % m:
            raise ValueError(f"register_counts must divide assignments={assignments}; got m={m}")
        out[m] = registers_dataset(
            tokenizer, m=m, writes_per_register=assignments // m, distractors=distractors,
            length=length, n_groups=n_groups, seed=(seed, SWEEP_STREAM, m),
            task="register-sweep", pairing=pairing,
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
    pairing: str = "query",
) -> dict[int, Dataset]:
    """Overwrite sweep: one padded Dataset per writes-per-register count (keys of
    ``lengths``, which maps it to the exact input length)."""
    return {
        writes: registers_dataset(
            tokenizer, m=m, writes_per_register=writes, distractors=distractors,
            length=length, n_groups=n_groups, seed=(seed, OVERWRITE_STREAM, writes),
            task="overwrite-sweep", pairing=pairing,
        )
        for writes, length in lengths.items()
    }


# ------------------------------------------------------------ organism training text
@lru_cache(maxsize=4)
def probe_schedules(seed: int = 0, n_groups: int = PROBE_GROUPS) -> frozenset[tuple]:
    """Every schedule (and complement) of the register probe sets of ``seed`` at their
    default shapes (``registers``: m = 8, 2 writes; both sweeps), ``n_groups`` per
    condition, as tuples of ``(register, value)``. Smaller sets of the same seed draw a
    prefix of these, so the default 128 covers every size up to the enlarged one."""
    conditions = [(seed, 8, 2)]
    conditions += [((seed, SWEEP_STREAM, m), m, 16 // m) for m in REGISTER_COUNTS]
    conditions += [((seed, OVERWRITE_STREAM, w), 8, w) for w in OVERWRITE_LENGTHS]
    out = set()
    for stream, m, writes in conditions:
        for schedule, _ in schedules(stream, m, writes, n_groups):
            out.add(tuple(schedule))
            out.add(tuple((reg, 1 - value) for reg, value in schedule))
    return frozenset(out)


def training_examples(
    n_examples: int,
    *,
    seed: int = 0,
    register_counts: Sequence[int] = TRAINING_REGISTERS,
    writes: Sequence[int] = TRAINING_WRITES,
    max_assignments: int = 64,
    distractors: Mapping[int, int] | Sequence[int] = TRAINING_DISTRACTOR_WEIGHTS,
    read_rows: float = TRAINING_READ_ROWS,
    read_rate: float = TRAINING_READ_RATE,
    pad_rows: float = TRAINING_PAD_ROWS,
    exclude_probe_schedules: bool = True,
) -> list[Example]:
    """``n_examples`` independent register inputs of varied shape, for training.

    Each example draws, uniformly and independently: ``m`` from ``register_counts``; the
    writes per register from those ``w`` in ``writes`` with ``m * w <= max_assignments``;
    a random schedule (redrawn while it is one of :func:`probe_schedules`, if
    ``exclude_probe_schedules``); the scratch start 0..9; the null-update count from
    ``distractors`` (counts -> weights, or counts of equal weight); the queried register;
    with probability ``read_rows``, intermediate reads: after each assignment, with
    probability ``read_rate``, a read of a register uniformly drawn from those written so
    far other than the one just written (``condition["reads"]`` counts them); with
    probability ``pad_rows``, the sweeps' remainder line ``#`` + 0-5 ``" pad"`` before the
    query (``condition["pad_line"]``). No padding
    and no tokenizer: the text is :func:`register_text`'s (input ending at ``Value:``),
    ``group`` is the example's index, nothing is paired. Deterministic in ``seed``, drawn
    from a stream of its own.

    Raises:
        ValueError: on an empty or non-positive size, an ``m`` no ``w`` fits, or a read
            or pad-line probability outside [0, 1].
    """
    if n_examples < 1:
        raise ValueError(f"n_examples must be >= 1; got {n_examples}")
    if not register_counts or not writes or min(*register_counts, *writes) < 1:
        raise ValueError(f"register_counts and writes must be counts >= 1; got "
                         f"{list(register_counts)} and {list(writes)}")
    if not distractors or min(distractors) < 0:
        raise ValueError(f"distractors must be counts >= 0; got {list(distractors)}")
    for name, p in (("read_rows", read_rows), ("read_rate", read_rate), ("pad_rows", pad_rows)):
        if not 0 <= p <= 1:
            raise ValueError(f"{name} must lie in [0, 1]; got {p}")
    allowed = {m: [w for w in writes if m * w <= max_assignments] for m in register_counts}
    bad = [m for m, ws in allowed.items() if not ws]
    if bad:
        raise ValueError(f"max_assignments={max_assignments} leaves no writes for m={bad[0]}"
                         f" (writes {list(writes)})")
    weights = distractors if isinstance(distractors, Mapping) else dict.fromkeys(distractors, 1)
    counts = np.array(list(weights))
    shares = np.array(list(weights.values()), dtype=float) / sum(weights.values())
    excluded = probe_schedules() if exclude_probe_schedules else frozenset()
    rng = np.random.default_rng((seed, TRAINING_STREAM))
    out = []
    for i in range(n_examples):
        m = int(rng.choice(register_counts))
        w = int(rng.choice(allowed[m]))
        schedule = random_schedule(rng, m, w)
        while tuple(schedule) in excluded:  # rare: <= 256 of a shape's >= 65,536
            schedule = random_schedule(rng, m, w)
        scratch, d = int(rng.integers(0, 10)), int(rng.choice(counts, p=shares))
        query = int(rng.integers(0, m))
        reads = []
        if rng.random() < read_rows:
            written: list[int] = []
            for j, (reg, _) in enumerate(schedule):
                written += [] if reg in written else [reg]
                others = [r for r in written if r != reg]  # the shortcut's answer excluded
                if others and rng.random() < read_rate:
                    reads.append((j, others[int(rng.integers(0, len(others)))]))
        head, tail = register_text(schedule, scratch, d, query, reads)
        pad_line = bool(rng.random() < pad_rows)
        if pad_line:  # the sweeps' padding remainder line, "# pad pad ..."
            head += filler_line(int(rng.integers(0, 6)))
        bit = latest_value(schedule, query)
        out.append(Example(
            text=head + tail, label=LABEL_WORDS[bit], label_id=bit, group=i,
            task="registers-train",
            condition={"m": m, "writes_per_register": w, "distractors": d, "query": query,
                       "reads": len(reads), "pad_line": pad_line},
        ))
    return out


def training_texts(n_examples: int, **options: Any) -> list[str]:
    """Training rows ``input + " " + label`` of :func:`training_examples` (same options)."""
    return [ex.text + " " + ex.label for ex in training_examples(n_examples, **options)]
