"""Fault injection through the CLI (issue 9): kill -9 and Ctrl-C mid-run, edited input
files, damaged and foreign parts, damaged model caches, concurrent identical runs, and
bad inputs. Every run uses a tiny model in a temporary folder with a temporary cache.

Runs that must be killed or run side by side are subprocesses (``python -m
probekit.commands.main``); the others call the CLI's ``main`` in this process, which
runs the same code without paying for another interpreter. Guarantees: docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from probekit.commands.main import main
from probekit.core import model_cache

REAL_CACHE = os.environ.get("PROBEKIT_CACHE_DIR")  # before the fixture below replaces it
PROBEKIT = [sys.executable, "-m", "probekit.commands.main"]
WORDS = ("the cat sat on a mat and then ran away to find the dog who was sleeping under a "
         "tall green tree near our small house by the river").split()
PPL = ("perplexity", "--model", "tiny", "--text-file", "c.txt", "--windows", "6",
       "--window-tokens", "48", "--batch-size", "1", "--bootstrap", "20", "--threads", "1",
       "--no-progress")
STATE = ("run", "state-tracking", "--mechanism", "recirculation", "--model", "tiny",
         "--examples", "32", "--no-causal",
         "--threads", "1", "--no-progress")
INTERRUPTED = "interrupted; rerun the same command to resume"


def text(seed: int, n_words: int = 600) -> str:
    """Seeded word salad: ``seed`` picks the text, so two seeds give two inputs."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


@pytest.fixture(scope="module", autouse=True)
def cache_root(tmp_path_factory):
    """A temporary probekit cache for every run of this module (and its subprocesses)."""
    root = tmp_path_factory.mktemp("probekit-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PROBEKIT_CACHE_DIR", str(root))
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield root


@pytest.fixture()
def work(tmp_path, monkeypatch):
    """A fresh working folder holding ``c.txt``; the CLI's ``runs/`` lands here."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.txt").write_text(text(0))
    return tmp_path


def cli(*args: str) -> tuple[int, str, str]:
    """``probekit ARGS`` run in this process: ``(exit status, stdout, stderr)``."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            warnings.catch_warnings():
        warnings.simplefilter("always")  # as in a fresh process: each warning shows...
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning,
                         ResourceWarning):
            warnings.simplefilter("ignore", category)  # ...but those Python hides
        status = main(list(args))
    return status, out.getvalue(), err.getvalue()


def spawn(*args: str) -> subprocess.Popen:
    # SIGINT as a terminal's Ctrl-C delivers it: a test runner started as a background
    # job inherits SIGINT ignored, and Python then never raises KeyboardInterrupt
    return subprocess.Popen([*PROBEKIT, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def recorded(run_dir: Path) -> list[str]:
    """Keys of the parts recorded in the run's index (one line per part written)."""
    index = run_dir / "parts" / "index.jsonl"
    if not index.exists():
        return []
    keys = []
    for line in index.read_text().splitlines():
        with contextlib.suppress(ValueError):
            keys.append(json.loads(line)["key"])
    return keys


def signal_after_parts(proc: subprocess.Popen, run_dir: Path, n: int, sig: int) -> str:
    """Send ``sig`` once ``run_dir`` holds at least ``n`` finished parts; its stderr."""
    deadline = time.monotonic() + 300
    while len(recorded(run_dir)) < n:
        if proc.poll() is not None:
            pytest.fail(f"the run ended before {n} parts: {proc.communicate()[1][-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no {n} parts within 300 s")
        time.sleep(0.005)
    proc.send_signal(sig)
    return proc.communicate(timeout=120)[1]


def summary(run_dir: Path, drop: tuple[str, ...] = ()) -> dict:
    """``summary.json`` without the keys in ``drop`` (timings, this run's file paths)."""
    def strip(o):
        if isinstance(o, dict):
            return {k: strip(v) for k, v in o.items() if k not in drop}
        if isinstance(o, list):
            return [strip(v) for v in o]
        return o
    return strip(json.loads((run_dir / "summary.json").read_text()))


def only_run_dir(root: Path, exclude=()) -> Path:
    """The one folder under ``root/runs`` not in ``exclude``."""
    new = [p for p in (root / "runs").iterdir() if p not in exclude]
    assert len(new) == 1, new
    return new[0]


# --------------------------------------------------------------- kill, Ctrl-C, resume
def test_perplexity_killed_then_interrupted_resumes_to_the_uninterrupted_result(work):
    run = work / "r"
    killed = spawn(*PPL, "--run-dir", "r")
    signal_after_parts(killed, run, 1, signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL
    done = len(set(recorded(run)))
    assert 1 <= done < 6  # killed mid-run

    again = spawn(*PPL, "--run-dir", "r")  # resumes, then Ctrl-C
    err = signal_after_parts(again, run, done + 1, signal.SIGINT)
    assert again.returncode == 130
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith("probekit: warning:")]
    assert lines == [f"probekit perplexity: {INTERRUPTED}"]
    assert len(set(recorded(run))) < 6

    status, out, _ = cli(*PPL, "--run-dir", "r")  # finishes from the saved parts
    assert status == 0 and "wrote r/summary.json" in out
    assert cli(*PPL, "--run-dir", "ref")[0] == 0  # uninterrupted, elsewhere
    assert summary(run) == summary(work / "ref")
    assert sorted(set(recorded(run))) == [f"batch{i:05d}" for i in range(6)]
    with np.load(run / "token_log_probs.npz") as a, np.load(work / "ref/token_log_probs.npz") as b:
        assert all(np.array_equal(a[k], b[k]) for k in ("base", "rec", "input_ids"))


def test_state_tracking_killed_resumes_to_the_uninterrupted_result(work):
    run = work / "r"
    killed = spawn(*STATE, "--run-dir", "r")
    signal_after_parts(killed, run, 1, signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL
    assert 1 <= len(set(recorded(run))) < 4
    assert cli(*STATE, "--run-dir", "r")[0] == 0
    assert cli(*STATE, "--run-dir", "ref")[0] == 0
    timing = ("wall_seconds", "compute_seconds", "seconds", "plots")
    assert summary(run, timing) == summary(work / "ref", timing)


def test_a_resumed_run_reports_the_compute_of_every_invocation_not_only_the_last(work):
    """``compute_seconds`` sums the units' own recorded times, so a finished run invoked
    again (nothing left to compute) reports what its parts cost, not the seconds it took."""
    assert cli(*STATE, "--run-dir", "r")[0] == 0
    first = summary(work / "r")
    regimes = [r for d in first["datasets"].values() for r in d["regimes"].values()]
    assert first["compute_seconds"] == pytest.approx(sum(r["seconds"] for r in regimes))
    assert first["compute_seconds"] > 0
    assert cli(*STATE, "--run-dir", "r")[0] == 0  # resumes: every part is on disk
    again = summary(work / "r")
    assert again["compute_seconds"] == first["compute_seconds"]
    assert again["wall_seconds"] != first["wall_seconds"]


# --------------------------------------------------------------- edited inputs
EDITABLE = {
    "perplexity": PPL,
    "sweep": ("sweep", "--model", "tiny", "--text-file", "c.txt", "--windows", "2",
              "--window-tokens", "32", "--pairs", "list", "--pair-list", "3-1",
              "--threads", "1", "--no-progress"),
    "lag-analysis": ("lag-analysis", "--model", "tiny", "--text-file", "c.txt", "--windows",
                     "2", "--window-tokens", "24", "--max-lag", "8", "--positions", "0:16:4",
                     "--threads", "1", "--no-progress"),
}


@pytest.mark.parametrize("command", list(EDITABLE))
def test_an_edited_text_file_gives_a_fresh_result_never_the_old_one(work, command):
    args = EDITABLE[command]
    assert cli(*args)[0] == 0
    old = only_run_dir(work)
    (work / "c.txt").write_text(text(1))  # same path, new content
    assert cli(*args)[0] == 0
    new = only_run_dir(work, exclude=[old])
    (work / "fresh").mkdir()
    os.chdir(work / "fresh")
    (work / "fresh" / "c.txt").write_text(text(1))
    assert cli(*args)[0] == 0
    assert summary(new) == summary(only_run_dir(work / "fresh")) != summary(old)


def test_an_edited_text_file_is_refused_by_the_run_dir_of_the_old_one(work):
    assert cli(*PPL, "--run-dir", "r")[0] == 0
    (work / "c.txt").write_text(text(1))
    status, out, err = cli(*PPL, "--run-dir", "r")
    assert status == 2 and out == ""
    assert err.splitlines() == ["probekit perplexity: error: r holds a run with a different "
                                "config or inputs; choose another --run-dir or delete it"]


def test_changed_model_weights_give_a_fresh_result(work):
    """A local model folder whose weights change under the same path is another model."""
    from probekit.core.models import load_model

    def save(seed: int) -> None:
        m = load_model("tiny", seed=seed)
        m.hf_model.save_pretrained(work / "m")
        m.tokenizer.save_pretrained(work / "m")

    args = (*PPL, "--windows", "2", "--model", "m")
    save(0)
    assert cli(*args)[0] == 0
    old = only_run_dir(work)
    save(1)
    assert cli(*args)[0] == 0
    new = only_run_dir(work, exclude=[old])
    assert json.loads((new / "config.json").read_text())["model_hash"] == \
        load_model("tiny", seed=1).content_hash
    assert summary(new) != summary(old)


def _rewrite_gate(folder: Path, seed: int) -> None:
    """Save another random gate into a checkpoint folder (same model, same step)."""
    from probekit.mechanisms.latent_feedback import FeedbackGate
    from probekit.training.checkpoint import load_checkpoint, save_checkpoint
    from probekit.training.config import TrainConfig

    ck = load_checkpoint(folder)
    save_checkpoint(folder, gate=FeedbackGate.for_model(ck.model, init="random", seed=seed),
                    model=ck.model, config=TrainConfig(mode="organism"), step=ck.step)


def test_a_changed_checkpoint_gives_a_fresh_feedback_stability_result(work,
                                                                      organism_checkpoint):
    args = ("feedback-stability", "--checkpoint", "ck", "--passes", "2", "--threads", "1",
            "--no-progress")
    shutil.copytree(organism_checkpoint, work / "ck")
    assert cli(*args)[0] == 0
    old = only_run_dir(work)
    _rewrite_gate(work / "ck", seed=7)
    assert cli(*args)[0] == 0
    new = only_run_dir(work, exclude=[old])
    (work / "fresh").mkdir()
    shutil.copytree(work / "ck", work / "fresh" / "ck")
    os.chdir(work / "fresh")
    assert cli(*args)[0] == 0
    assert summary(new) == summary(only_run_dir(work / "fresh")) != summary(old)


# --------------------------------------------------------------- damaged parts
@pytest.mark.parametrize("damage, says", [
    ("truncate", "is damaged (BadZipFile); recomputing it"),
    ("swap", "belongs to another unit; recomputing it"),
])
def test_a_damaged_or_swapped_part_is_recomputed_with_one_warning(work, damage, says):
    args = (*PPL, "--windows", "4", "--run-dir", "r")
    assert cli(*args)[0] == 0
    clean = summary(work / "r")
    part = work / "r" / "parts" / "batch00001.npz"
    if damage == "truncate":
        part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    else:  # a valid part of another batch in this one's place
        shutil.copy(work / "r" / "parts" / "batch00003.npz", part)
    status, _, err = cli(*args)
    assert status == 0
    assert err.splitlines() == [f"probekit: warning: {part.relative_to(work)} {says}"]
    assert summary(work / "r") == clean
    assert cli(*args)[2] == ""  # repaired: the next rerun reuses every part silently


# --------------------------------------------------------------- model caches
@pytest.mark.parametrize("fault, reason", [
    ("corrupt", r"tokenizer\.json does not match its recorded sha256"),
    ("truncate", r"tokenizer\.json has \d+ bytes, \d+ were written"),
    ("missing-file", r"tokenizer\.json is missing"),
    ("missing-record", r"no valid probekit-cache\.json"),
    ("missing-folder", None),
])
def test_the_tiny_tokenizer_cache_is_verified_and_rebuilt(tmp_path, monkeypatch, fault,
                                                          reason):
    """The tiny models' cached artefact is their tokenizer folder (core/models.py)."""
    from probekit.core.models import load_model

    monkeypatch.setenv("PROBEKIT_CACHE_DIR", str(tmp_path))
    fresh = load_model("tiny")
    (folder,) = (tmp_path / "tokenizers").iterdir()
    assert model_cache.problem(folder) is None
    tok = folder / "tokenizer.json"
    data = tok.read_bytes()
    if fault == "corrupt":  # same size, one byte changed
        i = data.index(b'"vocab"') + 12
        tok.write_bytes(data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:])
    elif fault == "truncate":
        tok.write_bytes(data[: len(data) // 2])
    elif fault == "missing-file":
        tok.unlink()
    elif fault == "missing-record":
        (folder / model_cache.RECORD).unlink()
    else:
        shutil.rmtree(folder)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = load_model("tiny")
    said = [str(w.message) for w in caught]
    if reason is None:  # a first use: built silently
        assert said == []
    else:
        assert len(said) == 1
        assert said[0].startswith(f"the tokenizer cache {folder} is broken (")
        assert said[0].endswith("; rebuilding it")
        assert re.search(reason, said[0])
    assert model_cache.problem(folder) is None  # repaired in place
    assert again.content_hash == fresh.content_hash
    sample = "the cat sat on a mat, 42 times!"
    assert again.tokenizer(sample)["input_ids"] == fresh.tokenizer(sample)["input_ids"]
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no debris


@pytest.mark.slow
def test_the_default_model_cache_is_recorded_and_sound(monkeypatch):
    """Checks the real SmolLM2 cache in place (copying 500 MB is not worth it): the record
    exists, every file has its recorded size, and the weights' hash is the recorded one."""
    from probekit.core.models import load_model
    from probekit.paths import cache_dir

    if REAL_CACHE is None:
        monkeypatch.delenv("PROBEKIT_CACHE_DIR")
    else:
        monkeypatch.setenv("PROBEKIT_CACHE_DIR", REAL_CACHE)
    model = load_model("smollm2-135m")
    folders = [f for f in (cache_dir() / "models").glob("smollm2-135m-*")
               if (model_cache.record(f) or {}).get("content_hash") == model.content_hash]
    assert folders, "no cache folder records the loaded weights' content hash"
    assert model_cache.problem(folders[0], hashes=False) is None


# --------------------------------------------------------------- concurrent runs
def test_two_identical_runs_at_once_compute_each_part_once(work):
    args = (*PPL, "--windows", "4", "--run-dir", "r")
    first, second = spawn(*args), spawn(*args)
    (out1, err1), (out2, err2) = first.communicate(timeout=300), second.communicate(timeout=300)
    assert (first.returncode, second.returncode) == (0, 0), err1 + err2
    overall = [next(x for x in out.splitlines() if x.startswith("overall")) for out in
               (out1, out2)]
    assert overall[0] == overall[1]
    assert recorded(work / "r") == [f"batch{i:05d}" for i in range(4)]  # computed once
    for err in (err1, err2):  # at most the one waiting line, nothing else
        assert [x for x in err.splitlines() if x.strip() and "waiting for it to finish"
                not in x] == []


# --------------------------------------------------------------- bad inputs
TINY_PPL = ("perplexity", "--model", "tiny", "--text-file", "c.txt", "--windows", "1",
            "--window-tokens", "16", "--no-progress")


@pytest.fixture()
def checkpoints(work, organism_checkpoint):
    """Damaged copies of a checkpoint, by fault name."""
    out = {}
    for fault in ("random-weights", "truncated-weights", "missing-key", "garbage-config",
                  "truncated-organism"):
        ck = work / f"ck-{fault}"
        shutil.copytree(organism_checkpoint, ck)
        weights = ck / "model.safetensors"
        if fault == "random-weights":
            weights.write_bytes(np.random.default_rng(0).bytes(weights.stat().st_size))
        elif fault == "truncated-weights":
            weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        elif fault == "missing-key":
            cfg = json.loads((ck / "config.json").read_text())
            del cfg["model"]
            (ck / "config.json").write_text(json.dumps(cfg))
        elif fault == "garbage-config":
            (ck / "config.json").write_text("{\n")
        else:
            org = ck / "organism" / "model.safetensors"
            org.write_bytes(org.read_bytes()[: org.stat().st_size // 2])
        out[fault] = ck.name
    return out


BAD_INPUTS = {
    "bootstrap-0": (TINY_PPL + ("--bootstrap", "0"), r"--bootstrap must be >= 1; got 0"),
    "threads-negative": (TINY_PPL + ("--threads", "-1"), r"--threads must be >= 1; got -1"),
    "run-dir-is-a-file": (TINY_PPL + ("--run-dir", "c.txt"),
                          r"--run-dir c\.txt is a file; give a folder"),
    "run-dir-under-a-file": (TINY_PPL + ("--run-dir", "c.txt/r"),
                             r"--run-dir c\.txt/r: c\.txt is a file; give a folder"),
    "text-file-is-a-folder": (("perplexity", "--model", "tiny", "--text-file", "."),
                              r"--text-file \. is a folder; give a text file"),
    "temperature-inf": (TINY_PPL + ("--temperature", "inf"),
                        r"--temperature must be a finite number > 0; got inf"),
    "state-tracking-too-few-groups": (
        ("run", "state-tracking", "--model", "tiny", "--examples", "16", "--no-progress"),
        r"completion: 16 examples \(--examples 16\) form 2 groups, fewer than --folds 4"),
}
CHECKPOINT_FAULTS = {
    "random-weights": r"ck-random-weights/model\.safetensors is not a readable safetensors "
                      r"file \(.*\); the checkpoint is damaged",
    "truncated-weights": r"ck-truncated-weights/model\.safetensors is not a readable "
                         r"safetensors file \(.*\); the checkpoint is damaged",
    "missing-key": r"ck-missing-key/config\.json lacks 'model'; the checkpoint is damaged",
    "garbage-config": r"ck-garbage-config/config\.json is not valid JSON \(.*\); the "
                      r"checkpoint is damaged",
    "truncated-organism": r"ck-truncated-organism/organism/model\.safetensors is not a "
                          r"readable safetensors file",
}


def _one_line_error(work: Path, args, pattern: str, before: set[str]) -> None:
    status, out, err = cli(*args)
    assert status == 2, err
    assert out == ""  # nothing ran
    lines = err.splitlines()
    assert len(lines) == 1 and re.search(pattern, lines[0]), err
    assert lines[0].startswith("probekit ") and ": error: " in lines[0]
    assert {p.name for p in work.iterdir()} == before  # no run dir, nothing written


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_before_any_compute(work, case):
    args, pattern = BAD_INPUTS[case]
    _one_line_error(work, args, pattern, {p.name for p in work.iterdir()})


@pytest.mark.parametrize("fault", list(CHECKPOINT_FAULTS))
@pytest.mark.parametrize("command", ["feedback-stability", "state-tracking"])
def test_a_damaged_checkpoint_is_one_line_before_any_compute(work, checkpoints, fault,
                                                             command):
    ck = checkpoints[fault]
    args = (("feedback-stability", "--checkpoint", ck, "--passes", "2")
            if command == "feedback-stability" else
            ("run", "state-tracking", "--mechanism", "latent-feedback", "--checkpoint", ck,
             "--examples", "32"))
    _one_line_error(work, (*args, "--no-progress"), CHECKPOINT_FAULTS[fault],
                    {p.name for p in work.iterdir()})


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_a_run_dir_that_cannot_be_created_is_one_line(work):
    status, out, err = cli(*TINY_PPL, "--run-dir", "/proc/probekit-run")
    assert status == 2 and out == ""
    assert err.splitlines() == ["probekit perplexity: error: cannot create the run folder "
                                "/proc/probekit-run (No such file or directory); choose "
                                "another --run-dir"]


def test_a_local_model_folder_with_truncated_weights_is_one_line(work):
    from probekit.core.models import load_model

    m = load_model("tiny")
    m.hf_model.save_pretrained(work / "m")
    m.tokenizer.save_pretrained(work / "m")
    weights = work / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    _one_line_error(work, (*TINY_PPL, "--model", "m"), r"m/model\.safetensors",
                    {p.name for p in work.iterdir()})


def test_a_garbage_run_dir_config_is_one_line_and_left_untouched(work):
    (work / "r").mkdir()
    (work / "r" / "config.json").write_text("{not json")
    status, out, err = cli(*TINY_PPL, "--run-dir", "r")
    assert status == 2 and out == ""
    assert err.splitlines() == [
        "probekit perplexity: error: r/config.json is not valid JSON (Expecting property "
        "name enclosed in double quotes: line 1 column 2 (char 1)); delete the run folder "
        "or choose another --run-dir"]
    assert [p.name for p in (work / "r").iterdir()] == ["config.json"]


def test_lag_analysis_with_only_early_positions_reports_none_sampled(work):
    """--window-tokens 40 --max-lag 32 leaves t = 0..7, all below the early threshold:
    the late mean is None, reported as such (it crashed after all compute before)."""
    status, out, err = cli("lag-analysis", "--model", "tiny", "--text-file", "c.txt",
                           "--windows", "1", "--window-tokens", "40", "--max-lag", "32",
                           "--threads", "1", "--no-progress", "--run-dir", "r")
    assert status == 0, err
    assert "t>=10: none sampled" in out
    assert summary(work / "r")["single"]["early"]["mean_late"] is None


def test_an_unreadable_part_leaves_no_file_open(tmp_path):
    """np.load leaks its file handle when the zip is unreadable; the run dir's loader must
    not (a long resume over many damaged parts would run out of handles)."""
    import gc

    from probekit.runs import RunDir

    run = RunDir.open("cmd", {"a": 1}, path=tmp_path / "r")
    run.map([("u", 1)], lambda u: {"x": np.arange(3)}, progress=False)
    part = run.part_path("u")
    part.write_bytes(part.read_bytes()[:40])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.map([("u", 1)], lambda u: {"x": np.arange(3)}, progress=False)
        gc.collect()
    assert [w.category for w in caught] == [UserWarning]  # the damage, no ResourceWarning
