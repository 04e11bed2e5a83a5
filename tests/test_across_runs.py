"""Several runs side by side (probekit.analysis.across_runs) and what the headline says
about them (probekit.commands.state_tracking's sentences), plus the organism's batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from probekit.analysis.across_runs import combine_runs, mechanism_of, read_summary
from probekit.analysis.headline import headline_sentences, headline_table


def summary(acc_none, acc_full, model_acc=0.9, chance=0.5, causal=None):
    def regime(acc):
        return {"probe": {"accuracy_mean": list(acc), "accuracy_std": [0.01] * len(acc),
                          "chance": chance},
                "model_accuracy": model_acc, "causal": causal}

    return {"mechanism": {"mechanism": "latent-feedback"}, "notes": [], "wall_seconds": 2.0,
            "compute_seconds": 3.0,
            "model": {"name": "organism", "n_blocks": len(acc_none) - 1},
            "datasets": {"memory": {"task": "memory", "title": "memory", "condition": {},
                                    "n_examples": 64, "n_groups": 32, "lengths": [20],
                                    "regimes": {"none": regime(acc_none),
                                                "full": regime(acc_full)}}}}


def test_runs_of_one_mechanism_combine_into_mean_std_min_max():
    runs = {"latent-feedback-seed0": summary([0.5, 0.6, 0.9], [1.0, 0.9, 0.9], 0.8,
                                             causal={"a": 1}),
            "latent-feedback-seed1": summary([0.5, 0.8, 0.9], [0.96, 0.9, 0.7], 1.0),
            "recirculation": summary([0.5, 0.7, 1.0], [0.5, 0.7, 1.0])}
    out = combine_runs(runs)
    lf = out["mechanisms"]["latent-feedback"]
    assert lf["runs"] == ["latent-feedback-seed0", "latent-feedback-seed1"] and lf["n_runs"] == 2
    full = lf["datasets"]["memory"]["regimes"]["full"]
    assert full["probe_mean"] == pytest.approx([0.98, 0.9, 0.8])
    assert full["probe_spread"] == pytest.approx([np.std([1.0, 0.96], ddof=1), 0.0,
                                                  np.std([0.9, 0.7], ddof=1)])
    assert full["spread_is"] == "std over runs"
    assert (full["probe_min"], full["probe_max"]) == ([0.96, 0.9, 0.7], [1.0, 0.9, 0.9])
    assert full["model_accuracy_per_run"] == [0.8, 1.0] and full["model_accuracy_min"] == 0.8
    assert full["causal_per_run"] == [{"a": 1}, None]
    assert (lf["wall_seconds"], lf["compute_seconds"]) == (4.0, 6.0)
    one = out["mechanisms"]["recirculation"]["datasets"]["memory"]["regimes"]["none"]
    assert one["probe_spread"] == [0.01] * 3 and one["spread_is"] == "std over folds"
    assert out["runs"] is not runs and out["runs"] == runs


def test_read_summary_refuses_a_missing_or_old_summary_in_one_line(tmp_path):
    path = tmp_path / "summary.json"
    with pytest.raises(ValueError, match=r"^[^\n]*summary.json: cannot read it \(.*\); "
                                         r"run make-it\.sh first$"):
        read_summary(path, "make-it.sh")
    path.write_text('{"wall_seconds": 3.0}')
    with pytest.raises(ValueError) as err:
        read_summary(path, "make-it.sh")
    assert str(err.value) == (f"{path}: written by an older probekit; rerun make-it.sh "
                              f"(its finished parts are reused)")
    path.write_text('{"compute_seconds": 2.5}')
    assert read_summary(path, "make-it.sh") == {"compute_seconds": 2.5}


def test_mechanism_of_strips_only_a_seed_suffix():
    assert mechanism_of("latent-feedback-seed12") == "latent-feedback"
    assert mechanism_of("latent-feedback") == "latent-feedback"
    assert mechanism_of("recirculation") == "recirculation"
    assert mechanism_of("a-seedless") == "a-seedless"


@pytest.mark.parametrize("none, full, says", [
    ([0.5, 0.6], [1.0, 0.9], "1.00 under full prefill: the fed-back state carries the task "
                             "state into the input"),
    ([0.5, 0.6], [0.52, 0.61], "full prefill changes no depth's accessibility by 0.05 or more"),
    ([0.5, 0.6], [0.7, 0.6], "the largest change is +0.20 at depth 0"),
])
def test_each_panel_gets_one_sentence_from_its_numbers(none, full, says):
    lines = headline_sentences(combine_runs({"latent-feedback-seed0": summary(none, full)}))
    assert lines[0] == headline_table(combine_runs({"latent-feedback-seed0":
                                                    summary(none, full)}))
    (sentence,) = [s for s in lines if s.startswith("latent feedback (")]
    assert sentence.startswith("latent feedback (organism, 1 blocks), memory: the depth-0 "
                               "probe reads the state with 0.50 accuracy under standard "
                               "prefill (chance 0.50)")
    assert says in sentence and sentence.endswith(".")


def test_the_table_shows_the_range_over_runs():
    runs = {"latent-feedback-seed0": summary([0.5, 0.6], [1.0, 0.9]),
            "latent-feedback-seed1": summary([0.5, 0.6], [0.9, 0.9])}
    table = headline_table(combine_runs(runs))
    row = [line for line in table.splitlines() if " full " in line][0]
    assert "0.95 [0.90,1.00]" in row


def test_organism_batches_keep_to_the_token_budget():
    from probekit.training.data import TrainData

    rows = [[1] * n for n in (5, 5, 6, 40, 41, 300, 1000)]
    data = TrainData(rows, [], pad_id=0, bucket=True, max_tokens=100)
    g = torch.Generator().manual_seed(0)
    drawn = set()
    for _ in range(200):
        ids, valid = data.batch(4, g)
        assert ids.numel() <= 100 or len(ids) == 1
        assert 1 <= len(ids) <= 4
        drawn |= {int(n) for n in valid.sum(1) + 1}  # row lengths identify the rows here
    assert drawn == {len(r) for r in rows}  # the longest rows too
    unbounded = TrainData(rows, [], pad_id=0, bucket=True)
    sizes = {len(unbounded.batch(4, g)[0]) for _ in range(100)}
    assert max(sizes) == 4 and min(sizes) < 4  # whole windows, shorter at the long end


def test_short_and_long_batches_draw_every_row_of_their_kind_and_no_other_with_one_draw():
    """batch(rows="short") draws from the rows of at most short_len tokens only, rows="long"
    from the others only, every one of them, and each takes as much from the generator as
    batch() does: a choice of rows at one step leaves the random streams of the others
    alone."""
    from probekit.training.data import TrainData

    rows = [[1] * n for n in (5, 5, 6, 7, 40, 41, 300)]
    for bucket in (True, False):
        data = TrainData(rows, [], pad_id=0, bucket=bucket, max_tokens=100, short_len=6)
        assert data.n_short == 3
        drawn = {"short": set(), "long": set()}
        for seed in range(100):
            h = torch.Generator().manual_seed(seed)
            data.batch(2, h)
            for kind in drawn:
                g = torch.Generator().manual_seed(seed)
                ids, valid = data.batch(2, g, kind)
                assert torch.equal(g.get_state(), h.get_state())
                drawn[kind] |= {int(n) for n in valid.sum(1) + 1}
        assert drawn == {"short": {5, 6}, "long": {7, 40, 41, 300}}
    assert TrainData(rows, [], pad_id=0).n_short == len(rows)  # no short_len: every row


def test_training_rows_follow_the_task_and_length_shares():
    from probekit.training.organism import (
        TASK_SHARES,
        TRAIN_DISTRACTORS,
        fit_tokenizer,
        held_out_pairs,
        training_examples,
    )

    tok = fit_tokenizer()
    rows = training_examples(tok, n_examples=700)
    texts = tok.batch_decode(rows)
    completion = [t for t in texts if t.startswith("required")]
    assert len(rows) == 700
    shares = TASK_SHARES["completion"] / (TASK_SHARES["completion"] + TASK_SHARES["memory"])
    assert len(completion) == pytest.approx(700 * shares, abs=4)
    nulls = np.array([t.count("+=") for t in completion])
    total = sum(TRAIN_DISTRACTORS.values())
    for d, w in TRAIN_DISTRACTORS.items():
        assert (nulls == d).mean() == pytest.approx(w / total, abs=0.02)
    pairs = {frozenset(map(int, (t.split()[2], t.split()[5]))) for t in completion}
    pairs = {p for p in pairs if len(p) == 2}
    assert len(pairs) > 200  # fresh numeral pairs throughout, not a few hundred reused
    assert not pairs & held_out_pairs(tok)


def test_long_rows_multiplies_the_share_of_the_long_lengths_only():
    """--long-rows 4: the rows with 64-256 null updates come four times as often (against
    the other lengths); 1 is the default mix, row for row."""
    from probekit.training.organism import (
        LONG_FROM,
        TRAIN_DISTRACTORS,
        fit_tokenizer,
        train_distractors,
        training_examples,
    )

    assert train_distractors(1.0) == TRAIN_DISTRACTORS
    weights = train_distractors(4)
    assert weights == {d: 4 * w if d >= LONG_FROM else w for d, w in TRAIN_DISTRACTORS.items()}
    tok = fit_tokenizer()
    assert training_examples(tok, n_examples=300, distractors=train_distractors(1.0)) == \
        training_examples(tok, n_examples=300)
    texts = tok.batch_decode(training_examples(tok, n_examples=900, distractors=weights))
    nulls = np.array([t.count("+=") for t in texts if t.startswith("required")])
    total = sum(weights.values())
    for d, w in weights.items():
        assert (nulls == d).mean() == pytest.approx(w / total, abs=0.02)
    assert (nulls >= LONG_FROM).mean() == pytest.approx(12 / 44, abs=0.03)  # 3/35 by default
