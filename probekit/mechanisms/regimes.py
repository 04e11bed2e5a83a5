"""Prefill regimes: one value type, parsed once at the command line, planned once.

A regime says which positions of a prompt of length ``T`` run with the mechanism on,
and how the engine chunks them (latent-feedback paper Sec. 4.4, Fig. 7, App. F;
SEMANTICS.md "Latent feedback"):

=============  ================================================  =====================
``none``       the plain model, one parallel forward             1 forward
``last-k``     plain forward of positions ``< T-k``, then the     ~``k + 1`` forwards
               final ``k`` positions one by one, mechanism on
``full``       every position one by one, mechanism on           ``T`` sequential steps
``passes=n``   ``n`` Jacobi passes over the whole prompt          ``n`` forwards
               (latent feedback only; readout from the last)
=============  ================================================  =====================

:func:`plan` turns a regime and the real lengths of a right-padded batch into the
engine's ``mask`` and ``block_size`` (ragged rows: ``last-k`` acts on each row's own
final ``k`` tokens). :func:`exact_chunks` gives the chunking that keeps any sparse mask
exact for recirculation (each active position last in its chunk).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

KINDS = ("none", "last-k", "full", "passes")
_LAST = re.compile(r"last-(\d+)")
_PASSES = re.compile(r"passes=(\d+)")


@dataclass(frozen=True)
class Regime:
    """A prefill regime.

    Args:
        kind: ``"none"``, ``"last-k"``, ``"full"`` or ``"passes"``.
        k: final positions with the mechanism on under ``last-k`` (>= 1).
        passes: Jacobi passes under ``passes`` (>= 1; 1 is the plain model).
    """

    kind: str
    k: int | None = None
    passes: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"regime must be none, last-<k>, full or passes=<n>; got "
                             f"{self.kind!r}")
        if self.kind == "last-k" and (not _is_int(self.k) or self.k < 1):
            raise ValueError(f"regime last-k needs k >= 1 (e.g. last-2); got k={self.k!r}")
        if self.kind == "passes" and (not _is_int(self.passes) or self.passes < 1):
            raise ValueError(f"regime passes=<n> needs n >= 1; got {self.passes!r}")
        if self.kind != "last-k" and self.k is not None:
            raise ValueError(f"only last-k takes k; got {self.kind} with k={self.k}")
        if self.kind != "passes" and self.passes is not None:
            raise ValueError(f"only passes=<n> takes a pass count; got {self.kind}")

    @classmethod
    def parse(cls, text: str) -> Regime:
        """``"none"``, ``"full"``, ``"last-3"`` or ``"passes=4"``; ValueError otherwise."""
        word = str(text).strip().lower()
        if m := _LAST.fullmatch(word):
            return cls("last-k", k=int(m.group(1)))
        if m := _PASSES.fullmatch(word):
            return cls("passes", passes=int(m.group(1)))
        if word in ("none", "full"):
            return cls(word)
        raise ValueError(f"regime must be none, last-<k> (e.g. last-2), full or passes=<n>; "
                         f"got {text!r}")

    def __str__(self) -> str:
        if self.kind == "last-k":
            return f"last-{self.k}"
        if self.kind == "passes":
            return f"passes={self.passes}"
        return self.kind

    @property
    def needs_prompt_longer_than(self) -> int:
        """The shortest prompt this regime can run on, minus one."""
        return self.k if self.kind == "last-k" else 0


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_regimes(words: Iterable[str], ks: Sequence[int] = (1, 2, 4)) -> list[Regime]:
    """Regimes from command-line words: ``["none,last-k", "full"]`` with ``ks=(1, 2)`` ->
    ``[none, last-1, last-2, full]``; ``last-k`` stands for ``last-<k>`` for every ``k`` in
    ``ks``; duplicates are dropped, order is kept. ValueError on a bad word."""
    out: list[Regime] = []
    for spec in words:
        for word in filter(None, (w.strip() for w in str(spec).split(","))):
            if word == "last-k":
                if not ks or any(not _is_int(k) or k < 1 for k in ks):
                    raise ValueError(f"--k must list integers >= 1 for last-k; got {list(ks)}")
                found = [Regime("last-k", k=k) for k in ks]
            else:
                found = [Regime.parse(word)]
            out += [r for r in found if r not in out]
    if not out:
        raise ValueError("give at least one regime: none, last-k (with --k), last-<k>, full "
                         "or passes=<n>")
    return out


@dataclass(frozen=True)
class Plan:
    """One engine call for a regime: ``engine.run(ids, rec, mask=mask, block_size=...)``.

    Attributes:
        mask: ``[batch, T]`` bool of the positions the mechanism acts on, or None (all).
        block_size: an int, or the sizes of consecutive chunks.
        passes: recurrent passes per chunk (``passes=n``; else 1).
        off: True when the mechanism is off everywhere (``none``).
    """

    mask: Tensor | None
    block_size: int | list[int]
    passes: int = 1
    off: bool = False


def plan(regime: Regime, lengths) -> Plan:
    """The engine call for ``regime`` on a right-padded batch with real ``lengths``."""
    if not isinstance(regime, Regime):
        raise TypeError(f"regime must be a Regime (Regime.parse('full')); got {regime!r}")
    given = torch.as_tensor(np.asarray(lengths))
    if given.is_floating_point() and not bool((given == given.round()).all()):
        raise ValueError(f"lengths must be whole numbers; got {given.tolist()}")
    lengths = given.long()
    if lengths.ndim != 1 or len(lengths) == 0 or int(lengths.min()) < 1:
        raise ValueError(f"lengths must be a non-empty list of lengths >= 1; got {lengths}")
    seq = int(lengths.max())
    if regime.kind == "none":
        return Plan(torch.zeros(len(lengths), seq, dtype=torch.bool), seq, off=True)
    if regime.kind == "full":
        return Plan(None, 1)
    if regime.kind == "passes":
        return Plan(None, seq, passes=regime.passes)
    shortest = int(lengths.min())
    if regime.k >= shortest:
        raise ValueError(f"regime {regime} needs prompts longer than k={regime.k} tokens; "
                         f"the shortest prompt has {shortest}")
    # each row's own final k positions; every active position must be alone in its chunk
    # (token by token), so the parallel chunk stops before the shortest row's suffix.
    t = torch.arange(seq)[None, :]
    mask = (t >= lengths[:, None] - regime.k) & (t < lengths[:, None])
    head = shortest - regime.k
    return Plan(mask, [head] + [1] * (seq - head))


def exact_chunks(mask: Tensor | np.ndarray) -> list[int]:
    """Chunk sizes (summing to ``T``) in which every chunk ends at a position that some row
    of ``mask`` (``[T]`` or ``[B, T]`` bool) marks and no other position of a chunk is
    marked; a final chunk holds the positions after the last mark. For recirculation,
    which acts only after a position's first pass, such a chunking equals token by token
    exactly, at the cost of one step per marked position."""
    mask = torch.as_tensor(np.asarray(mask), dtype=torch.bool)
    active = mask.reshape(-1, mask.shape[-1]).any(0)
    ends = (torch.nonzero(active).flatten() + 1).tolist()
    seq = active.shape[0]
    if not ends or ends[-1] != seq:
        ends.append(seq)
    return np.diff([0, *ends]).tolist()
