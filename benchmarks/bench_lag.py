"""Lag analysis speed: the exact fast path vs the naive definition, as a ratio.

    .venv/bin/python benchmarks/bench_lag.py [--window-tokens 256] [--max-lag 64]
        [--windows 1] [--fast-positions 8] [--naive-positions 1] [--threads 1]

Both compute ``B(t, k)`` for ``k = 0 .. K`` (probekit/analysis/lag.py, SEMANTICS.md "Lag
benefit") on the default model, for the same windows:

- **naive**: the definition, one full token-by-token run of the ``T``-token window
  with a one-hot mask per ``t`` (plus one shared plain sequential run, not counted:
  that favours the naive side). Its cost per ``t`` is ``T`` steps whatever ``t`` is,
  so it is timed on ``--naive-positions`` values of ``t`` and the mean is the per-``t``
  cost;
- **fast**: :func:`probekit.analysis.lag.single_token_benefit`: per ``t``, one recirculated step
  and one plain step on a copy of the baseline cache, then one ``K+1``-token parallel
  forward (the baseline forward, shared by all ``t``, is counted once, amortised over
  the ``T - K - 1`` positions of a full analysis).

Printed: seconds per ``t`` of each, their ratio (target >= 20x at T = 256, K = 64),
and the largest |fast - naive| over the timed positions (the two must agree).
The machine here is shared; the numbers are one run's wall-clock times.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from probekit import Recirculation, StepEngine, load_model
from probekit.analysis.lag import single_token_benefit
from probekit.data.corpora import load_corpus, make_windows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--window-tokens", type=int, default=256)
    p.add_argument("--max-lag", type=int, default=64)
    p.add_argument("--windows", type=int, default=1)
    p.add_argument("--fast-positions", type=int, default=8, help="t values timed (fast)")
    p.add_argument("--naive-positions", type=int, default=1, help="t values timed (naive)")
    p.add_argument("--source", type=int, default=16)
    p.add_argument("--destination", type=int, default=10)
    p.add_argument("--alpha", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    model = load_model(args.model)
    engine = StepEngine(model)
    windows = make_windows(load_corpus("wiki"), model.tokenizer, args.window_tokens,
                           args.windows, bos=False, max_tokens=model.n_ctx)
    ids = torch.tensor([w.input_ids for w in windows])
    T, K = ids.shape[1], args.max_lag
    rec = Recirculation(args.source, args.destination, args.alpha)
    n_t = T - K - 1  # positions with a full lag range in a full analysis
    spread = torch.linspace(0, n_t - 1, max(args.fast_positions, args.naive_positions))
    fast_ts = [int(x) for x in spread[: args.fast_positions].round()]
    naive_ts = fast_ts[:: max(1, len(fast_ts) // args.naive_positions)][: args.naive_positions]
    print(f"{model.name}: {len(ids)} window(s) x T={T}, K={K}, {rec}; threads={args.threads}")

    t0 = time.perf_counter()
    baseline = engine.forward(ids, return_cache=True)
    t_base = time.perf_counter() - t0
    t0 = time.perf_counter()
    fast = single_token_benefit(engine, ids, rec, fast_ts, K, baseline=baseline)
    t_fast = (time.perf_counter() - t0) / len(fast_ts) + t_base / n_t
    print(f"fast : {t_fast:8.2f} s per t  (timed t = {fast_ts}; baseline forward {t_base:.2f} s "
          f"amortised over {n_t} positions)")

    plain = engine.run(ids, None).log_probs  # shared by every t: not counted
    t0 = time.perf_counter()
    worst = 0.0
    for t in naive_ts:
        onehot = torch.zeros(T, dtype=torch.bool)
        onehot[t] = True
        rec_lp = engine.run(ids, rec, mask=onehot).log_probs
        naive = rec_lp[:, t : t + K + 1] - plain[:, t : t + K + 1]
        worst = max(worst, (naive - fast[:, fast_ts.index(t)]).abs().max().item())
    t_naive = (time.perf_counter() - t0) / len(naive_ts)
    print(f"naive: {t_naive:8.2f} s per t  (timed t = {naive_ts}; a full {T}-step sequential "
          f"run each)")
    print(f"ratio naive / fast = {t_naive / t_fast:.1f}x (target >= 20x); a full analysis of "
          f"{n_t} positions: fast ~{n_t * t_fast / 60:.1f} min, "
          f"naive ~{n_t * t_naive / 60:.1f} min")
    print(f"max |fast - naive| over the timed positions = {worst:.2e}")


if __name__ == "__main__":
    main()
