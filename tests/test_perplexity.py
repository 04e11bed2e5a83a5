"""`probekit perplexity`: the maths, the run directory, resume, and bad input."""

import json
import math
import os

import numpy as np
import pytest
import torch

from probekit.analysis.perplexity import PerplexitySummary, pct_change, perplexity
from probekit.analysis.stats import window_bootstrap
from probekit.commands.main import main


def test_perplexity_and_pct_change():
    base = np.full((2, 5), -math.log(2.0))
    rec = np.full((2, 5), -math.log(1.8))
    assert perplexity(base) == pytest.approx(2.0)
    assert pct_change(base, rec) == pytest.approx(-10.0)
    assert pct_change(base, base) == 0.0


def test_bootstrap_ci_is_seeded_and_brackets_the_estimate():
    rng = np.random.default_rng(0)
    base = rng.normal(-3, 0.3, (20, 16))
    rec = base + rng.normal(0.05, 0.02, (20, 1))  # every window gets a bit better
    s = PerplexitySummary.from_log_probs(base, rec, n_boot=500, seed=1)
    assert s.ci_low <= s.pct_change <= s.ci_high < 0
    again = PerplexitySummary.from_log_probs(base, rec, n_boot=500, seed=1)
    assert (again.ci_low, again.ci_high) == (s.ci_low, s.ci_high)
    one = window_bootstrap(np.array([-3.0]), np.array([-2.9]), np.array([1.0]))
    assert np.isnan(one["ci_low"]) and np.isnan(one["ci_high"])  # no interval for n=1


def test_summary_refuses_log_probs_of_other_shapes():
    """Base and recirculated log-probs must be the same ``[W, T-1]`` windows: zipping
    windows of different counts or lengths would compare unrelated tokens."""
    base = np.zeros((3, 4))
    with pytest.raises(ValueError, match=r"base and recirculated log-probs must have the "
                                         r"same \[windows, tokens\] shape; got \(3, 4\) "
                                         r"and \(2, 4\)"):
        PerplexitySummary.from_log_probs(base, np.zeros((2, 4)))
    with pytest.raises(ValueError, match=r"same \[windows, tokens\] shape; got \(3, 4\) "
                                         r"and \(3, 5\)"):
        PerplexitySummary.from_log_probs(base, np.zeros((3, 5)))
    with pytest.raises(ValueError, match=r"got \(12,\) and \(12,\)"):
        PerplexitySummary.from_log_probs(np.zeros(12), np.zeros(12))


ARGS = ["perplexity", "--model", "tiny-5", "--source", "3", "--destination", "1",
        "--alpha", "0.3", "--windows", "4", "--window-tokens", "24", "--batch-size", "2",
        "--bootstrap", "200", "--no-progress"]


def test_cli_end_to_end_and_resume(tmp_path, tiny_model, capsys):
    run_dir = tmp_path / "run"
    assert main(ARGS + ["--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "overall (92 predicted tokens)" in out and "95% bootstrap CI" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["n_windows"] == 4 and summary["n_tokens"] == 4 * 23
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["model"]["name"] == "tiny-5" and "torch" in manifest["versions"]
    assert manifest["machine"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    lp = np.load(run_dir / "token_log_probs.npz")
    assert lp["base"].shape == lp["rec"].shape == (4, 23)

    # The baseline is the plain model, the recirculated run is the engine's.
    from probekit import Recirculation, StepEngine

    engine = StepEngine(tiny_model)
    ids = torch.from_numpy(lp["input_ids"])
    assert np.allclose(lp["base"], engine.forward(ids).log_probs.numpy(), atol=2e-5)
    assert np.allclose(lp["rec"], engine.run(ids, Recirculation(3, 1, 0.3)).log_probs.numpy(),
                       atol=2e-5)
    assert summary["pct_change"] == pytest.approx(pct_change(lp["base"], lp["rec"]))

    # Interrupted run: one finished part survives, the other is lost. Re-running the
    # same command recomputes only the lost part and ends identical.
    parts = sorted((run_dir / "parts").glob("*.npz"))
    assert len(parts) == 2
    kept_mtime = os.stat(parts[0]).st_mtime_ns
    parts[1].unlink()
    assert main(ARGS + ["--run-dir", str(run_dir)]) == 0
    assert os.stat(parts[0]).st_mtime_ns == kept_mtime
    again = json.loads((run_dir / "summary.json").read_text())
    assert again["pct_change"] == summary["pct_change"]
    assert again["per_window"] == summary["per_window"]


@pytest.mark.parametrize("extra,message", [
    (["--alpha", "1.5"], "alpha must lie in [0, 1]; got 1.5"),
    (["--source", "1", "--destination", "3"], "source (1) must be a deeper block than"),
    (["--source", "7"], "--source 7 is out of range: this model has 5 blocks"),
    (["--window-tokens", "4096"], "4096"),
    (["--windows", "0"], "--windows must be >= 1; got 0"),
    (["--temperature", "0"], "--temperature must be a finite number > 0; got 0.0"),
    (["--temperature", "inf"], "--temperature must be a finite number > 0; got inf"),
])
def test_cli_bad_input_is_one_clear_line(tmp_path, tiny_model, capsys, extra, message):
    assert main(ARGS + extra + ["--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()  # nothing was written


def test_cli_text_file_errors(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    for path in (empty, tmp_path / "missing.txt"):
        assert main(ARGS + ["--text-file", str(path), "--run-dir", str(tmp_path / "r")]) == 2
        assert str(path.name) in capsys.readouterr().err
