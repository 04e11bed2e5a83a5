"""The register diagnostics of experiments/ (docs/latent-feedback.md, Fig. 7b): their
row accounting, their output, and their one-line errors."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


def run(script: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXPERIMENTS / script), *flags],
                          capture_output=True, text=True, timeout=300)


def test_register_plateau_counts_rows_and_prints_accuracy_every_100_steps():
    out = run("register_plateau.py", "--registers", "2", "4", "--writes", "1", "2",
              "--groups", "2", "--steps", "200", "--batch-size", "8")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    # groups x (schedule, complement) x m queries, for each (m, writes)
    train = 2 * 2 * (2 + 4) * 2
    # 128 // (4 * 2) = 16 held-out groups per (m, writes)
    held_out = 16 * 2 * (2 + 4) * 2
    # the shortcut is right with probability 1/m + (1 - 1/m)/2, per held-out row (2m per group)
    shortcut = (2 * 0.75 + 4 * 0.625) / 6
    assert lines[0] == (f"{train} training rows, {held_out} held-out rows; "
                        f"shortcut {shortcut:.3f}")
    steps = [re.match(r"step +(\d+) .* held-out accuracy (\d\.\d{3}) "
                      r"\(m=2 (\d\.\d{3}), m=4 (\d\.\d{3})\)$", line) for line in lines[1:]]
    assert [int(m.group(1)) for m in steps] == [100, 200]
    for m in steps:  # the total is the row-weighted mean of the register counts' accuracies
        total, two, four = map(float, m.groups()[1:])
        assert total == pytest.approx((16 * 2 * 4 * two + 16 * 2 * 8 * four) / held_out, abs=1e-3)


def test_register_plateau_splits_the_accuracy_by_the_pad_line():
    """With --pad-rows the held-out accuracy is also printed for the rows with and without
    the "# pad" line; the total, their row-weighted mean, lies between them."""
    out = run("register_plateau.py", "--groups", "2", "--steps", "100", "--batch-size", "8",
              "--pad-rows", "0.5")
    assert out.returncode == 0, out.stderr
    line = out.stdout.splitlines()[1]
    m = re.match(r"step +100 .* held-out accuracy (\d\.\d{3}) \(pad line (\d\.\d{3}), "
                 r"none (\d\.\d{3})\)$", line)
    assert m, line
    total, padded, plain = map(float, m.groups())
    assert min(padded, plain) - 1e-3 <= total <= max(padded, plain) + 1e-3


@pytest.mark.parametrize("script, flags, message", [
    ("register_plateau.py", ("--steps", "0"),
     "register_plateau: error: --steps must be >= 1; got 0"),
    ("register_plateau.py", ("--writes", "0"),
     "register_plateau: error: --registers and --writes must be counts >= 1 and "
     "--null-updates >= 0"),
    ("register_plateau.py", ("--pad-rows", "1.5"),
     "register_plateau: error: --pad-rows must lie in [0, 1]; got 1.5"),
    ("register_shapes.py", ("--rows", "0"), "register_shapes: error: --rows must be >= 1; got 0"),
])
def test_bad_flags_get_one_line_errors(script, flags, message):
    out = run(script, *flags)
    assert out.returncode == 2
    assert out.stderr.strip() == message
