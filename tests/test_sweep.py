"""Layer sweeps (probekit/analysis/sweep.py, pairs.py, mechanisms/rowwise.py, commands/sweep.py):
batched cells, pair lists, resuming, summaries, the command."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json

import numpy as np
import pytest
import torch
from engine_helpers import random_ids

from probekit.analysis import sweep
from probekit.analysis.pairs import make_pairs
from probekit.analysis.perplexity import pct_change
from probekit.analysis.sweep import Cell, make_cells, plan_groups
from probekit.mechanisms.looping import Looping
from probekit.mechanisms.rowwise import RowwiseRecirculation
from probekit.runs import RunDir

torch.set_num_threads(1)
TEXT = ("Recirculation mixes a deep layer's residual into a shallow layer after every token, "
        "and the upper stack runs again so that later tokens see refined keys and values. ")


# The sweep's schemes as docs/commands/sweep.md defines them, written out here (not read
# from probekit.analysis.sweep.SCHEMES): convex = ratio norm, beta = 1 - alpha; beta1 = ratio
# norm, beta = 1; none = no norm, beta = 1 - alpha.
SCHEME_FLAGS = {"convex": dict(norm="ratio", beta=None), "beta1": dict(norm="ratio", beta=1.0),
                "none": dict(norm="none", beta=None)}


def test_rowwise_rows_equal_one_cell_runs(tiny_model, tiny_engine):
    """Each batch row of a packed run equals that cell's own Recirculation run, across
    destinations (rows whose destination is above the lowest one), schemes and a ramp; and
    the independent reference (probekit.mechanisms.reference) of the same recirculation."""
    from probekit.mechanisms.recirculation import Recirculation
    from probekit.mechanisms.reference import reference_recirculation

    ids = random_ids(2, 14)
    cells = [Cell(4, 2, 0.3, "convex"), Cell(2, 0, 0.5, "none"), Cell(3, 1, 0.2, "beta1"),
             Cell(4, 3, 0.4, "convex")]
    rows = [c.recirculation(ramp=3) for c in cells for _ in range(2)]
    packed = tiny_engine.run(torch.cat([ids] * len(cells)), RowwiseRecirculation(rows)).log_probs
    plain = tiny_engine.forward(ids).log_probs
    for i, c in enumerate(cells):
        rec = Recirculation(c.source, c.destination, c.alpha, ramp=3, **SCHEME_FLAGS[c.scheme])
        alone = tiny_engine.run(ids, rec).log_probs
        assert (packed[2 * i : 2 * i + 2] - alone).abs().max() <= 1e-5
        assert (alone - plain).abs().max() > 1e-3  # each cell really recirculates
        for r in range(2):
            ref = reference_recirculation(tiny_model, ids[r].tolist(), rec)
            assert (packed[2 * i + r] - ref).abs().max() <= 2e-5, (c, r)


def test_rowwise_validation():
    with pytest.raises(ValueError, match="same ramp"):
        RowwiseRecirculation([Cell(3, 1, 0.1, "convex").recirculation(0),
                              Cell(3, 1, 0.1, "convex").recirculation(2)])
    with pytest.raises(ValueError, match="unknown scheme 'ratio'"):
        Cell(3, 1, 0.1, "ratio")
    with pytest.raises(ValueError, match=r"source \(1\) must be a deeper block"):
        Cell(1, 3, 0.1, "convex")


def test_make_pairs():
    assert len(make_pairs(6, "all")) == 15
    assert make_pairs(4, "max-gap", max_gap=1) == [(1, 0), (2, 1), (3, 2)]
    gap = make_pairs(30, "max-gap", max_gap=3, destinations=range(2, 15, 4))
    assert {d for _, d in gap} == {2, 6, 10, 14} and all(1 <= s - d <= 3 for s, d in gap)
    # sorted by destination, source
    assert make_pairs(30, "list", listed=[(11, 4), (5, 4)]) == [(5, 4), (11, 4)]
    assert make_pairs(6, "all", sources=range(5, 6)) == [(5, d) for d in range(5)]
    coarse = make_pairs(30, "max-gap", step=3)  # the CLI default grid (model-relative)
    assert len(coarse) == 30 and (4, 1) in coarse and (28, 25) in coarse
    assert all(d % 3 == 1 and (s - d) % 3 == 0 and s - d <= 12 for s, d in coarse)
    # explicit: no grid
    assert make_pairs(30, "list", listed=[(11, 4), (12, 4)], step=3) == [(11, 4), (12, 4)]
    with pytest.raises(ValueError, match="pair 4-11: need 0 <= destination < source"):
        make_pairs(30, "list", listed=[(4, 11)])
    with pytest.raises(ValueError, match="expected one of all, max-gap, list"):
        make_pairs(30, "some")
    with pytest.raises(ValueError, match="selects no pair"):
        make_pairs(30, "max-gap", max_gap=2, destinations=range(40, 41))


def test_default_grid_is_model_relative():
    """The default grid (step ~L/10, max gap 4 steps) is SmolLM2's long-standing 30-pair grid
    on 30 blocks and every near-diagonal pair on a 4-block tiny model."""
    from probekit.analysis.pairs import default_max_gap, default_step

    assert (default_step(30), default_max_gap(30)) == (3, 12)
    assert (default_step(4), default_max_gap(4)) == (1, 4)
    assert make_pairs(4, "max-gap", step=default_step(4)) == make_pairs(4, "all")


def test_plan_groups_packs_units_in_a_fixed_order():
    cells = make_cells([(3, 1), (2, 0)], [0.1, 0.2], ["convex"])
    assert [c.destination for c in cells] == [0, 0, 1, 1]
    groups = plan_groups(cells, n_windows=5, batch_size=2, rows=4)
    # 4 cells x window batches (0,2) (2,4) (4,5): at most 4 rows per group.
    assert all(sum(w1 - w0 for _, w0, w1 in g) <= 4 for g in groups)
    assert [(c.key, w0) for g in groups for c, w0, _ in g] == [
        (c.key, w0) for c in cells for w0 in (0, 2, 4)]
    assert groups == plan_groups(cells, n_windows=5, batch_size=2, rows=4)


class Interrupt(Exception):
    pass


def test_sweep_resumes_to_the_same_numbers(tiny_engine, tmp_path):
    """A sweep killed midway and restarted ends identical to an uninterrupted one, and
    the restart does not redo finished groups."""
    windows = random_ids(3, 12, seed=4)
    cells = make_cells(make_pairs(tiny_engine.n_blocks, "max-gap", max_gap=2), [0.2, 0.4],
                       ["convex", "none"])
    loops = [(3, 1), (4, 2)]
    kw = dict(looping_pairs=loops, batch_size=2, rows=6)
    n_groups = len(plan_groups(cells, 3, 2, 6))
    assert n_groups >= 4

    full = sweep.run_sweep(tiny_engine, windows, cells, RunDir(tmp_path / "full"), **kw)

    def stop_after_two(gi):  # killed while computing the third group
        if gi == 2:
            raise Interrupt("killed while computing group 2")

    part = RunDir(tmp_path / "part")
    with pytest.raises(Interrupt, match="killed while computing group 2"):
        sweep.run_sweep(tiny_engine, windows, cells, part, on_group=stop_after_two, **kw)
    redone = []
    resumed = sweep.run_sweep(tiny_engine, windows, cells, part, on_group=redone.append, **kw)
    assert redone == list(range(2, n_groups))
    assert resumed.keys() == full.keys()
    for key in full:
        assert np.array_equal(resumed[key], full[key]), key
    s_full = sweep.summarize_sweep(full, cells, loops)
    s_resumed = sweep.summarize_sweep(resumed, cells, loops)
    assert json.dumps(s_full, sort_keys=True) == json.dumps(s_resumed, sort_keys=True)

    # The saved numbers are the real thing: a cell and a looping pair recomputed alone.
    c = cells[-1]
    alone = tiny_engine.run(windows, c.recirculation()).log_probs.numpy()
    assert np.abs(full[c.key] - alone).max() <= 1e-5
    loop = Looping(2, 4).run(tiny_engine, windows).log_probs.numpy()
    assert np.abs(full[sweep.loop_key(4, 2)] - loop).max() <= 1e-5


def test_summarize_sweep_percent_change_and_best_pair():
    base = np.log(np.full((2, 5), 0.1))
    cells = [Cell(3, 1, 0.1, "convex"), Cell(2, 1, 0.1, "convex"), Cell(3, 1, 0.2, "beta1")]
    results = {"baseline": base,
               cells[0].key: base + 0.1,    # higher log p: lower perplexity
               cells[1].key: base - 0.05,
               cells[2].key: base + 0.2,
               sweep.loop_key(3, 1): base - 0.3, sweep.loop_key(2, 1): base}
    s = sweep.summarize_sweep(results, cells, [(3, 1), (2, 1)])
    assert s["percent_change"][cells[0].key] == pytest.approx(100 * (np.exp(-0.1) - 1))
    assert s["percent_change"][cells[1].key] == pct_change(base, base - 0.05)
    want = pytest.approx(100 * (np.exp(-0.2) - 1))
    assert s["best"] == {"source": 3, "destination": 1, "alpha": 0.2, "scheme": "beta1",
                         "percent_change": want, "per_window": [want, want]}
    convex = next(p for p in s["panels"] if p["scheme"] == "convex")
    assert s["sources"] == [2, 3] and s["destinations"] == [1]
    assert convex["matrix"] == [[pytest.approx(100 * (np.exp(0.05) - 1))],
                                [pytest.approx(100 * (np.exp(-0.1) - 1))]]
    assert s["looping"]["best"] == {"l2": 2, "l1": 1, "percent_change": 0.0,
                                    "per_window": [0.0, 0.0]}


def test_cli_sweep_end_to_end(tmp_path, capsys):
    from probekit.commands.main import main

    run_dir = tmp_path / "sweep"
    text = tmp_path / "text.txt"  # a small file: tokenising the wiki corpus takes seconds
    text.write_text(TEXT)
    argv = ["sweep", "--model", "tiny", "--text-file", str(text), "--pairs", "list",
            "--pair-list", "2-0", "3-1", "--alphas", "0.1", "0.3",
            "--norms", "convex", "beta1", "--looping", "--windows", "2", "--window-tokens", "12",
            "--run-dir", str(run_dir), "--no-progress"]
    assert main(argv) == 0
    s = json.loads((run_dir / "summary.json").read_text())
    assert len(s["percent_change"]) == 8 and len(s["panels"]) == 4
    assert s["looping"]["matrix"][0][0] is not None
    assert (run_dir / "sweep.png").stat().st_size > 10_000
    assert (run_dir / "looping.png").stat().st_size > 10_000
    out = capsys.readouterr().out
    assert f"{s['best']['percent_change']:+.3f}%" in out


def test_cli_sweep_on_tiny_with_default_layers(tmp_path, capsys):
    """No pair or layer flag: the model-relative default grid runs on the 4-block tiny model
    (every pair with s - d <= 4, i.e. all six), and the summary says which pairs it took."""
    from probekit.analysis.pairs import make_pairs
    from probekit.commands.main import main

    run_dir = tmp_path / "sweep"
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    argv = ["sweep", "--model", "tiny", "--text-file", str(text), "--windows", "1",
            "--window-tokens", "8", "--run-dir", str(run_dir), "--no-progress"]
    assert main(argv) == 0
    s = json.loads((run_dir / "summary.json").read_text())
    assert [tuple(p) for p in s["config"]["pairs"]] == make_pairs(4, "all")
    assert len(s["percent_change"]) == 6 and s["config"]["schemes"] == ["convex"]
    assert "6 cells (6 pairs x 1 alphas x 1 schemes)" in capsys.readouterr().out


@pytest.mark.parametrize("flags,message", [
    (["--norms", "convex", "ratio"],
     "probekit sweep: error: --norms: 'ratio' is not one of convex, beta1, none"),
    (["--alphas", "0.1", "x"], "probekit sweep: error: --alphas"),
    (["--alphas", "0.1", "1.5"],
     "probekit sweep: error: --alphas: alpha must lie in [0, 1]; got 1.5"),
    (["--alphas", "0.1", "0.1"], "probekit sweep: error: --alphas lists 0.1 twice"),
    (["--pairs", "some"],
     "probekit sweep: error: --pairs: 'some' is not one of all, max-gap, list"),
    (["--pairs", "list"],
     "probekit sweep: error: --pairs list needs --pair-list, e.g. --pair-list 11-4 12-4"),
    (["--pair-list", "3-1"],
     "probekit sweep: error: --pair-list needs --pairs list (got --pairs max-gap)"),
    (["--pairs", "list", "--pair-list", "1-3"],
     "probekit sweep: error: --pair-list 1-3: need destination < source "
     "(write source-destination)"),
    (["--pairs", "list", "--pair-list", "3:1"],
     "probekit sweep: error: --pair-list '3:1': expected source-destination, e.g. 11-4"),
    (["--pairs", "all", "--max-gap", "2"],
     "probekit sweep: error: --max-gap applies to --pairs max-gap (got --pairs all)"),
    (["--step", "0"], "probekit sweep: error: --step must be >= 1 (1 = every pair); got 0"),
    (["--destinations", "2-5"],
     "probekit sweep: error: --destinations '2-5': expected a:b or a:b:step (b exclusive), "
     "e.g. 2:15:4"),
    (["--rows", "0"], "probekit sweep: error: --rows must be >= 1; got 0"),
    # Checked against the model's depth, still before the run folder exists.
    (["--pairs", "list", "--pair-list", "9-1"],
     "probekit sweep: error: pair 9-1: need 0 <= destination < source <= 3 "
     "(write source-destination)"),
    (["--destinations", "7:9"],
     "probekit sweep: error: --pairs max-gap with --step 1 and the --destinations/--sources "
     "filters selects no pair on a model of 4 blocks"),
])
def test_cli_sweep_bad_input(tmp_path, capsys, flags, message):
    from probekit.commands.main import main

    assert main(["sweep", "--model", "tiny", "--run-dir", str(tmp_path / "x"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and len(err.splitlines()) == 1, err
    assert not (tmp_path / "x").exists()
