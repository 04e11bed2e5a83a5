"""experiments/latent_feedback_stability.sh and fig3.py (Fig. 3, docs/latent-feedback.md):
input the figure cannot be made from gets a one-line error that says what to run, before
anything is trained or written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from probekit.core import model_cache

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "latent_feedback_stability.sh"
PRODUCER = "experiments/latent_feedback_stability.sh with the same SEED and VARIANTS"


def fig3(tmp: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "experiments" / "fig3.py"),
                           str(tmp / "run"), "--out", str(tmp / "figures"), *flags],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PROBEKIT_CACHE_DIR": str(tmp / "cache")})


def test_an_unknown_variant_stops_the_script_before_any_training(tmp_path):
    env = {**os.environ, "PROBEKIT_CACHE_DIR": str(tmp_path / "cache"),
           "RUN": str(tmp_path / "run"), "PYTHON": sys.executable,
           "VARIANTS": "default-75-22-3 paper-75-2"}
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert done.stderr == (
        "latent_feedback_stability: error: VARIANTS names no variant 'paper-75-2'; choose "
        "from: default-75-22-3 paper-75-25 schedule-50-35-15 feed-residual\n")
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_fig3_says_which_run_is_missing_and_what_to_run(tmp_path):
    done = fig3(tmp_path, "--variants", "paper-75-25")
    summary = tmp_path / "run" / "paper-75-25" / "stability" / "summary.json"
    assert done.returncode == 2
    assert done.stderr.startswith(f"fig3: error: {summary}: cannot read it (")
    assert done.stderr.endswith(f"; run {PRODUCER} first\n")
    assert done.stderr.count("\n") == 1 and not (tmp_path / "figures").exists()


def test_fig3_refuses_an_old_summary_and_an_organism_missing_from_the_cache(tmp_path):
    folder = tmp_path / "run" / "feed-residual"
    (folder / "stability").mkdir(parents=True)
    (folder / "state-tracking").mkdir()
    stability = folder / "stability" / "summary.json"
    stability.write_text(json.dumps({"loss": [1.0], "relative_update": [0.0]}))
    (folder / "state-tracking" / "summary.json").write_text(json.dumps({"datasets": {}}))
    done = fig3(tmp_path, "--variants", "feed-residual")
    assert done.stderr == (f"fig3: error: {stability}: written by an older probekit; rerun "
                           f"{PRODUCER} (its finished parts are reused)\n")

    _runs_reading(tmp_path, "feed-residual", *[tmp_path / "gone" / "checkpoint"] * 2)
    done = fig3(tmp_path, "--variants", "feed-residual", "--seed", "3")
    assert done.returncode == 2
    assert done.stderr == (f"fig3: error: feed-residual: its organism {tmp_path}/gone is not a "
                           f"sound cached organism (no training record); rerun {PRODUCER}, "
                           f"which trains it again\n")
    assert not (tmp_path / "figures").exists()


def _runs_reading(tmp: Path, name: str, stability_ckpt: Path, tracking_ckpt: Path) -> None:
    for kind, summary in (
            ("stability", {"loss": [1.0], "relative_update": [0.0],
                           "checkpoint": {"checkpoint": str(stability_ckpt)}}),
            ("state-tracking", {"datasets": {}, "mechanism": {"checkpoint": str(tracking_ckpt)}})):
        (tmp / "run" / name / kind).mkdir(parents=True, exist_ok=True)
        (tmp / "run" / name / kind / "summary.json").write_text(json.dumps(summary))


def test_fig3_describes_the_organism_its_runs_read_and_checks_it_is_one(tmp_path):
    """The training record comes from the checkpoint the runs name (not from the recipe's
    organism of today): two runs that read different organisms, or a record of another
    seed than --seed, are refused in one line."""
    organism = tmp_path / "organisms" / "seed2-abc"
    (organism / "checkpoint").mkdir(parents=True)
    (organism / "checkpoint" / "config.json").write_text("{}")
    model_cache.seal(organism, {"recipe": {"train": {"seed": 2}}})
    ckpt = organism / "checkpoint"
    _runs_reading(tmp_path, "paper-75-25", ckpt, tmp_path / "elsewhere" / "checkpoint")
    done = fig3(tmp_path, "--variants", "paper-75-25", "--seed", "2")
    assert done.returncode == 2
    assert done.stderr == (f"fig3: error: paper-75-25: its stability and state-tracking runs "
                           f"read different organisms ({ckpt}, {tmp_path}/elsewhere/checkpoint);"
                           f" rerun {PRODUCER}\n")

    _runs_reading(tmp_path, "paper-75-25", ckpt, ckpt)
    done = fig3(tmp_path, "--variants", "paper-75-25", "--seed", "0")
    assert done.returncode == 2
    assert done.stderr == ("fig3: error: paper-75-25: its organism was trained with seed 2; "
                           "give --seed 2 (the script's SEED)\n")
    assert not (tmp_path / "figures").exists()


def test_fig3_refuses_an_unknown_variant_by_name(tmp_path):
    done = fig3(tmp_path, "--variants", "paper-75-2")
    assert done.returncode == 2
    assert "paper-75-2" in done.stderr and "paper-75-25" in done.stderr
    assert not (tmp_path / "figures").exists()
