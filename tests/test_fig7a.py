"""experiments/latent_feedback_organism.sh and fig7a.py (Fig. 7a, docs/latent-feedback.md):
by default the long-range recipe's organisms (Recipe.long_range); on another recipe's
organisms the organisms come from the cache under the recipe's flags, the figure names
the recipe and never overwrites Fig. 7a's, and input the figure cannot be made from gets
a one-line error."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tyro

from probekit.runs import identity
from probekit.training.config import OrganismConfig
from probekit.training.history import solved_at
from probekit.training.organism_cache import Recipe

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
from fig7a import figure_title, recipe_changes, seed_verdicts  # noqa: E402
from fig7a_recipes import HEADER, committed_figures, flags, table  # noqa: E402
from organism_checkpoint import Args, recipe_of  # noqa: E402

SCRIPT = ROOT / "experiments" / "latent_feedback_organism.sh"

#: A 2-step, 2-block organism: cheap to train, and far from the default recipe.
RECIPE = "--steps 2 --n-blocks 2 --d-model 32 --n-heads 2 --d-mlp 64"
STEM = "latent-feedback-fig7a-steps-2-n-blocks-2-d-model-32-n-heads-2-d-mlp-64"


def script(tmp: Path, **env: str) -> subprocess.CompletedProcess:
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PROBEKIT_CACHE_DIR": str(tmp / "cache"), "RUN": str(tmp / "run"),
           "OUT": str(tmp / "figures"), "PYTHON": sys.executable,
           "PROBEKIT": str(bin_dir / "probekit"), "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(["bash", str(SCRIPT)],
                          env=env, capture_output=True, text=True, timeout=600)


def fig7a(run: Path, out: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "experiments" / "fig7a.py"), str(run),
                           "--counts", "0", "--out", str(out), *flags],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PROBEKIT_CACHE_DIR": str(out / "cache")})


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fig7a")
    done = script(tmp, RECIPE=RECIPE, SEEDS="0", COUNTS="0")
    assert done.returncode == 0, done.stderr[-2000:]
    return tmp, done


def _first_training(tmp: Path, **env: str) -> list[str]:
    """The flags the script passes to organism_checkpoint.py first: a stand-in PYTHON
    records them and fails, which stops the script there."""
    fake = tmp / "python"
    fake.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\nexit 3\n')
    fake.chmod(0o755)
    done = script(tmp, PYTHON=str(fake), **env)
    assert done.returncode == 3 and not (tmp / "run").exists()
    script_path, *flags = (tmp / "args").read_text().split()
    assert script_path == "experiments/organism_checkpoint.py"
    return flags


def test_the_script_by_default_trains_the_long_range_recipe_on_five_seeds(tmp_path):
    flags = _first_training(tmp_path)
    assert flags[:2] == ["--seed", "0"]
    assert recipe_of(tyro.cli(Args, args=flags)) == Recipe.long_range(0)
    (line,) = [x for x in SCRIPT.read_text().splitlines() if x.startswith("SEEDS=")]
    assert line == "SEEDS=${SEEDS:-0 1 2 3 4}"
    (tmp_path / "args").unlink()
    assert _first_training(tmp_path, SEEDS="3")[:2] == ["--seed", "3"]


def test_the_scripts_headline_flags_make_the_organisms_the_headline_command_trains():
    (line,) = [x for x in SCRIPT.read_text().splitlines() if x.startswith("HEADLINE=")]
    flags = line.split("=", 1)[1].strip('"').split()
    for seed in (0, 3):
        recipe = recipe_of(tyro.cli(Args, args=["--seed", str(seed), *flags]))
        assert recipe == Recipe.headline(seed)
        assert recipe.key() == Recipe.headline(seed).key()
    keys = {Recipe.headline(0).key(), Recipe.long_range(0).key(), Recipe.default(0).key()}
    assert len(keys) == 3


def test_recipe_changes_names_the_fields_that_differ_from_the_default():
    assert recipe_changes({"recipe": identity(Recipe.default(3)), "steps": 2000}, 3) == {}
    other = Recipe.default(3, copy_rows=0.25, fixed_point=0.1, steps=3000)
    assert recipe_changes({"recipe": identity(other), "steps": 3000}, 3) == {
        "data.copy_rows": 0.25, "train.fixed_point": 0.1, "steps": 3000}
    # an organism of seed 3 shown as seed 1's differs in its seed
    assert recipe_changes({"recipe": identity(Recipe.default(3)), "steps": 2000}, 1) == {
        "train.seed": 3}


def test_a_long_recipe_wraps_in_the_figure_title_and_loses_no_flag():
    long = Recipe.default(0, copy_rows=0.25, long_rows=4.0, fixed_point=0.25, steps=4500,
                          lr_floor=0.0, ahead_loss=4.0, short_first=1500, close_pairs=0.25,
                          close_pairs_rows="short", close_pairs_batch="added")
    changes = recipe_changes({"recipe": identity(long), "steps": 4500}, 0)
    title = figure_title(changes, [0, 1, 2, 3, 4])
    first, *recipe = title.splitlines()
    assert first == "latent feedback on probekit's organism (5 training seeds: mean, min-max)"
    assert len(recipe) > 1 and all(len(line) <= 140 for line in recipe)  # at 9 pt it fits
    assert " ".join(recipe) == "recipe: " + ", ".join(f"{k} {v}" for k, v in changes.items())
    assert figure_title({}, [3]) == "latent feedback on probekit's organism (training seed 3)"


def test_a_recipe_figure_shows_that_recipes_cached_organisms_under_its_own_name(recipe_run):
    tmp, done = recipe_run
    assert sorted(p.name for p in (tmp / "figures").iterdir()) == [f"{STEM}.json",
                                                                   f"{STEM}.png"]
    out = json.loads((tmp / "figures" / f"{STEM}.json").read_text())
    assert out["recipe_changes"] == {"shape.d_mlp": 64, "shape.d_model": 32,
                                     "shape.n_blocks": 2, "shape.n_heads": 2, "steps": 2}
    recipe = recipe_of(Args(seed=0, steps=2, shape=OrganismConfig(n_blocks=2, d_model=32,
                                                                  n_heads=2, d_mlp=64)))
    folder = tmp / "cache" / "organisms" / out["organisms"]["0"]["folder"]
    assert folder.name == f"seed0-{recipe.key()}"
    sealed = json.loads((folder / "probekit-cache.json").read_text())
    assert out["organisms"]["0"]["task_accuracy"] == sealed["task_accuracy"]
    assert out["organisms"]["0"]["machine"] == sealed["machine"]  # where it was trained
    # when each task was first solved, from the sealed training history
    history = json.loads((folder / "checkpoint" / "history.json").read_text())
    assert out["organisms"]["0"]["solved_at"] == solved_at(history)
    assert set(out["organisms"]["0"]["solved_at"]) == {"completion", "memory"}
    summary = json.loads((tmp / "run" / "seed0" / "memory-d0" / "summary.json").read_text())
    assert summary["mechanism"]["checkpoint"] == str(folder / "checkpoint")
    # the runs' own compute (kept across resumes), not the last invocation's wall time
    assert out["compute_seconds"]["memory"]["0"] == summary["compute_seconds"] > 0
    assert set(out["results"]) == {"completion", "memory"}
    assert set(out["results"]["memory"]["0"]) == {"none", "last-1", "full"}
    assert "organisms: shape.d_mlp 64, shape.d_model 32, shape.n_blocks 2, shape.n_heads 2, " \
           "steps 2" in done.stdout
    # each seed against the targets, in the JSON and the output (a 2-step organism meets none)
    assert out["per_seed"] == seed_verdicts(out) and not out["per_seed"]["0"]["meets_targets"]
    assert "every length): none (0 of 1)" in done.stdout


def test_a_bad_recipe_flag_stops_the_script_before_any_run(tmp_path):
    done = script(tmp_path, RECIPE="--steps 0", SEEDS="0", COUNTS="0")
    assert done.returncode == 2
    assert done.stderr.strip() == ("organism_checkpoint: error: --steps must be a positive "
                                   "integer; got 0")
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def _runs_copy(recipe_run, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(recipe_run[0] / "run", run)
    return run


def _point(summary_file: Path, checkpoint: str | None) -> None:
    summary = json.loads(summary_file.read_text())
    if checkpoint is None:
        del summary["mechanism"]["checkpoint"]
    else:
        summary["mechanism"]["checkpoint"] = checkpoint
    summary_file.write_text(json.dumps(summary))


def test_fig7a_errors_name_the_run_and_say_what_to_do(recipe_run, tmp_path):
    run = _runs_copy(recipe_run, tmp_path)
    out = tmp_path / "figures"
    done = fig7a(run, out, "--seeds", "0", "1")
    assert done.returncode == 2
    assert done.stderr.startswith(f"fig7a: error: {run}/seed1/completion-d0/summary.json: "
                                  f"cannot read it (")
    assert done.stderr.strip().endswith("run experiments/latent_feedback_organism.sh with "
                                        "the same SEEDS and COUNTS first")
    assert done.stderr.count("\n") == 1 and not out.exists()

    # seed 1's runs used seed 0's organism: another recipe than seed 1's default
    shutil.copytree(run / "seed0", run / "seed1")
    done = fig7a(run, out, "--seeds", "0", "1")
    assert done.stderr.strip() == (
        "fig7a: error: the seeds' organisms come from different recipes (seed 0: "
        "shape.d_mlp 64, shape.d_model 32, shape.n_blocks 2, shape.n_heads 2, steps 2; "
        "seed 1: shape.d_mlp 64, shape.d_model 32, shape.n_blocks 2, shape.n_heads 2, "
        "steps 2, train.seed 0); make one figure per recipe")

    summary = json.loads((run / "seed0" / "memory-d0" / "summary.json").read_text())
    organism = Path(summary["mechanism"]["checkpoint"]).parent
    twin = tmp_path / "twin"  # a sound copy: the seal's file names are relative
    shutil.copytree(organism, twin)
    _point(run / "seed0" / "memory-d0" / "summary.json", str(twin / "checkpoint"))
    done = fig7a(run, out, "--seeds", "0")
    both = ", ".join(sorted((str(organism), str(twin))))
    assert done.stderr.strip() == (f"fig7a: error: seed 0's runs used 2 organisms ({both}); "
                                   f"rerun them into one RUN folder per recipe")

    (twin / "checkpoint" / "model.safetensors").write_bytes(b"damaged")
    done = fig7a(run, out, "--seeds", "0")
    assert done.stderr.strip() == (
        f"fig7a: error: {run}/seed0/memory-d0: its organism {twin} is not a sound cached "
        f"organism (checkpoint/model.safetensors has 7 bytes, "
        f"{(organism / 'checkpoint' / 'model.safetensors').stat().st_size} were written); "
        f"rerun the script, which trains it again")

    _point(run / "seed0" / "memory-d0" / "summary.json", None)
    done = fig7a(run, out, "--seeds", "0")
    assert done.stderr.strip() == (
        f"fig7a: error: {run}/seed0/memory-d0/summary.json names no latent-feedback "
        f"checkpoint; give the run folder of experiments/latent_feedback_organism.sh")

    old = run / "seed0" / "completion-d0" / "summary.json"  # from before compute_seconds
    summary = json.loads(old.read_text())
    del summary["compute_seconds"]
    old.write_text(json.dumps(summary))
    done = fig7a(run, out, "--seeds", "0")
    assert done.stderr.strip() == (
        f"fig7a: error: {old}: written by an older probekit; rerun "
        f"experiments/latent_feedback_organism.sh with the same SEEDS and COUNTS (its "
        f"finished parts are reused)")
    assert not out.exists()


def _results(full: dict, answers: dict, none: dict) -> dict:
    """A Fig. 7a JSON's seeds and results: ``{(task, count): [per-seed value]}`` for the
    depth-0 probe under full and none and the answers under full (depth 1 at 0.5)."""
    results: dict = {}
    for (task, count), probe in full.items():
        results.setdefault(task, {})[str(count)] = {
            "full": {"probe_per_run": [[p, 0.5] for p in probe],
                     "model_accuracy_per_run": answers[task, count]},
            "none": {"probe_per_run": [[p, 0.5] for p in none[task, count]],
                     "model_accuracy_per_run": [0.5] * len(probe)}}
    return {"seeds": [0, 4, 7], "results": results}


def test_seed_verdicts_hold_each_seed_to_every_target_at_every_length():
    cells = [("completion", 0), ("completion", 256), ("memory", 0)]
    full = {c: [317 / 320, 0.99, 1.0] for c in cells}
    answers = {c: [0.990625, 1.0, 1.0] for c in cells}
    none = {c: [0.5, 0.5, 0.5] for c in cells}
    full["completion", 256] = [1.0, 0.99, 0.984375]      # seed 7 misses the probe, once
    answers["memory", 0] = [1.0, 0.984375, 1.0]          # seed 4 misses memory's answers
    verdicts = seed_verdicts(_results(full, answers, none))
    assert [v["meets_targets"] for v in verdicts.values()] == [True, False, False]
    assert verdicts["7"]["completion"] == {"depth0_full_min": 0.984375,
                                           "answers_full_min": 1.0, "depth0_none_max": 0.5}
    assert verdicts["4"]["memory"]["answers_full_min"] == 0.984375
    none["completion", 0] = [0.61, 0.5, 0.5]  # readable under standard prefill: a miss too
    answers["memory", 0] = [1.0, 1.0, 1.0]
    full["completion", 256] = [1.0, 0.99, 1.0]
    verdicts = seed_verdicts(_results(full, answers, none))
    assert [v["meets_targets"] for v in verdicts.values()] == [False, True, True]


def test_the_recipe_flags_are_organism_checkpoints():
    assert flags({"data.copy_rows": 0.25, "steps": 4500, "train.ahead_loss": 4.0,
                  "train.fixed_point_rows": "long", "shape.n_blocks": 6}) == (
        "--copy-rows 0.25 --steps 4500 --ahead-loss 4 --fixed-point-rows long --n-blocks 6")
    recipe = recipe_of(tyro.cli(Args, args=["--seed", "2", *flags(
        recipe_changes({"recipe": identity(Recipe.long_range(2)), "steps": 4500}, 2)).split()]))
    assert recipe == Recipe.long_range(2)
    given = ["--seed", "0", "--close-pairs", "0.25", "--close-pairs-rows", "short",
             "--close-pairs-batch", "added"]
    recipe = recipe_of(tyro.cli(Args, args=given))
    assert (recipe.train.close_pairs_rows, recipe.train.close_pairs_batch) == ("short", "added")
    assert recipe_of(tyro.cli(Args, args=["--seed", "0", *flags(recipe_changes(
        {"recipe": identity(recipe), "steps": 2000}, 0)).split()])) == recipe
    for given in (["--ema", "0.999"], ["--lam", "2"]):  # every training flag reaches it
        recipe = recipe_of(tyro.cli(Args, args=["--seed", "0", *given]))
        assert recipe != Recipe.default(0)
        assert flags(recipe_changes({"recipe": identity(recipe), "steps": 2000}, 0)) == (
            " ".join(given))
        assert recipe_of(tyro.cli(Args, args=["--seed", "0", *flags(recipe_changes(
            {"recipe": identity(recipe), "steps": 2000}, 0)).split()])) == recipe
    assert flags({}) == "the default recipe" and flags(None) == "not recorded"


def test_the_docs_table_of_recipes_is_the_scripts_output_on_the_committed_figures():
    doc = (ROOT / "docs" / "latent-feedback.md").read_text().splitlines()
    start = doc.index(HEADER.splitlines()[0])
    rows = doc[start:doc.index("", start)]
    # every committed recipe figure, recomputed: none left out, no number copied by hand
    figures = committed_figures()
    assert len(figures) >= 14 and figures[0].name == "latent-feedback-fig7a.json"
    assert "\n".join(rows) == table(figures)


def test_fig7a_recipes_errors_name_the_file(tmp_path):
    def run(*paths):
        return subprocess.run([sys.executable, str(ROOT / "experiments" / "fig7a_recipes.py"),
                               *map(str, paths)], capture_output=True, text=True, timeout=60)
    done = run(tmp_path / "missing.json")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (f"fig7a_recipes: error: {tmp_path}/missing.json: cannot read it "
                           f"(No such file or directory); give the .json files "
                           f"experiments/fig7a.py writes\n")
    other = tmp_path / "headline.json"
    other.write_text(json.dumps({"seeds": [0]}))
    done = run(ROOT / "figures" / "latent-feedback-fig7a.json", other)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (f"fig7a_recipes: error: {other} is not a Fig. 7a JSON (KeyError: "
                           f"'results'); give the .json files experiments/fig7a.py writes\n")
    # a figure of one task only
    fig = json.loads((ROOT / "figures" / "latent-feedback-fig7a.json").read_text())
    del fig["results"]["memory"]
    other.write_text(json.dumps(fig))
    done = run(other)
    assert done.returncode == 2 and done.stderr == (
        f"fig7a_recipes: error: {other} is not a Fig. 7a JSON (KeyError: 'memory'); give the "
        f".json files experiments/fig7a.py writes\n")
