"""experiments/fig7b.py (Fig. 7b, docs/latent-feedback.md): it describes the organisms the
runs read, and refuses in one line runs it cannot make the figure from, before writing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from probekit.core import model_cache

ROOT = Path(__file__).resolve().parents[1]
PRODUCER = "experiments/latent_feedback_registers.sh"


def fig7b(tmp: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "experiments" / "fig7b.py"),
                           str(tmp / "run"), "--out", str(tmp / "figures"), *flags],
                          capture_output=True, text=True, timeout=300)


def _sweeps_reading(tmp: Path, seed: int, *checkpoints: Path) -> list[Path]:
    paths = []
    for sweep, ckpt in zip(("register-sweep", "overwrite-sweep"), checkpoints, strict=True):
        path = tmp / "run" / f"seed{seed}" / sweep / "summary.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"compute_seconds": 1.0,
                                    "mechanism": {"checkpoint": str(ckpt)}}))
        paths.append(path)
    return paths


def _organism(tmp: Path, name: str, seed: int, steps: int = 1) -> Path:
    folder = tmp / "organisms" / name
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "checkpoint" / "config.json").write_text("{}")
    model_cache.seal(folder, {"recipe": {"train": {"seed": seed}, "shape": {}},
                              "steps": steps, "train_seconds": 1.0, "task_accuracy": {}})
    return folder / "checkpoint"


def test_an_organism_missing_from_the_cache_gets_one_line(tmp_path):
    """It was a traceback: the record was looked up by recipe, and a missing one is None."""
    gone = tmp_path / "gone" / "checkpoint"
    path, _ = _sweeps_reading(tmp_path, 0, gone, gone)
    done = fig7b(tmp_path, "--seeds", "0")
    assert done.returncode == 2
    assert done.stderr == (f"fig7b: error: {path}: its organism {gone.parent} is not a sound "
                           f"cached organism (no training record); rerun {PRODUCER}, which "
                           f"trains it again\n")
    assert not (tmp_path / "figures").exists()


def test_runs_of_one_seed_on_two_organisms_are_refused(tmp_path):
    a, b = _organism(tmp_path, "seed0-a", 0), _organism(tmp_path, "seed0-b", 0)
    _sweeps_reading(tmp_path, 0, a, b)
    done = fig7b(tmp_path, "--seeds", "0")
    assert done.returncode == 2
    assert done.stderr == (f"fig7b: error: seed 0's two sweeps read different organisms "
                           f"({a}, {b}); rerun {PRODUCER}\n")
    assert not (tmp_path / "figures").exists()


def test_runs_that_read_another_seeds_organism_are_refused(tmp_path):
    other = _organism(tmp_path, "seed0-a", 0)
    _sweeps_reading(tmp_path, 1, other, other)
    done = fig7b(tmp_path, "--seeds", "1")
    assert done.returncode == 2
    assert done.stderr == (f"fig7b: error: seed 1's runs read an organism of seed 0; rerun "
                           f"{PRODUCER}\n")


def test_seeds_of_different_recipes_are_refused(tmp_path):
    a, b = _organism(tmp_path, "seed0-a", 0), _organism(tmp_path, "seed1-b", 1, steps=2)
    _sweeps_reading(tmp_path, 0, a, a)
    _sweeps_reading(tmp_path, 1, b, b)
    done = fig7b(tmp_path, "--seeds", "0", "1")
    assert done.returncode == 2
    assert done.stderr == (f"fig7b: error: the seeds' organisms come from different recipes "
                           f"(seeds 0, 1); rerun {PRODUCER} with one TASKS, STEPS and SHAPE "
                           f"into one RUN folder\n")
