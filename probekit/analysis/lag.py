"""Lag benefit: how far ahead does recirculating one token help? (`probekit lag-analysis`)

    probekit lag-analysis --source 11 --destination 4 --alpha 0.1 --max-lag 32

Implements ``papers/recirculation.md`` Sec. 4.4.4 (Fig. 9a,b and its last paragraph)
as ``SEMANTICS.md`` "Lag benefit" pins it.

**Single-token benefit.** Recirculate *only* position ``t`` of a window ``x``. The
benefit at lag ``k`` is the change in the log-likelihood of the token that the
prediction at ``t + k`` scores::

    B(t, k) = log p_rec(x[t+k+1] | prediction at t+k) - log p_base(x[t+k+1] | prediction at t+k)

``B(t, 0) = 0`` exactly: the readout at ``t`` comes from the first pass, which cannot
see ``t``'s own recirculation (SEMANTICS.md, "Recirculation"). The lag-0 entry is
*computed*, not filled in (see below), and :func:`single_token_benefit` raises if it
is not exactly zero, so a broken readout rule cannot go unnoticed.

**Exact fast path.** Positions ``< t`` are untouched by recirculating ``t``, so the
baseline KV cache up to ``t`` is reused; one recirculated step at ``t`` replaces
``t``'s keys/values in blocks ``d+1 .. L-1``; then positions ``t+1 .. t+K+1`` are
scored by ONE parallel forward on that cache (engine chunks ``[1, K+1]``). Windows are
batched (every row shares ``t``). Cost per ``t``: two one-token steps and a
``K+1``-token forward, instead of a ``T``-token sequential run. Lag 0 compares the
recirculated run's readout at ``t`` with a plain one-token step on an identical copy
of the cache: the same operations on the same numbers, hence bitwise equal when the
readout rule holds. Lags ``>= 1`` are compared with the parallel baseline forward
(the same maths in a different float32 order: ~1e-5 per token on SmolLM2-135M,
zero-mean, negligible after averaging). :func:`single_token_benefit_slow` is the
definition itself (a full sequential run with a one-hot mask per ``t``, against a
sequential plain run); tests pin fast == slow within 1e-5 on tiny models (observed
<= 2e-6) and within 5e-5 on SmolLM2-135M (observed 1.2e-5; 2.5e-5 at T = 256, K = 64).

**Complementary benefit** (Sec. 4.4.4, last paragraph: "recirculated all-but-one
token"). Recirculate every position *except* ``t``; the complementary benefit is what
recirculating ``t`` adds when everything else recirculates::

    C(t, k) = log p_all(x[t+k+1] | t+k) - log p_all-but-t(x[t+k+1] | t+k)

If single-token benefits add up in log-likelihood (the paper's reading), ``C ~ B``.
``C(t, 0) = 0`` exactly, as above. Fast path: one token-by-token run with every
position recirculating (kept with its cache) per window batch; for each ``t`` the
all-recirculated cache up to ``t`` is reused and positions ``t .. t+K+1`` are re-run
token by token (they all recirculate, so this part cannot be parallel), the last two
in one chunk (neither one's recirculation can reach a scored prediction). About
``K + 1`` steps per ``t``: slow, so keep its sizes small.

**Power law.** The mean benefit over windows and ``t`` per lag ``k >= 1`` is fitted as
``a * k^-b`` by least squares on ``log(mean) = log(a) - b log(k)``. Only lags with a
strictly positive mean enter the fit (a log needs it); the number left out is reported
with the fit, and ``R^2`` is computed in log space over the fitted lags.

**Means over t.** A position grid may be sparse and uneven (``--positions
0:20,20:190:5``); each sampled ``t`` is weighted by the positions it stands for
(:func:`position_weights`), so the curve estimates the plain mean over every ``t`` in the
range, as the paper's is. The summary carries an approximate standard error per lag
(treating (window, t) samples as independent) and counts the lags more than two standard
errors from zero: on a small sample the curve is mostly noise, and the figure shows it.

**Early positions.** The paper found recirculating the first ~10 tokens harmful on
Gemma3 1B (but not on 4B/12B); the summary reports the mean benefit over lags for
``t < 10`` and ``t >= 10`` separately, and the figure shades ``t < 10``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from probekit.core.engine import RunResult, StepEngine
from probekit.mechanisms.recirculation import Recirculation

EARLY_POSITIONS = 10  # the paper's "roughly t < 10" (Sec. 4.4.4)


# ----------------------------------------------------------------- validation


def check_lag_inputs(input_ids: Tensor, positions: Sequence[int], max_lag: int) -> Tensor:
    """Validate and return ``input_ids`` as a ``[windows, T]`` long tensor."""
    if not isinstance(input_ids, Tensor):
        lengths = {len(r) for r in input_ids}
        if len(lengths) != 1:
            raise ValueError(
                f"lag analysis needs windows of one length; got lengths {sorted(lengths)}")
        input_ids = torch.tensor([list(r) for r in input_ids], dtype=torch.long)
    if input_ids.ndim == 1:
        input_ids = input_ids[None]
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [windows, T]; got shape {tuple(input_ids.shape)}")
    if not isinstance(max_lag, int) or isinstance(max_lag, bool) or max_lag < 1:
        raise ValueError(f"max_lag must be an integer >= 1; got {max_lag!r}")
    if len(positions) == 0:
        raise ValueError("no positions to recirculate: give at least one (--positions a:b)")
    T = input_ids.shape[1]
    last = T - max_lag - 2  # t + K must still have a next token: t + K + 1 <= T - 1
    if last < 0:
        raise ValueError(
            f"windows of {T} tokens leave no room for lag {max_lag}: need T >= max_lag + 2; "
            f"lower --max-lag or raise --window-tokens"
        )
    for t in positions:
        if not isinstance(t, int | np.integer) or not 0 <= t <= last:
            raise ValueError(
                f"position {t} is out of range: with {T}-token windows and --max-lag "
                f"{max_lag}, recirculated positions must lie in 0..{last} (t + max_lag + 1 "
                f"must be a token of the window)"
            )
    return input_ids.long()


def parse_positions(spec: str | None, window_tokens: int, max_lag: int) -> list[int]:
    """Comma-separated ``"a:b"`` / ``"a:b:step"`` ranges (Python ranges, ``b`` exclusive,
    empty ends allowed) or single positions -> sorted unique positions, e.g.
    ``"0:20,20:190:5"`` (every early position, then every fifth). ``None`` means every
    position with a full lag range: ``0 .. T-K-2``."""
    last = window_tokens - max_lag - 2
    if spec is None or spec.strip() == "":
        return list(range(max(last + 1, 0)))
    out: set[int] = set()
    for item in spec.split(","):
        parts = item.strip().split(":")
        try:
            if len(parts) == 1:
                out.add(int(parts[0]))
                continue
            if len(parts) not in (2, 3):
                raise ValueError
            a = int(parts[0]) if parts[0] else 0
            b = int(parts[1]) if parts[1] else last + 1
            step = int(parts[2]) if len(parts) == 3 and parts[2] else 1
        except ValueError:
            raise ValueError(
                f"--positions {spec!r}: expected ranges 'a:b' or 'a:b:step' (b exclusive), "
                f"comma-separated, e.g. 0:96 or 0:20,20:190:5"
            ) from None
        if step < 1:
            raise ValueError(f"--positions {spec!r}: step must be >= 1")
        out.update(range(a, b, step))
    if not out:
        raise ValueError(f"--positions {spec!r} selects no position")
    return sorted(out)


def _require_recirculation(recirculation) -> None:
    if not isinstance(recirculation, Recirculation):
        raise TypeError(
            "lag analysis needs a Recirculation (a recurrence that acts only after the first "
            f"pass, through the position mask); got {type(recirculation).__name__}"
        )


# ------------------------------------------------------------ single token


@torch.no_grad()
def single_token_benefit(
    engine: StepEngine,
    input_ids: Tensor,
    recirculation: Recirculation,
    positions: Sequence[int],
    max_lag: int,
    *,
    baseline: RunResult | None = None,
    progress: bool = False,
) -> Tensor:
    """``[windows, len(positions), max_lag + 1]`` benefit ``B(t, k)``, by the exact fast path.

    Args:
        input_ids: ``[windows, T]`` equal-length windows (recirculated together).
        positions: the positions ``t`` recirculated, one at a time.
        max_lag: ``K``; lags ``0 .. K`` are returned (``t + K + 1 <= T - 1``).
        baseline: ``engine.forward(input_ids, return_cache=True)`` if already computed.
    """
    _require_recirculation(recirculation)
    ids = check_lag_inputs(input_ids, positions, max_lag)
    recirculation.check(engine.n_blocks)
    K = max_lag
    if baseline is None:
        baseline = engine.forward(ids, return_cache=True)
    if baseline.cache is None or baseline.log_probs.shape != (ids.shape[0], ids.shape[1] - 1):
        raise ValueError(
            "baseline must be engine.forward(input_ids, return_cache=True) of these ids")
    out = torch.empty(ids.shape[0], len(positions), K + 1)
    for i, t in enumerate(tqdm(positions, desc="positions", disable=not progress, leave=False)):
        t = int(t)
        seq = t + K + 2
        onehot = torch.zeros(seq, dtype=torch.bool)
        onehot[t] = True
        rec = engine.run(ids[:, :seq], recirculation, mask=onehot, start=t,
                         cache=baseline.cache.copy(length=t), block_size=[1, K + 1])
        # The plain step at t on an identical cache: lag 0's comparison, same float ops.
        plain = engine.run(ids[:, : t + 2], None, start=t,
                           cache=baseline.cache.copy(length=t), block_size=[1, 1])
        out[:, i, 0] = rec.log_probs[:, t] - plain.log_probs[:, t]
        later = slice(t + 1, t + K + 1)
        out[:, i, 1:] = rec.log_probs[:, later] - baseline.log_probs[:, later]
    _check_lag_zero(out, "single-token")
    return out


@torch.no_grad()
def single_token_benefit_slow(
    engine: StepEngine,
    input_ids: Tensor,
    recirculation: Recirculation,
    positions: Sequence[int],
    max_lag: int,
) -> Tensor:
    """The definition: per ``t``, a full token-by-token run with only ``t`` recirculating,
    against a token-by-token plain run. Same shape as :func:`single_token_benefit`."""
    _require_recirculation(recirculation)
    ids = check_lag_inputs(input_ids, positions, max_lag)
    T = ids.shape[1]
    base = engine.run(ids, None).log_probs
    out = torch.empty(ids.shape[0], len(positions), max_lag + 1)
    for i, t in enumerate(positions):
        onehot = torch.zeros(T, dtype=torch.bool)
        onehot[t] = True
        rec = engine.run(ids, recirculation, mask=onehot).log_probs
        out[:, i] = rec[:, t : t + max_lag + 1] - base[:, t : t + max_lag + 1]
    return out


# -------------------------------------------------------------- complement


@torch.no_grad()
def all_positions_run(engine: StepEngine, input_ids: Tensor, recirculation: Recirculation,
                      *, progress: bool = False) -> RunResult:
    """Token-by-token run with every position recirculating, keeping its KV cache."""
    return engine.run(input_ids, recirculation, return_cache=True, progress=progress)


@torch.no_grad()
def complement_benefit(
    engine: StepEngine,
    input_ids: Tensor,
    recirculation: Recirculation,
    positions: Sequence[int],
    max_lag: int,
    *,
    all_run: RunResult | None = None,
    progress: bool = False,
) -> Tensor:
    """``[windows, len(positions), max_lag + 1]`` complementary benefit ``C(t, k)`` (exact).

    ``all_run``: :func:`all_positions_run` of these ids, if already computed.
    """
    _require_recirculation(recirculation)
    ids = check_lag_inputs(input_ids, positions, max_lag)
    recirculation.check(engine.n_blocks)
    K = max_lag
    if all_run is None:
        all_run = all_positions_run(engine, ids, recirculation, progress=progress)
    if all_run.cache is None:
        raise ValueError("all_run must keep its cache: all_positions_run(...) or return_cache=True")
    out = torch.empty(ids.shape[0], len(positions), K + 1)
    for i, t in enumerate(tqdm(positions, desc="positions", disable=not progress, leave=False)):
        t = int(t)
        seq = t + K + 2
        mask = torch.ones(seq, dtype=torch.bool)
        mask[t] = False
        # t+K and t+K+1 go in one chunk: the prediction at t+K is their last scored one,
        # and recirculating either of them could only reach later predictions.
        mask[t + K:] = False
        rest = engine.run(ids[:, :seq], recirculation, mask=mask, start=t,
                          cache=all_run.cache.copy(length=t), block_size=[1] * K + [2])
        out[:, i] = all_run.log_probs[:, t : t + K + 1] - rest.log_probs[:, t : t + K + 1]
    _check_lag_zero(out, "complementary")
    return out


@torch.no_grad()
def complement_benefit_slow(
    engine: StepEngine,
    input_ids: Tensor,
    recirculation: Recirculation,
    positions: Sequence[int],
    max_lag: int,
) -> Tensor:
    """The definition: a full run recirculating everything against, per ``t``, a full run
    recirculating everything but ``t``."""
    _require_recirculation(recirculation)
    ids = check_lag_inputs(input_ids, positions, max_lag)
    T = ids.shape[1]
    full = engine.run(ids, recirculation).log_probs
    out = torch.empty(ids.shape[0], len(positions), max_lag + 1)
    for i, t in enumerate(positions):
        mask = torch.ones(T, dtype=torch.bool)
        mask[t] = False
        rest = engine.run(ids, recirculation, mask=mask).log_probs
        out[:, i] = full[:, t : t + max_lag + 1] - rest[:, t : t + max_lag + 1]
    return out


def _check_lag_zero(benefit: Tensor, what: str) -> None:
    if not bool((benefit[..., 0] == 0).all()):
        worst = benefit[..., 0].abs().max().item()
        raise RuntimeError(
            f"{what} lag-0 benefit is not exactly zero (max |B(t,0)| = {worst:.3g}): the "
            f"readout at t changed when t recirculated, which breaks SEMANTICS.md's readout rule"
        )


# --------------------------------------------------------------- summaries


@dataclass(frozen=True)
class PowerLawFit:
    """``benefit ~ a * k^-b``, fitted in log-log space.

    Attributes:
        a, b: the fitted amplitude and decay exponent (NaN if fewer than 2 lags fit).
        r2: coefficient of determination of the log-log regression.
        n_fit: lags used (mean benefit > 0); n_excluded: lags left out (mean <= 0).
    """

    a: float
    b: float
    r2: float
    n_fit: int
    n_excluded: int

    def to_dict(self) -> dict:
        return asdict(self)


def fit_power_law(lags: np.ndarray, values: np.ndarray) -> PowerLawFit:
    """Least squares of ``log(values) = log(a) - b log(lags)`` over strictly positive values."""
    lags = np.asarray(lags, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    if lags.shape != values.shape or lags.ndim != 1:
        raise ValueError("lags and values must be 1-D arrays of the same length")
    if np.any(lags <= 0):
        raise ValueError("lags must be >= 1 (log k is undefined at k = 0)")
    keep = np.isfinite(values) & (values > 0)
    n_fit, n_excluded = int(keep.sum()), int((~keep).sum())
    if n_fit < 2:
        return PowerLawFit(math.nan, math.nan, math.nan, n_fit, n_excluded)
    x, y = np.log(lags[keep]), np.log(values[keep])
    slope, intercept = np.polyfit(x, y, 1)
    resid = y - (intercept + slope * x)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((resid**2).sum()) / ss_tot if ss_tot > 0 else 1.0
    return PowerLawFit(float(math.exp(intercept)), float(-slope), r2, n_fit, n_excluded)


def position_weights(positions: Sequence[int]) -> np.ndarray:
    """How many positions each sampled ``t`` stands for, so that a weighted mean over a
    sparse grid (e.g. ``0:20,20:190:5``) estimates the plain mean over every ``t`` of the
    range: half the distance between its neighbours (the adjacent gap at either end);
    equal weights on an evenly spaced grid."""
    p = np.asarray(positions, dtype=np.float64)
    if p.size == 1:
        return np.ones(1)
    if np.any(np.diff(p) <= 0):
        raise ValueError("positions must be strictly increasing")
    w = np.empty_like(p)
    w[1:-1] = (p[2:] - p[:-2]) / 2
    w[0], w[-1] = p[1] - p[0], p[-1] - p[-2]
    return w


def summarize(benefit: np.ndarray, positions: Sequence[int]) -> dict:
    """Mean curve over lags, the ``(t, k)`` map, its power-law fit and the early-position effect.

    The mean over ``t`` weights each sampled position by :func:`position_weights`, so a
    grid that samples early positions densely does not over-weight them (the paper's
    curve is a plain mean over every ``t``).

    Args:
        benefit: ``[windows, positions, K+1]``; ``positions`` strictly increasing.
    """
    benefit = np.asarray(benefit, dtype=np.float64)
    positions = np.asarray(positions)
    K = benefit.shape[2] - 1
    lags = np.arange(1, K + 1)
    weights = position_weights(positions)
    by_t = benefit.mean(axis=0)  # [positions, K+1]
    curve = weights @ by_t / weights.sum()  # [K+1]
    per_t = by_t[:, 1:].mean(axis=1)  # mean over lags 1..K, per t
    early = positions < EARLY_POSITIONS

    def wmean(sel):
        return float(weights[sel] @ per_t[sel] / weights[sel].sum()) if sel.any() else None

    # Approximate standard error of the weighted mean, treating the (window, t) samples
    # as independent (neighbouring t of one window are correlated: it is a lower bound).
    omega = weights / weights.sum()
    sd = benefit.reshape(-1, K + 1).std(axis=0, ddof=1) if benefit[..., 0].size > 1 else \
        np.full(K + 1, np.nan)
    se = sd * np.sqrt((omega**2).sum() / benefit.shape[0])
    fit = fit_power_law(lags, curve[1:])
    return {
        "lags": np.arange(K + 1),
        "positions": positions,
        "position_weights": weights,
        "mean_curve": curve,
        "stderr": se,
        # lags whose mean is more than two standard errors from zero, by sign
        "n_lags_above_2se": int((curve[1:] > 2 * se[1:]).sum()),
        "n_lags_below_2se": int((curve[1:] < -2 * se[1:]).sum()),
        "heatmap": by_t,
        "per_position": per_t,
        "fit": fit.to_dict(),
        "lag0_max_abs": float(np.abs(benefit[..., 0]).max()),
        "early": {
            "threshold": EARLY_POSITIONS,
            "mean_early": wmean(early),
            "mean_late": wmean(~early),
            "n_early": int(early.sum()),
            "n_late": int((~early).sum()),
        },
        "n_windows": int(benefit.shape[0]),
    }


def plot_lag_analysis(single: dict, complement: dict | None, title: str):
    """Paper Fig. 9a,b: (a) the lag curve on log axes with its power-law fit, (b) the same
    curve with +-2 standard errors on a linear scale (what a log axis cannot show: the
    sign and the noise), (c) the ``(t, k)`` map, (d) the per-position effect with
    ``t < 10`` shaded. The complementary curve is drawn beside the single-token one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    curves = [(r, n, c) for r, n, c in ((single, "single token t", "C0"),
                                        (complement, "all but t (complement)", "C3"))
              if r is not None]
    lags = np.asarray(single["lags"])[1:]

    ax = axes[0, 0]
    for res, name, color in curves:
        curve = np.asarray(res["mean_curve"])[1:]
        pos = curve > 0
        ax.plot(lags[pos], curve[pos], "o", ms=3, color=color, label=f"{name}: mean > 0")
        if (~pos).any():
            ax.plot(lags[~pos], -curve[~pos], "x", ms=4, color=color, alpha=0.6,
                    label=f"{name}: -mean where mean <= 0 ({int((~pos).sum())} lags)")
        fit = res["fit"]
        if math.isfinite(fit["b"]):
            ax.plot(lags, fit["a"] * lags ** -fit["b"], "-", color=color, lw=1,
                    label=f"fit a k^-b on mean > 0: b={fit['b']:.2f}, R²={fit['r2']:.2f}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("lag k")
    ax.set_ylabel("mean Δ log p (nats)")
    ax.set_title("(a) mean benefit over lag, log axes")
    ax.legend(fontsize=7)

    ax = axes[0, 1]
    ax.axhline(0, color="k", lw=0.6)
    for res, name, color in curves:
        curve = np.asarray(res["mean_curve"])[1:]
        se = np.asarray(res["stderr"])[1:]
        ax.fill_between(lags, curve - 2 * se, curve + 2 * se, color=color, alpha=0.2, lw=0)
        ax.plot(lags, curve, ".-", ms=3, color=color, label=f"{name} (±2 s.e.)")
    ax.set_xscale("log")
    ax.set_xlabel("lag k")
    ax.set_ylabel("mean Δ log p (nats)")
    ax.set_title("(b) the same, linear scale, with its noise")
    ax.legend(fontsize=7)

    ax = axes[1, 0]
    heat = np.asarray(single["heatmap"])[:, 1:].T  # [K, positions]
    lim = float(np.nanmax(np.abs(heat))) or 1.0
    # pcolormesh: sampled positions may be unevenly spaced (e.g. dense early positions).
    im = ax.pcolormesh(np.asarray(single["positions"]), lags, heat, shading="nearest",
                       cmap="RdBu", norm=TwoSlopeNorm(0.0, -lim, lim))
    fig.colorbar(im, ax=ax, label="mean Δ log p (blue = benefit)")
    ax.set_xlabel("recirculated position t")
    ax.set_ylabel("lag k")
    ax.set_title("(c) single-token benefit at (t, k)")

    ax = axes[1, 1]
    ax.axvspan(-0.5, EARLY_POSITIONS - 0.5, color="0.85", label=f"t < {EARLY_POSITIONS}")
    ax.axhline(0, color="k", lw=0.6)
    for res, name, color in curves:
        ax.plot(res["positions"], res["per_position"], ".-", ms=3, color=color, label=name)
    ax.set_xlabel("recirculated position t")
    ax.set_ylabel("mean Δ log p over lags 1..K")
    ax.set_title("(d) early-position effect")
    ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------- CLI


def add_cli(subparsers) -> None:
    from probekit.analysis.perplexity import add_corpus_args, add_recirculation_args
    from probekit.commands.main import add_model_args, add_run_args

    p = subparsers.add_parser(
        "lag-analysis",
        help="benefit of recirculating one token at lag k (paper Sec. 4.4.4, Fig. 9a,b)",
        description="Recirculate one position t at a time and measure the change in "
                    "log-likelihood of the predictions at t+k, k = 0..K, by the exact fast "
                    "path; mean curve, (t, k) heatmap, power-law fit, early-position effect, "
                    "and optionally the all-but-one complement.",
    )
    add_recirculation_args(p)
    p.add_argument("--positions", default=None,
                   help="recirculated positions: comma-separated a:b or a:b:step ranges (b "
                        "exclusive), e.g. 0:20,20:190:5 (default: every t with a full lag "
                        "range, 0 .. T-K-2)")
    p.add_argument("--max-lag", type=int, default=32, help="largest lag K (default 32)")
    p.add_argument("--complement", action="store_true",
                   help="also run the all-but-one complement (slow: ~K+1 steps per t)")
    p.add_argument("--complement-positions", default=None,
                   help="positions for --complement (default: those of --positions)")
    add_corpus_args(p, windows=4, window_tokens=128)
    add_model_args(p)
    add_run_args(p)
    p.set_defaults(func=run_cli)


def run_cli(args) -> int:
    from probekit.analysis.perplexity import corpus_windows_from_args, recirculation_from_args
    from probekit.core.models import load_model
    from probekit.runs import RunDir

    # Validate every flag before loading anything.
    rec = recirculation_from_args(args)
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1; got {args.batch_size}")
    if args.max_lag < 1:
        raise ValueError(f"--max-lag must be >= 1; got {args.max_lag}")
    positions = parse_positions(args.positions, args.window_tokens, args.max_lag)
    comp_positions = (parse_positions(args.complement_positions, args.window_tokens, args.max_lag)
                      if args.complement_positions else positions)
    check_lag_inputs(torch.zeros(1, args.window_tokens, dtype=torch.long), positions, args.max_lag)
    check_lag_inputs(torch.zeros(1, args.window_tokens, dtype=torch.long), comp_positions,
                     args.max_lag)

    model = load_model(args.model)
    rec.check(model.n_blocks)
    ids = torch.tensor([w.input_ids for w in corpus_windows_from_args(args, model)])
    config = {
        "model": args.model, "model_hash": model.content_hash, "backend": args.backend,
        "recirculation": repr(rec), "positions": positions, "max_lag": args.max_lag,
        "complement": args.complement,
        "complement_positions": comp_positions if args.complement else None,
        "corpus": args.corpus, "text_file": args.text_file, "windows": args.windows,
        "window_tokens": args.window_tokens, "batch_size": args.batch_size,
    }
    run = RunDir.open("lag-analysis", config, model=model, path=args.run_dir, fresh=args.fresh)
    engine = StepEngine(model, backend=args.backend)
    show = not args.no_progress
    batches = [(w0, ids[w0 : w0 + args.batch_size]) for w0 in range(0, len(ids), args.batch_size)]

    single = _run_parts(run, "single", batches, positions, show, lambda batch, t, state: (
        single_token_benefit(engine, batch, rec, [t], args.max_lag, baseline=state)[:, 0]),
        lambda batch: engine.forward(batch, return_cache=True))
    summary = {"config": config, "single": summarize(single, positions)}
    comp_summary = None
    if args.complement:
        comp = _run_parts(run, "complement", batches, comp_positions, show,
                          lambda batch, t, state: complement_benefit(
                              engine, batch, rec, [t], args.max_lag, all_run=state)[:, 0],
                          lambda batch: all_positions_run(engine, batch, rec, progress=show))
        comp_summary = summarize(comp, comp_positions)
        summary["complement"] = comp_summary
        common = sorted(set(positions) & set(comp_positions))
        if common:
            si = [positions.index(t) for t in common]
            ci = [comp_positions.index(t) for t in common]
            a, b = single[:, si, 1:].ravel(), comp[:, ci, 1:].ravel()
            summary["single_vs_complement"] = {
                "positions": common,
                "correlation": float(np.corrcoef(a, b)[0, 1]),
                "mean_single": float(a.mean()),
                "mean_complement": float(b.mean()),
            }
    run.write_json("summary.json", summary)
    title = (f"{model.name}: lag benefit, {rec!r}; {len(ids)} windows x {args.window_tokens} "
             f"tokens ({args.corpus if args.text_file is None else args.text_file}), "
             f"t in {positions[0]}..{positions[-1]}, K={args.max_lag}")
    fig = plot_lag_analysis(summary["single"], comp_summary, title)
    out = run.save_figure(fig, "lag_analysis.png")
    fit = summary["single"]["fit"]
    early = summary["single"]["early"]
    single_s = summary["single"]
    print(f"lag curve: mean benefit at k=1 {single_s['mean_curve'][1]:+.5f} "
          f"(s.e. {single_s['stderr'][1]:.5f}) nats, at k={args.max_lag} "
          f"{single_s['mean_curve'][-1]:+.5f}; {single_s['n_lags_above_2se']} of {args.max_lag} "
          f"lags above +2 s.e., {single_s['n_lags_below_2se']} below -2 s.e.; power law "
          f"b={fit['b']:.3f} R^2={fit['r2']:.3f} ({fit['n_excluded']} non-positive lags left out)")
    if early["mean_early"] is not None:
        print(f"early positions t<{early['threshold']}: mean {early['mean_early']:+.5f}; "
              f"t>={early['threshold']}: {early['mean_late']:+.5f}")
    if "single_vs_complement" in summary:
        c = summary["single_vs_complement"]
        print(f"complement: mean {c['mean_complement']:+.5f} vs single {c['mean_single']:+.5f}, "
              f"correlation {c['correlation']:.3f}")
    print(f"wrote {run.path / 'summary.json'} and {out}")
    return 0


def _run_parts(run, kind, batches, positions, show, compute, prepare) -> np.ndarray:
    """Compute ``[windows, positions, K+1]``, one saved part per (window batch, t); parts
    already on disk are loaded, so an interrupted run resumes where it stopped."""
    rows = []
    bar = tqdm(total=len(batches) * len(positions), desc=kind, unit="t", disable=not show)
    for w0, batch in batches:
        keys = [f"{kind}-w{w0:05d}-t{t:05d}" for t in positions]
        state = None
        per_t = []
        for t, key in zip(positions, keys, strict=True):
            if not run.has_part(key):
                if state is None:
                    state = prepare(batch)
                run.save_part(key, benefit=compute(batch, t, state).numpy())
            per_t.append(run.load_part(key)["benefit"])
            bar.update()
        rows.append(np.stack(per_t, axis=1))
    bar.close()
    return np.concatenate(rows, axis=0)
