"""Recirculation: mix a deep block's residual into a shallow block, token by token.

Implements ``papers/recirculation.md`` Sec. 2 (Eq. 1-2, Fig. 3c), App. A (iterations),
App. B.3 (normalisation, ramp) and Sec. 5.2 (several paths, blockwise) exactly as
``SEMANTICS.md`` "Recirculation" pins them. For position ``t``:

1. first pass through blocks ``0 .. L-1`` (the engine; the readout comes from it);
2. ``z'_d = alpha_t * f(z_s) + beta_t * z_d`` with ``f(z_s) = ||z_d|| / ||z_s|| * z_s``
   (``norm="ratio"``; ``f = 0`` when ``||z_s|| = 0``) or ``f = identity`` (``"none"``);
   ``alpha_t = min(t / ramp, 1) * alpha``; ``beta_t = 1 - alpha_t`` unless ``beta`` is
   given explicitly, in which case it stays fixed;
3. second pass through blocks ``d+1 .. L-1`` from ``z'_d``, replacing position ``t``'s
   keys/values there (the engine's ``rerun``, with ``replace`` = the active positions).

Choices where the paper is silent (stated here and in SEMANTICS.md's spirit):

- **Several paths** run in ONE recurrent pass starting above the lowest destination.
  When the pass reaches another path's destination block, that block's output (as
  this pass computed it) is mixed with that path's source output from the previous
  pass. Destinations must therefore be distinct.
- **Iterations** ``r``: iteration ``j`` mixes the previous pass's source outputs into
  the destination state of pass ``j`` (the lowest destination, which no pass above it
  recomputes, carries the previous iteration's mixed state). The last pass's keys and
  values are kept.
- Rows/positions outside the mask keep their first-pass keys/values in every block
  (SEMANTICS.md). In a chunk of ``K > 1`` positions the recurrent pass still runs the
  whole chunk, so the engine's ``rerun(..., replace=active)`` keeps those pairs' entries,
  and the chunk's recirculating positions attend to them; only their residual
  (``z'_d = z_d``) flows through the pass, and nothing reads it.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from probekit.core.engine import Recurrence, Rerun, Step

NORMS = ("ratio", "none")


def check_block_pair(low_name: str, low, high_name: str, high, error=ValueError) -> None:
    """Raise ``error`` (ValueError by default) unless ``0 <= low < high`` are block indices:
    the shared rule of a recirculation path (d < s) and a looped range (l1 < l2)."""
    for name, v in ((low_name, low), (high_name, high)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise error(f"{name} must be an integer block index; got {v!r}")
    if low < 0:
        raise ValueError(f"{low_name} must be >= 0; got {low}")
    if high <= low:
        raise ValueError(f"{high_name} ({high}) must be a deeper block than {low_name} ({low}): "
                         f"need 0 <= {low_name} < {high_name}")


def _unit_number(v) -> bool:
    """A real number (not a bool or a string) in [0, 1]; NaN is not."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and 0.0 <= float(v) <= 1.0


def default_pair(n_blocks: int) -> tuple[int, int]:
    """``(source, destination)`` for a model of ``n_blocks`` blocks when none is given:
    ``s = round(2L/3)``, ``d = round(L/3)``, clipped to ``0 <= d < s <= L - 1``.

    Why: the paper's working pairs sit mid-stack, a deep-but-not-top source fed a third
    of the way up (Gemma 3 1B, 26 blocks: s=11, d=4; Sec. 4.1); the top blocks specialise
    in the readout, and the first blocks in token identity. The rule gives SmolLM2-135M
    (30 blocks) its long-standing (20, 10), Gemma 3 270M (18) (12, 6), and a 4-block tiny
    model (3, 1). One block has no pair: recirculation needs two."""
    if not isinstance(n_blocks, int) or n_blocks < 2:
        raise ValueError(f"recirculation needs a model of at least 2 blocks; got {n_blocks}")
    source = min(n_blocks - 1, max(1, round(2 * n_blocks / 3)))
    destination = min(source - 1, round(n_blocks / 3))
    return source, destination


@dataclass(frozen=True)
class RecirculationPath:
    """One ``(source, destination, alpha, beta)`` path; block indices are zero-based
    (``--source 11 --destination 4`` is the paper's Gemma3-1B choice).

    Args:
        source: block whose output is fed back (``s``).
        destination: block whose output is mixed into (``d``), ``0 <= d < s``.
        alpha: mixing weight of the (normalised) source, in [0, 1].
        beta: weight of the destination, in [0, 1]; None means ``1 - alpha_t`` (convex).
    """

    source: int
    destination: int
    alpha: float
    beta: float | None = None

    def __post_init__(self) -> None:
        check_block_pair("destination", self.destination, "source", self.source)
        if not _unit_number(self.alpha):
            raise ValueError(f"alpha must lie in [0, 1]; got {self.alpha!r}")
        if self.beta is not None and not _unit_number(self.beta):
            raise ValueError(f"beta must lie in [0, 1] (or None for 1 - alpha); "
                             f"got {self.beta!r}")


def mix(z_s: Tensor, z_d: Tensor, alpha: Tensor, beta: Tensor, norm: str) -> Tensor:
    """``alpha * f(z_s) + beta * z_d`` over the last dim; ``alpha``/``beta`` broadcast."""
    if norm == "ratio":
        ns = z_s.norm(dim=-1, keepdim=True)
        nd = z_d.norm(dim=-1, keepdim=True)
        # f(z_s) = 0 where ||z_s|| = 0 (the undefined case, fixed by SEMANTICS.md).
        scale = torch.where(ns > 0, nd / ns.clamp_min(torch.finfo(ns.dtype).tiny), 0.0)
        z_s = z_s * scale
    return alpha * z_s + beta * z_d


class Recirculation(Recurrence):
    """The recirculation strategy for :class:`probekit.StepEngine`.

    Either one path (``source``, ``destination``, ``alpha``, ``beta``) or ``paths``.

    Args:
        norm: ``"ratio"`` (rescale the source to the destination's L2 norm) or ``"none"``.
        ramp: ``alpha_t = min(t / ramp, 1) * alpha`` (0: no ramp; the paper used 10).
        iterations: recurrent passes per position (paper App. A; 1 is the method).
    """

    name = "recirculation"

    def __init__(
        self,
        source: int | None = None,
        destination: int | None = None,
        alpha: float = 0.1,
        beta: float | None = None,
        *,
        paths: Sequence[RecirculationPath] | None = None,
        norm: str = "ratio",
        ramp: int = 0,
        iterations: int = 1,
    ) -> None:
        if paths is None:
            if source is None or destination is None:
                raise ValueError("give source and destination, or paths=[RecirculationPath, ...]")
            paths = [RecirculationPath(source, destination, alpha, beta)]
        elif source is not None or destination is not None:
            raise ValueError("give either source/destination or paths, not both")
        paths = sorted(paths, key=lambda p: p.destination)
        if not paths:
            raise ValueError("paths must not be empty")
        dests = [p.destination for p in paths]
        if len(set(dests)) != len(dests):
            raise ValueError(f"paths must have distinct destinations; got {dests}")
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}; got {norm!r}")
        if not isinstance(ramp, int) or isinstance(ramp, bool) or ramp < 0:
            raise ValueError(f"ramp must be an integer >= 0 (0 = no ramp); got {ramp!r}")
        if not isinstance(iterations, int) or isinstance(iterations, bool) or iterations < 1:
            raise ValueError(f"iterations must be an integer >= 1; got {iterations!r}")
        self.paths = tuple(paths)
        self.norm = norm
        self.ramp = ramp
        self.iterations = iterations
        self.capture_first = frozenset(
            {p.source for p in self.paths} | {self.paths[0].destination}
        )

    def __repr__(self) -> str:
        ps = ", ".join(f"s={p.source} d={p.destination} alpha={p.alpha} beta={p.beta}"
                       for p in self.paths)
        return (f"Recirculation({ps}, norm={self.norm}, ramp={self.ramp}, "
                f"iterations={self.iterations})")

    def check(self, n_blocks: int) -> None:
        for p in self.paths:
            if p.source > n_blocks - 1:
                raise ValueError(
                    f"source block {p.source} is out of range: this model has {n_blocks} "
                    f"blocks, numbered 0..{n_blocks - 1}"
                )

    def coefficients(self, path: RecirculationPath, positions: Tensor) -> tuple[Tensor, Tensor]:
        """``alpha_t``, ``beta_t`` for ``positions``, shaped ``[1, pos, 1]``."""
        t = positions.to(torch.float64)
        ramp = torch.clamp(t / self.ramp, max=1.0) if self.ramp else torch.ones_like(t)
        alpha = ramp * path.alpha
        beta = 1.0 - alpha if path.beta is None else torch.full_like(t, float(path.beta))
        return alpha.float()[None, :, None], beta.float()[None, :, None]

    def _mixer(self, path: RecirculationPath, z_s: Tensor, step: Step):
        alpha, beta = self.coefficients(path, step.positions)
        active = step.active[..., None]

        def apply(z_d: Tensor) -> Tensor:
            return torch.where(active, mix(z_s, z_d, alpha, beta, self.norm), z_d)

        return apply

    def after_first_pass(
        self, step: Step, captured: dict[int, Tensor], top: Tensor, rerun: Rerun
    ) -> None:
        if not bool(step.active.any()):
            return  # nothing recirculates in this chunk: first-pass K/V stay as they are
        lowest, *higher = self.paths
        sources = {p.source for p in self.paths}
        previous = captured  # block outputs of the previous pass
        dest_state = captured[lowest.destination]
        for _ in range(self.iterations):
            mixed = self._mixer(lowest, previous[lowest.source], step)(dest_state)
            edits = {p.destination: self._mixer(p, previous[p.source], step) for p in higher}
            previous = rerun(lowest.destination + 1, mixed, capture=sources, edits=edits,
                             replace=step.active)
            dest_state = mixed
