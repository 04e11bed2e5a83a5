"""Part-of-speech attribution (probekit/analysis/pos_attribution.py, the pos-attribution
command) and its tagging context."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json
import math

import numpy as np
import pytest
import torch

from probekit.analysis.pos_attribution import (
    UNIVERSAL_TAGS,
    WindowTags,
    control_rng,
    count_matched_control,
    parse_tags,
    score_selective,
    selective_changes,
    tag_changes,
)
from probekit.analysis.stats import window_bootstrap
from probekit.commands import main as cli
from probekit.core.engine import Recurrence, StepEngine
from probekit.data import postag
from probekit.data.corpora import Document, make_windows
from probekit.mechanisms.recirculation import Recirculation
from probekit.mechanisms.reference import reference_recirculation
from probekit.mechanisms.regimes import exact_chunks

torch.set_num_threads(1)
ATOL = 2e-5

TEXT = """The old dogs run quickly across the green fields. Two cats sleep quietly in the warm sun.

She carefully wrote three long letters to her friends, and they answered happily. The \
children played with their new toys while the parents talked.

Many scientists believe that small changes can produce large effects. It's 3.14, or \
roughly so, and the newest models don't always agree.
"""


def wt(universal, fine=None) -> WindowTags:
    return WindowTags(np.array(universal, dtype="<U8"), np.array(fine or universal, dtype="<U8"))


# ---------------------------------------------------------------- exact sparse schedule
# (exact_chunks itself is pinned in tests/test_regimes.py)
def run_sparse(engine, ids, rec, mask):
    """The selective runs' schedule: chunks that end at the masked positions."""
    return engine.run(ids, rec, mask=mask, block_size=exact_chunks(mask))


@pytest.mark.parametrize("rec", [
    Recirculation(3, 1, alpha=0.5),
    Recirculation(4, 0, alpha=0.3, ramp=5),
    Recirculation(3, 1, alpha=0.4, beta=1.0, iterations=2),
], ids=repr)
def test_sparse_schedule_equals_token_by_token(tiny_engine, rec):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (3, 24), generator=g)
    mask = torch.rand(3, 24, generator=g) < 0.2  # rows differ
    mask[2] = False  # a row with nothing recirculated
    exact = tiny_engine.run(ids, rec, mask=mask).log_probs
    fast = run_sparse(tiny_engine, ids, rec, mask).log_probs
    assert torch.allclose(fast, exact, atol=ATOL)
    plain = tiny_engine.forward(ids).log_probs
    assert (exact[:2] - plain[:2]).abs().max() > 1e-3  # the masks do change the model
    assert torch.allclose(exact[2], plain[2], atol=ATOL)
    # blockwise chunks that do not end at the masked positions are NOT exact
    blockwise = tiny_engine.run(ids, rec, mask=mask, block_size=6).log_probs
    assert (blockwise[:2] - exact[:2]).abs().max() > 1e-4


def test_sparse_schedule_equals_the_slow_reference(tiny_model, tiny_engine):
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(4))
    mask = torch.zeros(1, 20, dtype=torch.bool)
    mask[0, [2, 3, 9, 15]] = True
    rec = Recirculation(3, 1, alpha=0.5)
    ref = reference_recirculation(tiny_model, ids[0].tolist(), rec, mask=mask[0].tolist())
    assert torch.allclose(run_sparse(tiny_engine, ids, rec, mask).log_probs[0], ref, atol=ATOL)


def test_score_selective_runs_the_tag_and_its_control_exactly(tiny_engine):
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(5))
    tags = [wt(["", "NOUN", "VERB", "", "DET", "NOUN", "ADV", "NOUN", "ADP", ""]),
            wt(["NOUN", "", "VERB", "ADJ", "NOUN", "", "DET", "ADV", "ADP", "VERB"])]
    rec = Recirculation(3, 1, alpha=0.5)
    out = score_selective(tiny_engine, ids, rec, tags, [4, 7], "NOUN", seed=3)
    assert (out["mask"] == np.stack([t.has("NOUN") for t in tags])).all()
    for j, (t, i) in enumerate(zip(tags, [4, 7], strict=True)):  # seeded by window index
        want = count_matched_control(t.has("NOUN"), t.tagged, control_rng(3, i, "NOUN"))
        assert (out["control"][j] == want).all()
    for name, m in (("tag", out["mask"]), ("random", out["control"])):
        exact = tiny_engine.run(ids, rec, mask=torch.from_numpy(m)).log_probs.numpy()
        assert out[name].shape == (2, 9) and np.allclose(out[name], exact, atol=ATOL)


def test_score_selective_refuses_other_recurrences(tiny_engine):
    with pytest.raises(TypeError, match="exact only for Recirculation"):
        score_selective(tiny_engine, torch.zeros(1, 4, dtype=torch.long), Recurrence(),
                        [wt(["NOUN"] * 4)], [0], "NOUN")


# ---------------------------------------------------------------- count-matched controls
def test_count_matched_control_same_count_same_window():
    tags = wt(["", "NOUN", "VERB", "", "DET", "NOUN", "ADV", "NOUN", "ADP", ""])
    mask = tags.has("NOUN")
    control = count_matched_control(mask, tags.tagged, control_rng(0, 3, "NOUN"))
    assert control.sum() == mask.sum() == 3
    assert not (control & ~tags.tagged).any()  # never a white-space / BOS token
    again = count_matched_control(mask, tags.tagged, control_rng(0, 3, "NOUN"))
    assert (again == control).all()  # seeded by (seed, window, tag) alone
    draws = {tuple(np.flatnonzero(count_matched_control(mask, tags.tagged,
                                                         control_rng(s, 3, "NOUN"))))
             for s in range(20)}
    assert len(draws) > 5  # it is random across seeds
    assert count_matched_control(np.zeros(10, bool), tags.tagged,
                                 control_rng(0, 0, "X")).sum() == 0
    with pytest.raises(ValueError, match="every position of tag_mask must be a candidate"):
        count_matched_control(np.eye(10, dtype=bool)[0], tags.tagged, control_rng(0, 0, "X"))


def test_window_tags_has_and_noun_number():
    tags = wt(["", "NOUN", "NOUN", "VERB"], ["", "NOUN.sg", "NOUN.pl", "VERB"])
    assert tags.has("NOUN").tolist() == [False, True, True, False]
    assert tags.has("NOUN.pl").tolist() == [False, False, True, False]
    assert tags.has("VERB").tolist() == [False, False, False, True]
    assert tags.tagged.tolist() == [False, True, True, True]


# ---------------------------------------------------------------- statistics
def test_tag_changes_attribute_the_predicted_token():
    # tokens:     x0      x1      x2      x3     x4
    tags = [wt(["NOUN", "VERB", "NOUN", "ADJ", "VERB"]),
            wt(["VERB", "NOUN", "", "NOUN", "ADJ"])]
    # log-probs of x1..x4 (entry t scores x[t+1])
    base = np.array([[-1.0, -2.0, -3.0, -4.0], [-2.0, -1.0, -5.0, -2.0]])
    rec = np.array([[-0.5, -2.5, -3.0, -3.0], [-2.0, -0.5, -4.0, -2.5]])
    rows = {r["tag"]: r for r in tag_changes(base, rec, tags, ["NOUN", "VERB", "ADJ", "DET"],
                                             n_boot=50)}
    # NOUN is predicted at window 0 entry 1 (x2) and window 1 entries 0 (x1), 2 (x3)
    noun_delta = ((-2.0 + -2.0 + -5.0) - (-2.5 + -2.0 + -4.0)) / 3
    assert rows["NOUN"]["n_tokens"] == 3 and rows["NOUN"]["n_windows"] == 2
    assert rows["NOUN"]["change"] == pytest.approx(100 * math.expm1(noun_delta))
    assert rows["NOUN"]["ppl_base"] == pytest.approx(math.exp(9 / 3))
    assert rows["VERB"]["n_tokens"] == 2  # x1 and x4 of window 0; x0 is never predicted
    assert rows["VERB"]["change"] == pytest.approx(100 * math.expm1(((-1 - 4) - (-0.5 - 3)) / 2))
    assert rows["ADJ"]["n_tokens"] == 2
    assert rows["DET"]["n_tokens"] == 0 and rows["DET"]["change"] is None
    assert rows["all"]["n_tokens"] == 8
    assert rows["all"]["change"] == pytest.approx(100 * math.expm1(base.mean() - rec.mean()))


def test_window_bootstrap_intervals():
    rng = np.random.default_rng(1)
    base = -rng.uniform(1, 3, (12, 2))
    rec = base + rng.normal(0.05, 0.2, (12, 2))
    count = np.ones((12, 2))
    out = window_bootstrap(base, rec, count, n_boot=400, seed=0)
    assert ((out["ci_low"] <= out["change"]) & (out["change"] <= out["ci_high"])).all()
    assert (out["ci_high"] - out["ci_low"] > 0.5).all()
    # identical windows: every resample is the same, the interval has zero width
    same = window_bootstrap(np.full((5, 1), -2.0), np.full((5, 1), -1.5), np.ones((5, 1)))
    assert same["ci_low"][0] == pytest.approx(same["ci_high"][0])
    assert same["change"][0] == pytest.approx(100 * math.expm1(-0.5))
    # one window: no interval
    assert np.isnan(window_bootstrap(base[:1], rec[:1], count[:1])["ci_low"]).all()
    # a tag present in one window of 6: resamples without it are dropped, not NaN-poisoned
    rare = np.zeros((6, 1))
    rare[0] = 1
    out = window_bootstrap(-rare, -0.5 * rare, rare, n_boot=300)
    assert 0 < out["dropped"][0] < 300 and out["ci_low"][0] == pytest.approx(out["change"][0])
    # equal seeds, equal resamples: statistics of one run are paired
    a = window_bootstrap(base[:, :1], rec[:, :1], count[:, :1], n_boot=20, seed=7)
    b = window_bootstrap(base, rec, count, n_boot=20, seed=7)
    for k in ("ci_low", "ci_high"):
        assert np.allclose(a[k][0], b[k][0], rtol=0, atol=1e-12)


def test_selective_changes_difference_is_paired():
    rng = np.random.default_rng(0)
    base = -rng.uniform(1, 3, (10, 15))
    tag = base + 0.1  # every token better by 0.1 nats
    rand = base.copy()
    out = selective_changes(base, tag, rand, 42, "ADV", n_boot=200)
    assert out["tag_change"] == pytest.approx(100 * math.expm1(-0.1))
    assert out["random_change"] == pytest.approx(0.0, abs=1e-9)
    assert out["difference"] == pytest.approx(out["tag_change"])
    # a constant shift per token: every resample gives the same difference
    assert out["difference_ci_low"] == pytest.approx(out["difference_ci_high"])
    assert out["n_recirculated"] == 42


def test_plot_sorts_tags_and_leaves_out_rare_ones():
    from probekit.plots.pos_attribution import plot_tag_changes

    rows = [{"tag": "all", "n_tokens": 100, "change": -1.0, "ci_low": -2.0, "ci_high": 0.0},
            {"tag": "ADV", "n_tokens": 30, "change": 1.0, "ci_low": None, "ci_high": None},
            {"tag": "X", "n_tokens": 3, "change": -12.0, "ci_low": -30.0, "ci_high": 0.0},
            {"tag": "VERB", "n_tokens": 50, "change": -2.0, "ci_low": -3.0, "ci_high": -1.0},
            {"tag": "DET", "n_tokens": 0, "change": None, "ci_low": None, "ci_high": None}]
    ax = plot_tag_changes(rows, "title").axes[0]
    assert [t.get_text().split("\n")[0] for t in ax.get_xticklabels()] == ["VERB", "ADV"]
    assert [round(p.get_height(), 6) for p in ax.patches] == [-2.0, 1.0]
    assert "not shown (< 20 tokens): X (3)" in ax.get_xlabel()


def test_parse_tags():
    assert parse_tags("ADV, DET", noun_number=False) == ("ADV", "DET")
    assert parse_tags("none", noun_number=True) == ()
    assert parse_tags("all", noun_number=False) == UNIVERSAL_TAGS
    assert parse_tags("all", noun_number=True)[-2:] == ("NOUN.sg", "NOUN.pl")
    with pytest.raises(ValueError, match=r"unknown tag\(s\) 'ADVERB'; give a comma-separated"):
        parse_tags("ADV,ADVERB", noun_number=False)
    with pytest.raises(ValueError, match="lists a tag twice"):
        parse_tags("ADV,ADV", noun_number=False)


# ---------------------------------------------------------------- tagging in context
def test_window_tags_use_the_document_context(tiny_model):
    text = "Fish swim. The old man can fish well.\n\nRecords show that he records every trip."
    windows = make_windows([Document("t", text)], tiny_model.tokenizer, 20, None, bos=False)
    words = postag.tag_text(text)
    for w in windows:
        index = postag.align_tokens(w.char_spans, [(x.start, x.end) for x in words])
        whole_document = [words[i].universal if i >= 0 else None for i in index]
        assert postag.token_tags(w, document_text=text) == whole_document
    # window 1 starts inside "man": alone, its "an" looks like a determiner
    assert windows[1].text.startswith("an can")
    assert postag.token_tags(windows[1])[:2] == ["DET", "DET"]
    assert postag.token_tags(windows[1], document_text=text)[:2] == ["NOUN", "NOUN"]
    with pytest.raises(ValueError, match="document_text is not the window's document"):
        postag.token_tags(windows[1], document_text=text.upper())


# ---------------------------------------------------------------- the command
@pytest.fixture
def run_cli(tmp_path):
    text_file = tmp_path / "sample.txt"
    text_file.write_text(TEXT, encoding="utf-8")

    def run(*extra):
        return cli.main(["pos-attribution", "--model", "tiny", "--text-file", str(text_file),
                         "--windows", "3", "--window-tokens", "40", "--source", "3",
                         "--destination", "1", "--alpha", "0.3", "--bootstrap", "50",
                         "--no-progress", "--run-dir", str(tmp_path / "run"), *extra])

    return run


def test_command_end_to_end_and_resume(run_cli, tmp_path, monkeypatch, capsys):
    assert run_cli("--selective", "NOUN", "ADV", "--noun-number", "--batch-size", "2") == 0
    out = capsys.readouterr().out
    assert "Net change in perplexity of the predicted tokens" in out
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert (run / "pos_attribution.png").is_file() and (run / "pos_selective.png").is_file()
    assert summary["tag_of"]["per_tag"] == "the predicted token x[t+1]"
    parts = [dict(np.load(run / "parts" / f"window-{i:05d}.npz")) for i in range(3)]
    base = np.stack([p["base"] for p in parts]).astype(float)
    rec = np.stack([p["rec"] for p in parts]).astype(float)
    rows = {r["tag"]: r for r in summary["per_tag"]}
    assert rows["all"]["change"] == pytest.approx(100 * math.expm1(base.mean() - rec.mean()))
    assert rows["all"]["n_tokens"] == 3 * 39
    assert rows["NOUN"]["n_tokens"] == rows["NOUN.sg"]["n_tokens"] + rows["NOUN.pl"]["n_tokens"]
    assert sum(r["n_tokens"] for t, r in rows.items() if t in UNIVERSAL_TAGS) == sum(
        int((p["universal"][1:] != "").sum()) for p in parts)
    # the recirculated run of each window is the engine's token-by-token run
    from probekit.core.models import load_model

    engine = StepEngine(load_model("tiny"))
    again = engine.run(torch.tensor(np.stack([p["input_ids"] for p in parts])),
                       Recirculation(3, 1, alpha=0.3)).log_probs.numpy()
    assert np.allclose(again, rec, atol=ATOL)

    for tag in ("NOUN", "ADV"):
        sel = [dict(np.load(run / "parts" / f"selective-{tag}-{i:05d}.npz")) for i in range(3)]
        for p, w in zip(sel, parts, strict=True):
            # count-matched: the same count in the same window, drawn from tagged tokens
            assert p["mask"].sum() == p["control"].sum()
            assert (p["mask"] == (w["universal"] == tag)).all()
            assert not (p["control"] & (w["universal"] == "")).any()
        row = next(r for r in summary["selective"] if r["tag"] == tag)
        assert row["n_recirculated"] == sum(int(p["mask"].sum()) for p in sel) > 0
        tag_lp = np.stack([p["tag"] for p in sel]).astype(float)
        assert row["tag_change"] == pytest.approx(100 * math.expm1(base.mean() - tag_lp.mean()))

    # a rerun with the same arguments resumes: nothing is run again
    def boom(*args, **kwargs):
        raise AssertionError("a finished part was recomputed")

    monkeypatch.setattr(StepEngine, "run", boom)
    assert run_cli("--selective", "NOUN,ADV", "--noun-number", "--batch-size", "2") == 0
    assert json.loads((run / "summary.json").read_text()) == summary
    # fewer tags, no noun split, other intervals: the same run folder, still nothing re-run
    assert run_cli("--selective", "ADV", "--bootstrap", "20", "--batch-size", "2") == 0
    again = json.loads((run / "summary.json").read_text())
    assert [r["tag"] for r in again["selective"]] == ["ADV"]
    assert "NOUN.pl" not in {r["tag"] for r in again["per_tag"]}
    assert again["selective"][0]["tag_change"] == summary["selective"][1]["tag_change"]


def test_command_more_windows_reuses_the_finished_ones(run_cli, tmp_path):
    assert run_cli("--selective", "none", "--windows", "2") == 0
    parts = tmp_path / "run" / "parts"
    stamps = {p.name: p.stat().st_mtime_ns for p in parts.glob("*.npz")}
    assert sorted(stamps) == ["window-00000.npz", "window-00001.npz"]
    assert run_cli("--selective", "none") == 0  # 3 windows: only the third is new
    assert {p.name: p.stat().st_mtime_ns for p in parts.glob("*.npz")
            if p.name in stamps} == stamps
    assert (parts / "window-00002.npz").is_file()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["n_windows"] == 3 and summary["analysis"]["windows"] == 3


def test_command_bad_tag_fails_before_any_state(run_cli, tmp_path, capsys):
    assert run_cli("--selective", "ADV,adverbs") == 2
    err = capsys.readouterr().err
    assert "error: --selective: unknown tag(s) 'adverbs'" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags, message", [
    (["--bootstrap", "0"], "--bootstrap must be >= 1; got 0"),
    (["--confidence", "1"], "--confidence must lie in (0, 1); got 1.0"),
    (["--windows", "0"], "--windows must be >= 1; got 0"),
])
def test_command_bad_numbers_fail_before_any_compute(run_cli, tmp_path, monkeypatch, capsys,
                                                     flags, message):
    def boom(*args, **kwargs):
        raise AssertionError("loaded a model before validating the flags")

    monkeypatch.setattr("probekit.core.models.load_model", boom)
    assert run_cli(*flags) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err
    assert not (tmp_path / "run").exists()


def test_command_runs_with_model_relative_defaults(tmp_path):
    """No --source/--destination: the pair comes from the model's depth (default_pair)."""
    from probekit.core.models import load_model
    from probekit.mechanisms.recirculation import default_pair

    text_file = tmp_path / "sample.txt"
    text_file.write_text(TEXT, encoding="utf-8")
    assert cli.main(["pos-attribution", "--model", "tiny", "--text-file", str(text_file),
                     "--windows", "2", "--window-tokens", "24", "--selective", "NOUN",
                     "--bootstrap", "20", "--no-progress", "--run-dir",
                     str(tmp_path / "run")]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    s, d = default_pair(load_model("tiny").n_blocks)
    assert f"s={s} d={d} " in summary["recurrence"]
    assert [r["tag"] for r in summary["selective"]] == ["NOUN"]


def test_command_missing_tagger_names_the_fix(run_cli, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PROBEKIT_DATA_DIR", str(tmp_path / "empty-data"))
    monkeypatch.setattr(postag, "_PICKLE_PACKAGE", "no_such_package_xyz")
    monkeypatch.setattr(postag, "_nltk_has", lambda resource: False)
    assert run_cli() == 2
    err = capsys.readouterr().err
    assert "pip install textblob-aptagger" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- the real default model
@pytest.mark.slow
def test_default_model_sparse_schedule_is_exact(default_engine):
    ids = torch.randint(0, 1000, (2, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(2, 20, dtype=torch.bool)
    mask[0, [3, 4, 11]] = True
    mask[1, [7, 16]] = True
    rec = Recirculation(20, 10, alpha=0.1)
    exact = default_engine.run(ids, rec, mask=mask).log_probs
    fast = run_sparse(default_engine, ids, rec, mask).log_probs
    assert torch.allclose(fast, exact, atol=1e-4)
    assert (exact - default_engine.forward(ids).log_probs).abs().max() > 1e-3
