"""Layer sweeps: perplexity change over (source, destination) pairs, alphas and schemes.

Implements ``papers/recirculation.md`` Sec. 4.1 (Fig. 5/6: heatmaps over source and
destination for several ``alpha``), Sec. 4.3 / App. B.3 (normalisation schemes,
Fig. B.1) and Sec. 4.4.3 / App. C.3 (looping versus recirculation, Fig. 8). The command
is ``probekit sweep`` (docs/commands/sweep.md); which pairs it visits is
:mod:`probekit.analysis.pairs`.

Each **cell** is one ``(source s, destination d, alpha, scheme)``; its value is the
percentage change of corpus perplexity against the plain model on the same windows::

    % change = 100 * (exp(mean NLL_cell - mean NLL_base) - 1)

(mean over every predicted token of every window; negative = recirculation helps). The
schemes are the paper's three most-discussed normalisations (App. B.3, Table B.2):

- ``convex``: ``f(z_s) = ||z_d|| / ||z_s|| z_s``, ``beta = 1 - alpha`` (the paper's default);
- ``beta1``:  the same ``f``, ``beta = 1`` (non-convex; Gemma3 4B/12B's choice);
- ``none``:   ``f = identity``, ``beta = 1 - alpha``.

Every position of every window recirculates (token by token, exact K = 1 method). The
**looping** baseline (:mod:`probekit.mechanisms.looping`) is swept over the same pairs
with ``l2 = s`` and ``l1 = d`` (the block-``l2`` output re-enters block ``l1 + 1``, as
the recirculated source re-enters above the destination).

**Batching cells.** Several cells share one engine run, batch row ``i`` carrying cell
``i``'s configuration (:class:`~probekit.mechanisms.rowwise.RowwiseRecirculation`).
Cells are sorted by destination so that rows above the batch's lowest destination
recompute little.

**Resuming.** The work is cut into units (a cell on a batch of windows) and units into
fixed groups (one engine run each), determined by the configuration alone. Each group
is one part of :meth:`probekit.runs.RunDir.map`, so an interrupted sweep restarts at the
first unfinished group and ends with the same numbers as an uninterrupted one (tests
pin it bit for bit).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from probekit.analysis.perplexity import pct_change, perplexity
from probekit.core.engine import StepEngine
from probekit.mechanisms.looping import Looping
from probekit.mechanisms.recirculation import Recirculation
from probekit.mechanisms.rowwise import RowwiseRecirculation

# scheme -> (norm, beta); beta None = 1 - alpha (convex).
SCHEMES: dict[str, tuple[str, float | None]] = {
    "convex": ("ratio", None),
    "beta1": ("ratio", 1.0),
    "none": ("none", None),
}


@dataclass(frozen=True)
class Cell:
    """One sweep cell: recirculation ``source -> destination`` at ``alpha`` under ``scheme``."""

    source: int
    destination: int
    alpha: float
    scheme: str

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown scheme {self.scheme!r}; choose from {', '.join(SCHEMES)}")
        self.recirculation()  # validates source/destination/alpha

    def recirculation(self, ramp: int = 0) -> Recirculation:
        norm, beta = SCHEMES[self.scheme]
        return Recirculation(self.source, self.destination, self.alpha, beta, norm=norm, ramp=ramp)

    @property
    def key(self) -> str:
        return f"rec-s{self.source:03d}-d{self.destination:03d}-a{self.alpha:g}-{self.scheme}"


def make_cells(pairs: Sequence[tuple[int, int]], alphas: Sequence[float],
               schemes: Sequence[str]) -> list[Cell]:
    """Every pair x alpha x scheme, sorted by destination (then source, alpha, scheme)."""
    if not alphas:
        raise ValueError("give at least one alpha (--alphas 0.07 0.1)")
    if not schemes:
        raise ValueError(f"give at least one scheme (--norms {' '.join(SCHEMES)})")
    cells = [Cell(s, d, float(a), sc) for s, d in pairs for a in alphas for sc in schemes]
    return sorted(cells, key=lambda c: (c.destination, c.source, c.alpha, c.scheme))


# ------------------------------------------------------------------ work units


def window_batches(n_windows: int, batch_size: int) -> list[tuple[int, int]]:
    """``[(w0, w1), ...]`` consecutive batches of at most ``batch_size`` windows."""
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1; got {batch_size}")
    return [(w0, min(n_windows, w0 + batch_size)) for w0 in range(0, n_windows, batch_size)]


def plan_groups(cells: Sequence[Cell], n_windows: int, batch_size: int,
                rows: int) -> list[list[tuple[Cell, int, int]]]:
    """Units ``(cell, w0, w1)`` (a cell on one window batch) packed into groups of at most
    ``max(rows, batch_size)`` batch rows, in an order fixed by the arguments alone (what
    makes resuming exact)."""
    if rows < 1:
        raise ValueError(f"--rows must be >= 1; got {rows}")
    units = [(c, w0, w1) for c in cells for w0, w1 in window_batches(n_windows, batch_size)]
    groups, current, used = [], [], 0
    for u in units:
        n = u[2] - u[1]
        if current and used + n > rows:
            groups.append(current)
            current, used = [], 0
        current.append(u)
        used += n
    if current:
        groups.append(current)
    return groups


def unit_key(kind: str, w0: int) -> str:
    return f"{kind}-w{w0:05d}"


def loop_key(source: int, destination: int) -> str:
    """Result key of looping with ``l2 = source``, ``l1 = destination``."""
    return f"loop-l1{destination:03d}-l2{source:03d}"


# -------------------------------------------------------------------- running


@torch.no_grad()
def run_sweep(
    engine: StepEngine,
    windows: Tensor,
    cells: Sequence[Cell],
    run,
    *,
    looping_pairs: Sequence[tuple[int, int]] = (),
    ramp: int = 0,
    batch_size: int = 8,
    rows: int = 64,
    progress: bool = False,
    on_group: Callable[[int], None] | None = None,
) -> dict[str, np.ndarray]:
    """Compute every cell (and looping pair) on ``windows``, resumably in ``run``.

    Args:
        windows: ``[n_windows, T]`` token ids.
        run: a :class:`probekit.runs.RunDir`; finished window batches and groups are its
            parts (:meth:`~probekit.runs.RunDir.map`).
        batch_size: windows per unit (a cell on one batch of windows).
        rows: batch rows per recirculated engine run (units packed together).
        on_group: called with a group's index before it is computed (not when it is
            loaded from an earlier run).

    Returns:
        ``{"baseline": [n_windows, T-1], cell.key: [...], loop_key(s, d): [...]}`` log-probs.
    """
    for c in cells:
        c.recirculation(ramp).check(engine.n_blocks)
    loops = [Looping(d, s) for s, d in looping_pairs]
    for lo in loops:
        lo.check(engine.n_blocks)
    batches = window_batches(windows.shape[0], batch_size)
    groups = plan_groups(cells, windows.shape[0], batch_size, rows)

    def baseline(b: tuple[int, int]) -> dict:
        return {"log_probs": engine.forward(windows[b[0]:b[1]]).log_probs.numpy()}

    def recirculate(unit: tuple[int, list]) -> dict:
        gi, group = unit
        if on_group is not None:
            on_group(gi)
        ids = torch.cat([windows[w0:w1] for _, w0, w1 in group])
        rec = RowwiseRecirculation([c.recirculation(ramp) for c, w0, w1 in group
                                    for _ in range(w1 - w0)])
        lp = engine.run(ids, rec, progress=progress).log_probs.numpy()
        out, r0 = {}, 0
        for c, w0, w1 in group:
            out[unit_key(c.key, w0)] = lp[r0 : r0 + w1 - w0]
            r0 += w1 - w0
        return out

    def loop(unit: tuple[Looping, int, int]) -> dict:
        lo, w0, w1 = unit
        return {"log_probs": lo.run(engine, windows[w0:w1]).log_probs.numpy()}

    parts = run.map([(unit_key("baseline", w0), (w0, w1)) for w0, w1 in batches], baseline,
                    desc="baseline", progress=progress)
    for part in run.map([(f"group{gi:05d}", (gi, g)) for gi, g in enumerate(groups)],
                        recirculate, desc="recirculation", progress=progress).values():
        parts.update({k: {"log_probs": v} for k, v in part.items()})
    parts.update(run.map([(unit_key(loop_key(lo.l2, lo.l1), w0), (lo, w0, w1))
                          for lo in loops for w0, w1 in batches], loop,
                         desc="looping", progress=progress and bool(loops)))

    kinds = ["baseline", *(c.key for c in cells), *(loop_key(lo.l2, lo.l1) for lo in loops)]
    return {k: np.concatenate([parts[unit_key(k, w0)]["log_probs"] for w0, _ in batches])
            for k in kinds}


# ------------------------------------------------------------------ summaries


def per_window(base: np.ndarray, other: np.ndarray) -> list[float]:
    """% perplexity change of each window (row) separately."""
    return [pct_change(b, o) for b, o in zip(base, other, strict=True)]


def summarize_sweep(results: dict, cells: Sequence[Cell], looping_pairs=()) -> dict:
    """% change per cell, heat matrices per (alpha, scheme), best pairs."""
    base = results["baseline"]
    change = {c.key: pct_change(base, results[c.key]) for c in cells}
    sources = sorted({c.source for c in cells} | {s for s, _ in looping_pairs})
    dests = sorted({c.destination for c in cells} | {d for _, d in looping_pairs})

    def matrix(values: dict[tuple[int, int], float]) -> list[list[float | None]]:
        return [[values.get((s, d)) for d in dests] for s in sources]

    panels = []
    for alpha in sorted({c.alpha for c in cells}):
        for scheme in [s for s in SCHEMES if any(c.scheme == s for c in cells)]:
            vals = {(c.source, c.destination): change[c.key] for c in cells
                    if c.alpha == alpha and c.scheme == scheme}
            if not vals:
                continue
            (bs, bd), best = min(vals.items(), key=lambda kv: kv[1])
            panels.append({"alpha": alpha, "scheme": scheme, "matrix": matrix(vals),
                           "best": {"source": bs, "destination": bd, "percent_change": best}})
    best_cell = min(cells, key=lambda c: change[c.key])
    summary = {
        "baseline_perplexity": perplexity(base),
        "n_tokens": int(base.size),
        "sources": sources,
        "destinations": dests,
        "percent_change": change,
        "panels": panels,
        "best": {"source": best_cell.source, "destination": best_cell.destination,
                 "alpha": best_cell.alpha, "scheme": best_cell.scheme,
                 "percent_change": change[best_cell.key],
                 # the spread over windows says how far to trust a small sweep's winner
                 "per_window": per_window(base, results[best_cell.key])},
    }
    if looping_pairs:
        loop = {(s, d): pct_change(base, results[loop_key(s, d)]) for s, d in looping_pairs}
        (bs, bd), best = min(loop.items(), key=lambda kv: kv[1])
        summary["looping"] = {
            "matrix": matrix(loop),
            "percent_change": {f"{s}-{d}": v for (s, d), v in loop.items()},
            "best": {"l2": bs, "l1": bd, "percent_change": best,
                     "per_window": per_window(base, results[loop_key(bs, bd)])},
        }
    return summary
