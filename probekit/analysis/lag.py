"""Lag benefit: how far ahead does recirculating one token help?

Implements ``papers/recirculation.md`` Sec. 4.4.4 (Fig. 9a,b and its last paragraph)
as ``SEMANTICS.md`` "Lag benefit" pins it. The command is ``probekit lag-analysis``
(:mod:`probekit.commands.lag_analysis`); the means, the power-law fit and the
early-position effect are :mod:`probekit.analysis.lag_summary`.

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
readout rule holds. Lags ``>= 1`` are compared with the parallel baseline forward:
the same maths in a different float32 summation order, so fast and slow agree to
float32 rounding, not bitwise (tolerances and measurements: docs/recirculation-analysis.md).
:func:`benefit_slow` is the definition itself (a full sequential run with
a one-hot mask per ``t``, against a sequential plain run); tests pin fast == slow.

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
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from probekit.core.engine import RunResult, StepEngine
from probekit.mechanisms.recirculation import Recirculation

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
    check_positions(positions, input_ids.shape[1], max_lag)
    return input_ids.long()


def check_positions(positions: Sequence[int], window_tokens: int, max_lag: int, *,
                    flag: str = "--positions") -> None:
    """Every ``t`` must leave a full lag range in a ``window_tokens``-token window:
    ``t + max_lag + 1 <= T - 1`` (the prediction at ``t + K`` scores token ``t + K + 1``)."""
    if not isinstance(max_lag, int) or isinstance(max_lag, bool) or max_lag < 1:
        raise ValueError(f"max_lag must be an integer >= 1; got {max_lag!r}")
    T = window_tokens
    last = T - max_lag - 2
    if last < 0:
        raise ValueError(
            f"windows of {T} tokens leave no room for lag {max_lag}: need T >= max_lag + 2; "
            f"lower --max-lag or raise --window-tokens"
        )
    if len(positions) == 0:
        raise ValueError(f"no positions to recirculate: give at least one ({flag} a:b)")
    for t in positions:
        if not isinstance(t, int | np.integer) or not 0 <= t <= last:
            raise ValueError(
                f"{flag}: position {t} is out of range: with {T}-token windows and --max-lag "
                f"{max_lag}, recirculated positions must lie in 0..{last} (t + max_lag + 1 "
                f"must be a token of the window)"
            )


def parse_positions(spec: str | Sequence[str] | None, window_tokens: int, max_lag: int, *,
                    flag: str = "--positions") -> list[int]:
    """``"a:b"`` / ``"a:b:step"`` ranges (Python ranges, ``b`` exclusive, empty ends
    allowed) or single positions, as a sequence of such items and/or comma-separated in
    one string -> sorted unique positions, e.g. ``"0:20,20:190:5"`` or ``["0:20",
    "20:190:5"]`` (every early position, then every fifth). ``None`` or empty means every
    position with a full lag range: ``0 .. T-K-2``. ``flag`` names the option in errors."""
    last = window_tokens - max_lag - 2
    items = [spec] if spec is None or isinstance(spec, str) else list(spec)
    items = [i.strip() for s in items if s is not None for i in s.split(",") if i.strip()]
    if not items:
        return list(range(max(last + 1, 0)))
    shown = ",".join(items) if not isinstance(spec, str) else spec
    out: set[int] = set()
    for item in items:
        parts = item.split(":")
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
                f"{flag} {shown!r}: expected ranges 'a:b' or 'a:b:step' (b exclusive), "
                f"e.g. 0:96 or 0:20 20:190:5"
            ) from None
        if step < 1:
            raise ValueError(f"{flag} {shown!r}: step must be >= 1")
        out.update(range(a, b, step))
    if not out:
        raise ValueError(f"{flag} {shown!r} selects no position")
    return sorted(out)


def _checked(engine: StepEngine, recirculation, input_ids: Tensor, positions: Sequence[int],
             max_lag: int) -> Tensor:
    """The ids of a lag computation, after every check (before any state is made)."""
    if not isinstance(recirculation, Recirculation):
        raise TypeError(
            "lag analysis needs a Recirculation (a recurrence that acts only after the first "
            f"pass, through the position mask); got {type(recirculation).__name__}"
        )
    ids = check_lag_inputs(input_ids, positions, max_lag)
    recirculation.check(engine.n_blocks)
    return ids


# ------------------------------------------------------------ single token


@torch.no_grad()
def single_token_benefit(engine: StepEngine, input_ids: Tensor, recirculation: Recirculation,
                         positions: Sequence[int], max_lag: int, *,
                         baseline: RunResult | None = None, progress: bool = False) -> Tensor:
    """``[windows, len(positions), max_lag + 1]`` benefit ``B(t, k)``, by the exact fast path.

    Args:
        input_ids: ``[windows, T]`` equal-length windows (recirculated together).
        positions: the positions ``t`` recirculated, one at a time.
        max_lag: ``K``; lags ``0 .. K`` are returned (``t + K + 1 <= T - 1``).
        baseline: ``engine.forward(input_ids, return_cache=True)`` if already computed.
    """
    ids = _checked(engine, recirculation, input_ids, positions, max_lag)
    K = max_lag
    if baseline is None:
        baseline = engine.forward(ids, return_cache=True)
    if baseline.cache is None or baseline.log_probs.shape != (ids.shape[0], ids.shape[1] - 1):
        raise ValueError(
            "baseline must be engine.forward(input_ids, return_cache=True) of these ids")
    out = torch.empty(ids.shape[0], len(positions), K + 1)
    for i, t, seq, onehot in _masks(positions, K, complement=False, progress=progress):
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
def benefit_slow(engine: StepEngine, input_ids: Tensor, recirculation: Recirculation,
                 positions: Sequence[int], max_lag: int, *, complement: bool = False) -> Tensor:
    """The definitions, by full token-by-token runs per ``t`` (shape as the fast paths):
    ``B(t, k)``: only ``t`` recirculating minus the plain model; with ``complement``,
    ``C(t, k)``: everything recirculating minus everything but ``t``."""
    only = not complement
    ids = _checked(engine, recirculation, input_ids, positions, max_lag)
    T = ids.shape[1]
    reference = engine.run(ids, None if only else recirculation).log_probs
    out = torch.empty(ids.shape[0], len(positions), max_lag + 1)
    for i, t in enumerate(positions):
        mask = torch.full((T,), not only, dtype=torch.bool)
        mask[t] = only
        run = engine.run(ids, recirculation, mask=mask).log_probs
        first, second = (run, reference) if only else (reference, run)
        out[:, i] = first[:, t : t + max_lag + 1] - second[:, t : t + max_lag + 1]
    return out


# -------------------------------------------------------------- complement


@torch.no_grad()
def all_positions_run(engine: StepEngine, input_ids: Tensor, recirculation: Recirculation,
                      *, progress: bool = False) -> RunResult:
    """Token-by-token run with every position recirculating, keeping its KV cache."""
    return engine.run(input_ids, recirculation, return_cache=True, progress=progress)


@torch.no_grad()
def complement_benefit(engine: StepEngine, input_ids: Tensor, recirculation: Recirculation,
                       positions: Sequence[int], max_lag: int, *,
                       all_run: RunResult | None = None, progress: bool = False) -> Tensor:
    """``[windows, len(positions), max_lag + 1]`` complementary benefit ``C(t, k)`` (exact).

    ``all_run``: :func:`all_positions_run` of these ids, if already computed.
    """
    ids = _checked(engine, recirculation, input_ids, positions, max_lag)
    K = max_lag
    if all_run is None:
        all_run = all_positions_run(engine, ids, recirculation, progress=progress)
    if all_run.cache is None:
        raise ValueError("all_run must keep its cache: all_positions_run(...) or return_cache=True")
    out = torch.empty(ids.shape[0], len(positions), K + 1)
    for i, t, seq, mask in _masks(positions, K, complement=True, progress=progress):
        # t+K and t+K+1 go in one chunk: the prediction at t+K is their last scored one,
        # and recirculating either of them could only reach later predictions.
        mask[t + K:] = False
        rest = engine.run(ids[:, :seq], recirculation, mask=mask, start=t,
                          cache=all_run.cache.copy(length=t), block_size=[1] * K + [2])
        out[:, i] = all_run.log_probs[:, t : t + K + 1] - rest.log_probs[:, t : t + K + 1]
    _check_lag_zero(out, "complementary")
    return out


def _masks(positions: Sequence[int], K: int, *, complement: bool, progress: bool):
    """``(i, t, seq, mask)`` per position ``t``: the ``seq = t + K + 2`` tokens the fast
    path runs, and the mask recirculating ``t`` alone (or, ``complement``, all but ``t``)."""
    for i, t in enumerate(tqdm(positions, desc="positions", disable=not progress, leave=False)):
        t = int(t)
        mask = torch.full((t + K + 2,), complement, dtype=torch.bool)
        mask[t] = not complement
        yield i, t, t + K + 2, mask


def _check_lag_zero(benefit: Tensor, what: str) -> None:
    if not bool((benefit[..., 0] == 0).all()):
        worst = benefit[..., 0].abs().max().item()
        raise RuntimeError(
            f"{what} lag-0 benefit is not exactly zero (max |B(t,0)| = {worst:.3g}): the "
            f"readout at t changed when t recirculated, which breaks SEMANTICS.md's readout rule"
        )
