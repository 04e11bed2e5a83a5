"""Depth-probe speed at the default model's size (probekit/analysis/probing.py).

    .venv/bin/python benchmarks/bench_probing.py [--depths 31] [--d-model 576]
        [--groups 64] [--repeats 3]

Fits :class:`probekit.analysis.probing.DepthProbe` (one L2 logistic regression per depth
and grouped fold, standardised features) on synthetic residuals shaped like
SmolLM2-135M's: ``--depths`` residual depths of width ``--d-model``, ``--groups`` groups
of four examples with a planted linear signal. Printed: seconds per fit (the fastest of
``--repeats``: this machine is shared and the minimum is the least disturbed run),
seconds per (depth, fold) fit, and the mean accuracy beyond depth 1 (must be > 0.9, as
tests/test_probing.py checks). This replaces a wall-clock bound that used to sit in the
tests.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import numpy as np

from probekit.analysis.probing import DepthProbe


def toy(n_groups: int, n_depths: int, d_model: int, strength: float = 0.3, seed: int = 0):
    """The planted-signal data of tests/test_probing.py (loaded from there, one definition),
    in float32 like captured residuals."""
    spec = importlib.util.spec_from_file_location(
        "test_probing", Path(__file__).resolve().parents[1] / "tests" / "test_probing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    X, y, groups = module.toy(n_groups, n_depths, d_model, strength, seed)
    return X.astype(np.float32), y, groups


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depths", type=int, default=31)
    p.add_argument("--d-model", type=int, default=576)
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    X, y, groups = toy(args.groups, args.depths, args.d_model)
    times, probe = [], None
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        probe = DepthProbe().fit(X, y, groups)
        times.append(time.perf_counter() - t0)
    best = min(times)
    fits = args.depths * probe.n_folds
    print(f"{len(y)} examples x {args.depths} depths x d_model {args.d_model}, "
          f"{probe.n_folds} grouped folds")
    print(f"fit: {best:.2f} s (fastest of {args.repeats}); {1000 * best / fits:.1f} ms per "
          f"(depth, fold)")
    print(f"mean accuracy at depths >= 2: {probe.accuracy_mean_[2:].mean():.3f} (must be > 0.9)")


if __name__ == "__main__":
    main()
