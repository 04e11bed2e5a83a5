"""Which ``(source, destination)`` block pairs a layer sweep visits.

A pair ``(s, d)`` needs ``0 <= d < s <= L - 1`` on a model of ``L`` blocks (the
recirculation paper's heatmaps, Sec. 4.1 Fig. 5, cover the whole triangle). Sweeping
every pair token by token is expensive (``L (L - 1) / 2`` cells: 435 on a 30-block
model), so the default is a coarse grid near the diagonal, chosen from the depth:
``step = max(1, round(L / 10))`` and ``max_gap = 4 * step``, i.e. destinations
``1, 1 + step, ...`` with gaps ``step, 2 step, 3 step, 4 step`` (30 pairs on SmolLM2's 30
blocks, step 3, gap 12; every pair with ``s - d <= 4`` on a 4-block tiny model). Pairs
far from the diagonal mix a deep residual into a very shallow block, which the paper
found harmful everywhere; the grid spends the budget where the interesting region lies.

No torch here: the command validates its flags with these functions before loading a
model.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

#: how pairs are chosen: every pair, those near the diagonal, or an explicit list
KINDS = ("all", "max-gap", "list")
PAIR = re.compile(r"(\d+)-(\d+)")


def default_step(n_blocks: int) -> int:
    """Grid step when none is given: ``max(1, round(L / 10))`` (module docstring)."""
    return max(1, round(n_blocks / 10))


def default_max_gap(n_blocks: int) -> int:
    """Largest ``source - destination`` when none is given: four grid steps."""
    return 4 * default_step(n_blocks)


def parse_range(spec: str, what: str) -> range:
    """``"a:b"`` / ``"a:b:step"`` (b exclusive) or a single ``"n"``; ``what`` names the flag."""
    try:
        parts = [int(x) for x in spec.split(":")]
    except ValueError:
        raise ValueError(f"{what} {spec!r}: expected a:b or a:b:step (b exclusive), e.g. 2:15:4") \
            from None
    if len(parts) == 1:
        return range(parts[0], parts[0] + 1)
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] < 1):
        raise ValueError(f"{what} {spec!r}: expected a:b or a:b:step with step >= 1")
    return range(*parts)


def parse_pair(spec: str, what: str = "--pair-list") -> tuple[int, int]:
    """``"11-4"`` -> ``(11, 4)``: source first, then destination, ``destination < source``."""
    m = PAIR.fullmatch(spec.strip())
    if m is None:
        raise ValueError(f"{what} {spec!r}: expected source-destination, e.g. 11-4")
    s, d = int(m.group(1)), int(m.group(2))
    if not d < s:
        raise ValueError(f"{what} {spec}: need destination < source (write source-destination)")
    return s, d


def make_pairs(n_blocks: int, kind: str = "all", *, max_gap: int | None = None,
               listed: Sequence[tuple[int, int]] = (), step: int = 1,
               destinations: range | None = None,
               sources: range | None = None) -> list[tuple[int, int]]:
    """``(source, destination)`` pairs, sorted by destination then source.

    Args:
        kind: ``"all"`` (every ``0 <= d < s <= L-1``), ``"max-gap"`` (``s - d <= max_gap``)
            or ``"list"`` (``listed``, explicit ``(source, destination)`` pairs).
        max_gap: for ``max-gap`` (None: :func:`default_max_gap`).
        step: a coarser grid for ``all`` / ``max-gap``: destinations ``1, 1+step, ...``
            and gaps ``step, 2 step, ...`` (1 keeps every pair; explicit lists ignore it).
        destinations, sources: optional filters (ranges of block indices).
    """
    if kind not in KINDS:
        raise ValueError(f"--pairs {kind!r}: expected one of {', '.join(KINDS)}")
    if step < 1:
        raise ValueError(f"--step must be >= 1; got {step}")
    all_pairs = [(s, d) for d in range(n_blocks) for s in range(d + 1, n_blocks)]
    if kind == "list":
        if not listed:
            raise ValueError("--pairs list needs --pair-list, e.g. --pair-list 11-4 12-4")
        pairs = [(int(s), int(d)) for s, d in listed]
        for s, d in pairs:
            if not 0 <= d < s <= n_blocks - 1:
                raise ValueError(f"pair {s}-{d}: need 0 <= destination < source <= "
                                 f"{n_blocks - 1} (write source-destination)")
    else:
        pairs = all_pairs
        if kind == "max-gap":
            gap = default_max_gap(n_blocks) if max_gap is None else max_gap
            if gap < 1:
                raise ValueError(f"--max-gap must be >= 1; got {gap}")
            pairs = [(s, d) for s, d in all_pairs if s - d <= gap]
        if step > 1:
            pairs = [(s, d) for s, d in pairs if d % step == 1 % step and (s - d) % step == 0]
    if destinations is not None:
        pairs = [(s, d) for s, d in pairs if d in destinations]
    if sources is not None:
        pairs = [(s, d) for s, d in pairs if s in sources]
    if not pairs:
        raise ValueError(f"--pairs {kind} with --step {step} and the --destinations/--sources "
                         f"filters selects no pair on a model of {n_blocks} blocks")
    return sorted(set(pairs), key=lambda p: (p[1], p[0]))
