"""Row-wise recirculation: a different single recirculation path on every batch row.

The recirculation of :mod:`probekit.mechanisms.recirculation` (SEMANTICS.md
"Recirculation"; ``papers/recirculation.md`` Sec. 2, Eq. 1-2), with row ``i`` of the
batch carrying its own ``(source, destination, alpha, beta, norm)``. It exists so that
many configurations can share one token-by-token engine run (the layer sweep's cells,
:mod:`probekit.analysis.sweep`): on a CPU a step costs about the same for 4 rows as for
64, so packing cells into rows divides the sweep's time.

How rows with different destinations share one second pass: the pass starts above the
lowest destination in the batch. A row whose destination is higher recomputes its blocks
below that destination from the same input on the same cache, so it gets the same
outputs and keys/values as its first pass (the engine replaces, not appends, them); the
mix is applied to that row when the pass reaches its own destination. Each row therefore
equals a one-path :class:`~probekit.mechanisms.recirculation.Recirculation` run of its
own (tests pin it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from probekit.core.engine import Recurrence, Rerun, Step
from probekit.mechanisms.recirculation import Recirculation, mix


class RowwiseRecirculation(Recurrence):
    """Recirculation with a different single path per batch row.

    Args:
        rows: per batch row, the :class:`~probekit.mechanisms.recirculation.Recirculation`
            (one path, one iteration) that row runs; every row must share ``ramp``.
    """

    name = "rowwise-recirculation"

    def __init__(self, rows: Sequence[Recirculation]) -> None:
        if not rows:
            raise ValueError("rows must not be empty")
        for r in rows:
            if len(r.paths) != 1 or r.iterations != 1:
                raise ValueError("each row must be a one-path, one-iteration Recirculation")
        if len({r.ramp for r in rows}) != 1:
            raise ValueError("every row must use the same ramp")
        self.rows = list(rows)
        self.paths = [r.paths[0] for r in rows]
        self.lowest = min(p.destination for p in self.paths)
        self.capture_first = frozenset({p.source for p in self.paths} | {self.lowest})
        self._ratio = torch.tensor([r.norm == "ratio" for r in rows])[:, None, None]

    def check(self, n_blocks: int) -> None:
        for r in self.rows:
            r.check(n_blocks)

    def begin(self, batch_size: int, seq_len: int) -> None:
        if batch_size != len(self.rows):
            raise ValueError(f"batch has {batch_size} rows but {len(self.rows)} row configs")

    def after_first_pass(self, step: Step, captured: dict[int, Tensor], top: Tensor,
                         rerun: Rerun) -> None:
        if not bool(step.active.any()):
            return
        coeffs = [r.coefficients(r.paths[0], step.positions) for r in self.rows]
        alpha = torch.cat([a for a, _ in coeffs])  # [batch, pos, 1]
        beta = torch.cat([b for _, b in coeffs])
        z_s = torch.stack([captured[p.source][i] for i, p in enumerate(self.paths)])
        dests = torch.tensor([p.destination for p in self.paths])

        def mixer(block: int):
            rows = (dests == block)[:, None, None] & step.active[..., None]

            def apply(z_d: Tensor) -> Tensor:
                mixed = torch.where(self._ratio, mix(z_s, z_d, alpha, beta, "ratio"),
                                    mix(z_s, z_d, alpha, beta, "none"))
                return torch.where(rows, mixed, z_d)

            return apply

        edits = {d: mixer(d) for d in set(dests.tolist()) if d != self.lowest}
        rerun(self.lowest + 1, mixer(self.lowest)(captured[self.lowest]), edits=edits,
              replace=step.active)
