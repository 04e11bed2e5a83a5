"""Layer sweeps: perplexity change over (source, destination) pairs (`probekit sweep`).

    probekit sweep                              # 30 pairs, alpha 0.1, convex: ~10 min
    probekit sweep --pairs max-gap 9 --destinations 7:17:3 --alphas 0.04,0.1,0.2 \\
        --norms convex,beta1,none --looping

Defaults (small on purpose, for a 2-core CPU): pairs with ``source - destination <= 12``
on a grid of step 3 (destinations 1, 4, 7, ...; gaps 3, 6, 9, 12: 30 pairs on the
30-block default model), ``alpha = 0.1``, the convex scheme, 4 wiki windows of 128
tokens. Measured: one 64-row engine run (16 cells) of 128 tokens takes ~4-5 min there.

Implements ``papers/recirculation.md`` Sec. 4.1 (Fig. 5/6: heatmaps over source and
destination for several ``alpha``), Sec. 4.3 / App. B.3 (normalisation schemes,
Fig. B.1) and Sec. 4.4.3 / App. C.3 (looping versus recirculation, Fig. 8).

Each **cell** is one ``(source s, destination d, alpha, scheme)``; its value is the
percentage change of corpus perplexity against the plain model on the same windows::

    % change = 100 * (exp(mean NLL_cell - mean NLL_base) - 1)

(mean over every predicted token of every window; negative = recirculation helps). The
schemes are the paper's three most-discussed normalisations (App. B.3, Table B.2):

- ``convex``: ``f(z_s) = ||z_d|| / ||z_s|| z_s``, ``beta = 1 - alpha`` (the paper's default);
- ``beta1``:  the same ``f``, ``beta = 1`` (non-convex; Gemma3 4B/12B's choice);
- ``none``:   ``f = identity``, ``beta = 1 - alpha``.

Every position of every window recirculates (token by token, exact K = 1 method). The
**looping** baseline (``--looping``, :mod:`probekit.mechanisms.looping`) is swept over the same
pairs with ``l2 = s`` and ``l1 = d`` (the block-``l2`` output re-enters block
``l1 + 1``, as the recirculated source re-enters above the destination).

**Batching cells.** A token-by-token run on a 2-core CPU is dominated by per-step
overhead, not by the batch, so several cells share one engine run: batch row ``i``
carries cell ``i``'s configuration (:class:`RowwiseRecirculation`). The second pass
starts above the lowest destination in the batch; rows whose own destination is higher
recompute their unchanged blocks (same input, same cache, hence the same keys/values)
and are mixed when the pass reaches their destination. Cells are sorted by destination
so that little is recomputed. Tests pin each row to a one-cell
:class:`~probekit.mechanisms.recirculation.Recirculation` run.

**Resuming.** The work is cut into units (a cell over a batch of windows) and units
into fixed groups (one engine run each), determined by the configuration alone. Each
finished unit is saved as a run-directory part; a group runs again only if one of its
units is missing, so an interrupted sweep restarts where it stopped and ends with the
same numbers as an uninterrupted one (tests pin it bit for bit).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from probekit.analysis.perplexity import pct_change, perplexity
from probekit.core.engine import Recurrence, Rerun, Step, StepEngine
from probekit.mechanisms.looping import Looping
from probekit.mechanisms.recirculation import Recirculation, mix

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


# ------------------------------------------------------------ the per-row strategy


class RowwiseRecirculation(Recurrence):
    """Recirculation with a different single path per batch row.

    Args:
        rows: per batch row, the :class:`~probekit.mechanisms.recirculation.Recirculation` (one path,
            one iteration) that row runs; every row must share ``ramp``.
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
        rerun(self.lowest + 1, mixer(self.lowest)(captured[self.lowest]), edits=edits)


# ---------------------------------------------------------------- pair lists


def parse_range(spec: str, what: str) -> range:
    """``"a:b"`` / ``"a:b:step"`` (b exclusive) or a single ``"n"``."""
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


def make_pairs(spec: str, n_blocks: int, *, destinations: range | None = None,
               sources: range | None = None, step: int = 1) -> list[tuple[int, int]]:
    """``(source, destination)`` pairs, sorted by destination then source.

    Args:
        spec: ``"all"`` (every ``0 <= d < s <= L-1``), ``"max-gap:N"`` (``s - d <= N``)
            or an explicit list ``"11-4,12-4"`` (``source-destination``).
        destinations, sources: optional filters (ranges of block indices).
        step: a coarser grid for ``all`` / ``max-gap``: destinations ``1, 1+step, ...``
            and gaps ``step, 2 step, ...`` (1 keeps every pair; explicit lists ignore it).
    """
    spec = spec.strip().replace(" ", ":")
    all_pairs = [(s, d) for d in range(n_blocks) for s in range(d + 1, n_blocks)]
    if spec == "all":
        pairs = all_pairs
    elif m := re.fullmatch(r"max-gap:(\d+)", spec):
        gap = int(m.group(1))
        if gap < 1:
            raise ValueError("--pairs max-gap N needs N >= 1")
        pairs = [(s, d) for s, d in all_pairs if s - d <= gap]
    elif re.fullmatch(r"\d+-\d+(,\d+-\d+)*", spec):
        pairs = [tuple(int(x) for x in p.split("-")) for p in spec.split(",")]
        for s, d in pairs:
            if not 0 <= d < s <= n_blocks - 1:
                raise ValueError(f"pair {s}-{d}: need 0 <= destination < source <= "
                                 f"{n_blocks - 1} (write source-destination)")
    else:
        raise ValueError(f"--pairs {spec!r}: expected all, max-gap N, or a list like 11-4,12-4 "
                         f"(source-destination)")
    if step < 1:
        raise ValueError(f"--step must be >= 1; got {step}")
    if step > 1 and not re.fullmatch(r"\d+-\d+(,\d+-\d+)*", spec):
        pairs = [(s, d) for s, d in pairs if d % step == 1 % step and (s - d) % step == 0]
    if destinations is not None:
        pairs = [(s, d) for s, d in pairs if d in destinations]
    if sources is not None:
        pairs = [(s, d) for s, d in pairs if s in sources]
    if not pairs:
        raise ValueError(f"--pairs {spec!r} with --step {step} and the --destinations/--sources "
                         f"filters selects no pair on a model of {n_blocks} blocks")
    return sorted(set(pairs), key=lambda p: (p[1], p[0]))


def make_cells(pairs: Sequence[tuple[int, int]], alphas: Sequence[float],
               schemes: Sequence[str]) -> list[Cell]:
    """Every pair x alpha x scheme, sorted by destination (then source, alpha, scheme)."""
    if not alphas:
        raise ValueError("give at least one alpha (--alphas 0.07,0.1)")
    if not schemes:
        raise ValueError(f"give at least one scheme (--norms {','.join(SCHEMES)})")
    cells = [Cell(s, d, float(a), sc) for s, d in pairs for a in alphas for sc in schemes]
    return sorted(cells, key=lambda c: (c.destination, c.source, c.alpha, c.scheme))


# -------------------------------------------------------------------- running


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
    on_group_done: Callable[[int], None] | None = None,
) -> dict:
    """Compute every cell (and looping pair) on ``windows``, saving parts in ``run``.

    Args:
        windows: ``[n_windows, T]`` token ids.
        run: a :class:`probekit.runs.RunDir`; finished units are parts there.
        batch_size: windows per unit (a cell on one batch of windows is one saved part).
        rows: batch rows per recirculated engine run (units packed together).
        on_group_done: called with the group index after each group is saved.

    Returns:
        ``{"baseline": [n_windows, T-1], cell.key: [...], "loop-...": [...]}`` log-probs.
    """
    n_windows = windows.shape[0]
    for c in cells:
        c.recirculation(ramp).check(engine.n_blocks)
    loops = [Looping(d, s) for s, d in looping_pairs]
    for lo in loops:
        lo.check(engine.n_blocks)
    batches = window_batches(n_windows, batch_size)
    groups = plan_groups(cells, n_windows, batch_size, rows)

    def collect(kind: str) -> np.ndarray:
        return np.concatenate([run.load_part(unit_key(kind, w0))["log_probs"]
                               for w0, _ in batches])

    for w0, w1 in batches:
        if not run.has_part(unit_key("baseline", w0)):
            base = engine.forward(windows[w0:w1]).log_probs
            run.save_part(unit_key("baseline", w0), log_probs=base.numpy())
    out = {"baseline": collect("baseline")}

    total = sum(w1 - w0 for g in groups for _, w0, w1 in g) * windows.shape[1]
    bar = tqdm(total=total, desc="recirculation", unit="tok", disable=not progress)
    for gi, group in enumerate(groups):
        if all(run.has_part(unit_key(c.key, w0)) for c, w0, _ in group):
            bar.update(sum(w1 - w0 for _, w0, w1 in group) * windows.shape[1])
            continue
        ids = torch.cat([windows[w0:w1] for _, w0, w1 in group])
        rec = RowwiseRecirculation([c.recirculation(ramp) for c, w0, w1 in group
                                    for _ in range(w1 - w0)])
        lp = engine.run(ids, rec, progress=progress).log_probs.numpy()
        bar.update(ids.numel())
        r0 = 0
        for c, w0, w1 in group:
            run.save_part(unit_key(c.key, w0), log_probs=lp[r0 : r0 + w1 - w0])
            r0 += w1 - w0
        if on_group_done is not None:
            on_group_done(gi)
    bar.close()
    for c in cells:
        out[c.key] = collect(c.key)

    for lo in tqdm(loops, desc="looping", disable=not progress or not loops):
        kind = loop_key(lo.l2, lo.l1)
        for w0, w1 in batches:
            if not run.has_part(unit_key(kind, w0)):
                lp = lo.run(engine, windows[w0:w1]).log_probs
                run.save_part(unit_key(kind, w0), log_probs=lp.numpy())
        out[kind] = collect(kind)
    return out


def loop_key(source: int, destination: int) -> str:
    """Part/result key of looping with ``l2 = source``, ``l1 = destination``."""
    return f"loop-l1{destination:03d}-l2{source:03d}"


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


def _heatmap(ax, fig, matrix, sources, dests, title, annotate=True):
    from matplotlib.colors import TwoSlopeNorm

    m = np.array([[np.nan if v is None else v for v in row] for row in matrix], dtype=float)
    lim = float(np.nanmax(np.abs(m))) if np.isfinite(m).any() else 1.0
    lim = lim or 1.0
    # Blue = lower perplexity (helps), red = higher, centred at 0 (paper Fig. 5).
    im = ax.imshow(m, origin="lower", cmap="RdBu_r", norm=TwoSlopeNorm(0.0, -lim, lim),
                   aspect="auto")
    ax.set_xticks(range(len(dests)), dests, fontsize=7)
    ax.set_yticks(range(len(sources)), sources, fontsize=7)
    ax.set_xlabel("destination block d")
    ax.set_ylabel("source block s")
    ax.set_title(title, fontsize=9)
    if annotate and m.size <= 400:
        for i in range(m.shape[0]):
            for j in range(m.shape[1]):
                if np.isfinite(m[i, j]):
                    dark = abs(m[i, j]) > 0.6 * lim  # white text on saturated cells
                    ax.text(j, i, f"{m[i, j]:.1f}", ha="center", va="center", fontsize=5,
                            color="white" if dark else "black")
    fig.colorbar(im, ax=ax, label="% perplexity change")


def plot_sweep(summary: dict, title: str):
    """Heatmaps: one per (alpha, scheme), schemes as rows and alphas as columns."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    alphas = sorted({p["alpha"] for p in summary["panels"]})
    schemes = [s for s in SCHEMES if any(p["scheme"] == s for p in summary["panels"])]
    fig, axes = plt.subplots(len(schemes), len(alphas), squeeze=False,
                             figsize=(4.6 * len(alphas), 3.8 * len(schemes)))
    for p in summary["panels"]:
        ax = axes[schemes.index(p["scheme"])][alphas.index(p["alpha"])]
        b = p["best"]
        _heatmap(ax, fig, p["matrix"], summary["sources"], summary["destinations"],
                 f"{p['scheme']}, alpha={p['alpha']:g}: best {b['source']}->{b['destination']} "
                 f"{b['percent_change']:+.2f}%")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_looping(summary: dict, title: str):
    """Paper Fig. 8: the recirculation panel holding the best cell beside looping."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = summary["best"]
    panel = next(p for p in summary["panels"]
                 if p["alpha"] == best["alpha"] and p["scheme"] == best["scheme"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    b = panel["best"]
    _heatmap(axes[0], fig, panel["matrix"], summary["sources"], summary["destinations"],
             f"recirculation ({panel['scheme']}, alpha={panel['alpha']:g}): best "
             f"{b['source']}->{b['destination']} {b['percent_change']:+.2f}%")
    lb = summary["looping"]["best"]
    _heatmap(axes[1], fig, summary["looping"]["matrix"], summary["sources"],
             summary["destinations"],
             f"looping (copy of l1+1..l2 after l2): best l1={lb['l1']}, l2={lb['l2']} "
             f"{lb['percent_change']:+.2f}%")
    axes[1].set_xlabel("l1 (destination role)")
    axes[1].set_ylabel("l2 (source role)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------- CLI


def parse_floats(spec: str, what: str) -> list[float]:
    try:
        vals = [float(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} {spec!r}: expected comma-separated numbers, e.g. 0.04,0.07,0.1") \
            from None
    if not vals:
        raise ValueError(f"{what} {spec!r}: give at least one value")
    return vals


def add_cli(subparsers) -> None:
    from probekit.analysis.perplexity import add_corpus_args
    from probekit.commands.main import add_model_args, add_run_args

    p = subparsers.add_parser(
        "sweep",
        help="perplexity heatmaps over (source, destination) x alpha x normalisation "
             "(paper Fig. 5, B.1), optionally with the looping baseline (Fig. 8)",
        description="Percentage perplexity change against the plain model for every "
                    "(source, destination, alpha, scheme) cell; resumable.",
    )
    p.add_argument("--pairs", nargs="+", default=["max-gap", "12"],
                   help="all | max-gap N | explicit source-destination list 11-4,12-4 "
                        "(default: max-gap 12)")
    p.add_argument("--step", type=int, default=3,
                   help="grid step for all / max-gap: destinations 1, 1+step, ... and gaps "
                        "step, 2 step, ... (default 3: 30 pairs on the 30-block default "
                        "model; 1 = every pair)")
    p.add_argument("--destinations", default=None,
                   help="only these destinations, a:b or a:b:step (b exclusive)")
    p.add_argument("--sources", default=None, help="only these sources, a:b or a:b:step")
    p.add_argument("--alphas", default="0.1", help="comma-separated alphas (default 0.1)")
    p.add_argument("--norms", default="convex",
                   help=f"comma-separated schemes from {','.join(SCHEMES)} (default convex)")
    p.add_argument("--looping", action="store_true",
                   help="also sweep the looping baseline over the same pairs")
    p.add_argument("--ramp", type=int, default=0, help="alpha ramp length (0 = none)")
    p.add_argument("--rows", type=int, default=64,
                   help="batch rows per recirculated run: cells x window batches packed "
                        "together (default 64; more rows amortise per-step overhead)")
    add_corpus_args(p, windows=4, window_tokens=128)
    add_model_args(p)
    add_run_args(p)
    p.set_defaults(func=run_cli)


def run_cli(args) -> int:
    from probekit.analysis.perplexity import corpus_windows_from_args
    from probekit.core.models import load_model
    from probekit.runs import RunDir

    pairs_spec = ":".join(args.pairs)
    alphas = parse_floats(args.alphas, "--alphas")
    schemes = [s.strip() for s in args.norms.split(",") if s.strip()]
    for s in schemes:
        if s not in SCHEMES:
            raise ValueError(f"--norms: unknown scheme {s!r}; choose from {','.join(SCHEMES)}")
    dests = parse_range(args.destinations, "--destinations") if args.destinations else None
    srcs = parse_range(args.sources, "--sources") if args.sources else None
    if args.rows < 1:
        raise ValueError(f"--rows must be >= 1; got {args.rows}")
    if args.ramp < 0:
        raise ValueError(f"--ramp must be >= 0; got {args.ramp}")
    for a in alphas:
        if not 0 <= a <= 1:
            raise ValueError(f"--alphas: alpha must lie in [0, 1]; got {a}")

    model = load_model(args.model)
    pairs = make_pairs(pairs_spec, model.n_blocks, destinations=dests, sources=srcs,
                       step=args.step)
    cells = make_cells(pairs, alphas, schemes)
    windows = torch.tensor([w.input_ids for w in corpus_windows_from_args(args, model)])
    config = {
        "model": args.model, "model_hash": model.content_hash, "backend": args.backend,
        "pairs": pairs, "alphas": alphas, "schemes": schemes, "looping": args.looping,
        "ramp": args.ramp, "batch_size": args.batch_size, "rows": args.rows,
        "corpus": args.corpus,
        "text_file": args.text_file, "windows": args.windows,
        "window_tokens": args.window_tokens,
    }
    run = RunDir.open("sweep", config, model=model, path=args.run_dir, fresh=args.fresh)
    engine = StepEngine(model, backend=args.backend)
    print(f"sweep: {len(cells)} cells ({len(pairs)} pairs x {len(alphas)} alphas x "
          f"{len(schemes)} schemes){' + looping' if args.looping else ''} on "
          f"{len(windows)} windows x {args.window_tokens} tokens; run dir {run.path}")
    loop_pairs = pairs if args.looping else ()
    results = run_sweep(engine, windows, cells, run, looping_pairs=loop_pairs, ramp=args.ramp,
                        batch_size=args.batch_size, rows=args.rows,
                        progress=not args.no_progress)
    summary = summarize_sweep(results, cells, loop_pairs)
    summary["config"] = config
    run.write_json("summary.json", summary)
    sizes = (f"{model.name}, {len(windows)} windows x {args.window_tokens} tokens of "
             f"{args.corpus if args.text_file is None else args.text_file}, "
             f"baseline ppl {summary['baseline_perplexity']:.2f}")
    run.save_figure(plot_sweep(summary, f"Recirculation sweep: {sizes}"), "sweep.png")
    if args.looping:
        run.save_figure(plot_looping(summary, f"Recirculation vs looping: {sizes}"),
                        "looping.png")
    b = summary["best"]
    print(f"baseline perplexity {summary['baseline_perplexity']:.3f} over {summary['n_tokens']} "
          f"tokens; best cell s={b['source']} d={b['destination']} alpha={b['alpha']:g} "
          f"{b['scheme']}: {b['percent_change']:+.3f}% (per window: "
          f"{', '.join(f'{v:+.2f}%' for v in b['per_window'])})")
    if args.looping:
        lb = summary["looping"]["best"]
        print(f"best looping l1={lb['l1']} l2={lb['l2']}: {lb['percent_change']:+.3f}% (per "
              f"window: {', '.join(f'{v:+.2f}%' for v in lb['per_window'])})")
    print(f"wrote {run.path / 'summary.json'}, sweep.png{', looping.png' if args.looping else ''}")
    return 0
