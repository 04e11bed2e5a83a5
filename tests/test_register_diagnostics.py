"""The register diagnostics and Fig. 7b scripts of experiments/ (docs/latent-feedback.md):
their row accounting, their output, and their one-line errors."""

from __future__ import annotations

import importlib
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


def run(script: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXPERIMENTS / script), *flags],
                          capture_output=True, text=True, timeout=300)


def experiment(name: str):
    """The module of ``experiments/<name>.py``, imported in-process."""
    sys.path.insert(0, str(EXPERIMENTS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(EXPERIMENTS))


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
                      r"\(m=2 (\d\.\d{3}), m=4 (\d\.\d{3}), "
                      r"writes 1 (\d\.\d{3}), writes 2 (\d\.\d{3})\)$", line)
             for line in lines[1:]]
    assert [int(m.group(1)) for m in steps] == [100, 200]
    for m in steps:  # the total is the row-weighted mean of the register counts' accuracies
        total, two, four, once, twice = map(float, m.groups()[1:])
        assert total == pytest.approx((16 * 2 * 4 * two + 16 * 2 * 8 * four) / held_out, abs=1e-3)
        # and the plain mean of the writes' (each has half the rows)
        assert total == pytest.approx((once + twice) / 2, abs=1e-3)


def test_register_plateau_decays_the_learning_rate_as_the_trainer_does():
    """--lr-schedule cosine sets each step's rate to warmup_cosine (the trainer's schedule);
    the log line shows the rate of the step just taken."""
    from probekit.training.train import warmup_cosine

    out = run("register_plateau.py", "--groups", "2", "--steps", "200", "--batch-size", "8",
              "--lr-schedule", "cosine", "--warmup", "50")
    assert out.returncode == 0, out.stderr
    rates = [float(re.search(r"  lr (\S+)  ", line).group(1))
             for line in out.stdout.splitlines()[1:]]
    assert rates == [float(f"{warmup_cosine(s, 1e-3, 50, 200):.1e}") for s in (99, 199)]


def test_organism_checkpoint_flags_override_the_default_recipe_only_when_given():
    checkpoint_script = experiment("organism_checkpoint")
    Args, recipe_of = checkpoint_script.Args, checkpoint_script.recipe_of
    from probekit.training.organism_cache import Recipe

    assert recipe_of(Args()).key() == "fbbf51d681"  # the default organism's cache key
    varied = recipe_of(Args(seed=2, weight_decay=0.1, lr=1e-3, feedback_start=1200))
    assert varied == Recipe.default(2, weight_decay=0.1, lr=1e-3, feedback_start=1200)
    assert (varied.train.weight_decay, varied.train.lr, varied.train.feedback_start) == (
        0.1, 1e-3, 1200)
    fixed = recipe_of(Args(seed=3, fixed_point=0.1))
    assert fixed.train.fixed_point == 0.1 and fixed.key() != Recipe.default(3).key()
    assert recipe_of(Args(fixed_point=0.0)).key() == "fbbf51d681"  # 0 is the default recipe
    to_zero = recipe_of(Args(seed=1, lr_floor=0.0, steps=3000))
    assert to_zero == Recipe.default(1, lr_floor=0.0, steps=3000)
    assert to_zero.key() != Recipe.default(1, steps=3000).key()
    assert recipe_of(Args(lr_floor=0.1)).key() == "fbbf51d681"  # 0.1: the default recipe
    more = recipe_of(Args(seed=1, n_examples=48000))
    assert more == Recipe.default(1, n_examples=48000) and more.data.n_examples == 48000
    assert recipe_of(Args(n_examples=24000)).key() == "fbbf51d681"  # the default count
    longer = recipe_of(Args(seed=3, long_rows=4.0))
    assert longer == Recipe.default(3, long_rows=4.0) and longer.data.long_rows == 4.0
    assert longer.key() != Recipe.default(3).key()
    assert recipe_of(Args(long_rows=1.0)).key() == "fbbf51d681"  # 1: the default mix
    copying = recipe_of(Args(seed=2, copy_rows=0.25))
    assert copying == Recipe.default(2, copy_rows=0.25) and copying.data.copy_rows == 0.25
    assert copying.key() != Recipe.default(2).key()
    assert recipe_of(Args(copy_rows=0.0)).key() == "fbbf51d681"
    digits = recipe_of(Args(seed=4, copy_rows=0.5, copy_from=0))
    assert digits == Recipe.default(4, copy_rows=0.5, copy_from=0)
    recalling = recipe_of(Args(seed=4, recall_rows=0.25))
    assert recalling == Recipe.default(4, recall_rows=0.25)
    assert recalling.data.recall_rows == 0.25 and recalling.key() != Recipe.default(4).key()
    assert recipe_of(Args(recall_rows=0.0)).key() == "fbbf51d681"


def test_numeral_collapse_tabulates_cosines_and_sealed_accuracy(organism_checkpoint):
    """One row per organism: the mean / sd / max of its numerals' off-diagonal cosines
    (numeral_cosines), and "-" for the accuracy of an organism outside the cache."""
    import numpy as np

    from probekit.training.checkpoint import load_checkpoint
    from probekit.training.numerals import numeral_cosines

    out = run("numeral_collapse.py", str(organism_checkpoint), "--init", "0")
    assert out.returncode == 0, out.stderr
    rows = [r.split(" | ") for r in out.stdout.splitlines()[2:]]
    assert [r[0] for r in rows] == ["| initialised, seed 0", f"| {organism_checkpoint}"]
    cos = numeral_cosines(load_checkpoint(organism_checkpoint).model)
    off = cos[~np.eye(90, dtype=bool)]
    assert rows[1][1:4] == [f"{off.mean():.2f}", f"{off.std():.2f}", f"{off.max():.2f}"]
    assert rows[1][4] == "- |" and abs(float(rows[0][1])) < 0.05


def test_completion_errors_counts_the_sealed_accuracy_and_names_the_missed_pairs(
        organism_checkpoint):
    """The default set is the sealed probe set: each regime's accuracy over 0 and 8 null
    updates is task_accuracy's; every row's missed assignments account for its accuracy,
    and its pair-resampled interval holds it."""
    import numpy as np

    from probekit.training.checkpoint import load_checkpoint
    from probekit.training.numerals import numeral_cosines
    from probekit.training.organism import task_accuracy

    out = run("completion_errors.py", str(organism_checkpoint))
    assert out.returncode == 0, out.stderr
    rows = [r.strip("| ").split(" | ") for r in out.stdout.splitlines()[2:]]
    assert [(r[1], r[2]) for r in rows] == [(d, g) for d in ("0", "8")
                                           for g in ("none", "last-1", "full")]
    ck = load_checkpoint(organism_checkpoint)
    sealed = task_accuracy(ck.model, ck.gate, ("completion",))["completion"]
    for regime in ("none", "last-1", "full"):
        mine = [float(r[3]) for r in rows if r[2] == regime]
        assert sum(mine) / 2 == pytest.approx(sealed[regime], abs=1e-3)
    assert any(r[5] != "-" for r in rows)  # the untrained organism misses some
    cosines = numeral_cosines(ck.model)
    for r in rows:
        missed = sum(int(n) for n in re.findall(r"\d+-\d+ \((\d)/4\)", r[5]))
        assert missed == round((1 - float(r[3])) * 64)  # 16 pairs x 4 assignments
        low, high = map(float, r[4].split("-"))
        assert low <= float(r[3]) <= high
        # one closeness per missed pair: its numerals' cosine, and the pairs further apart
        pairs = re.findall(r"(\d+)-(\d+) \(", r[5])
        close = re.findall(r"(-?\d\.\d\d) \((\d+)%\)", r[6])
        assert len(close) == len(pairs) and (r[6] == "-") == (not pairs)
        upper = cosines[np.triu_indices(90, 1)]
        for (a, b), (cos, pct) in zip(pairs, close, strict=True):
            exact = cosines[int(a) - 10, int(b) - 10]
            assert float(cos) == pytest.approx(exact, abs=0.005)
            assert int(pct) == round(100 * np.mean(upper < exact))


def test_completion_errors_takes_any_last_k_and_names_the_rows_too_short_for_it(
        organism_checkpoint):
    """Any regime the engine runs, in the order given; last-14 on the 14-token rows of 0
    null updates is refused in one line that names the flag."""
    out = run("completion_errors.py", str(organism_checkpoint), "--null-updates", "0",
              "--regimes", "last-13", "passes=2", "last-2")
    assert out.returncode == 0, out.stderr
    rows = [r.strip("| ").split(" | ") for r in out.stdout.splitlines()[2:]]
    assert [r[2] for r in rows] == ["last-13", "passes=2", "last-2"]
    out = run("completion_errors.py", str(organism_checkpoint), "--null-updates", "0", "8",
              "--regimes", "last-14")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines()[-1] == (
        "completion_errors: error: --regimes last-14 at 0 null updates: regime last-14 needs "
        "prompts longer than k=14 tokens; the shortest prompt has 14")


def test_completion_errors_trained_pairs_are_the_pairs_the_organism_trained_on(
        tmp_path, monkeypatch):
    """--pairs trained regenerates exactly the completion rows the trainer read (captured
    from train_organism here), takes --groups of their pairs, never a held-out one, and
    refuses more groups than training held, in one line."""
    import os

    from probekit.training import data as data_module
    from probekit.training.config import DataConfig, OrganismConfig, TrainConfig
    from probekit.training.organism import completion_numerals, held_out_pairs
    from probekit.training.organism_cache import Recipe, trained_organism

    monkeypatch.setenv("PROBEKIT_CACHE_DIR", str(tmp_path / "cache"))
    read = []
    real = data_module.organism_data

    def capture(*a, **k):
        out = real(*a, **k)
        read.append((out.train, a[0] if a else k["tokenizer"]))
        return out

    recipe = Recipe(  # trains in seconds; seed 3 and long rows, so both must be read back
        train=TrainConfig(mode="organism", steps=4, feedback_start=2, batch_size=8,
                          batch_tokens=512, warmup=1, eval_every=0, save_every=4, seed=3),
        data=DataConfig(n_examples=96, long_rows=4.0, copy_rows=0.25),
        shape=OrganismConfig(n_blocks=2, d_model=32, n_heads=2, d_mlp=64, n_ctx=1280))
    with monkeypatch.context() as patched:
        patched.setattr(data_module, "organism_data", capture)
        ckpt = trained_organism(recipe, progress=False)
    (rows, tok), = read
    seen = {frozenset(completion_numerals(text.replace(" \n ", "\n")))
            for text in tok.batch_decode(rows) if text.startswith("required")}
    seen = {p for p in seen if len(p) == 2}
    module = experiment("completion_errors")
    assert module.trained_pairs(ckpt, tok) == seen and seen
    assert not seen & held_out_pairs(tok)
    args = module.Args(checkpoints=(ckpt,), groups=3, null_updates=(0, 8), pairs="trained")
    examples = module.pair_examples(ckpt, tok, args)
    assert len(examples) == 3 * 4 * 2 and len({ex.group for ex in examples}) == 3
    assert {frozenset(completion_numerals(ex.text)) for ex in examples
            if ex.label == "more"} <= seen

    env = {**os.environ, "PROBEKIT_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, str(EXPERIMENTS / "completion_errors.py"), str(ckpt),
                          "--pairs", "trained", "--groups", "3", "--regimes", "none"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()[2:]
    assert [line.split(" | ")[1:3] for line in lines] == [["0", "none"], ["8", "none"]]
    for line in lines:  # 3 pairs x 4 assignments per length
        right = float(line.split(" | ")[3]) * 12
        assert abs(right - round(right)) < 0.01
    too_many = len(seen) + 1
    out = subprocess.run([sys.executable, str(EXPERIMENTS / "completion_errors.py"), str(ckpt),
                          "--pairs", "trained", "--groups", str(too_many)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines()[-1] == (
        f"completion_errors: error: --groups {too_many}: the training rows of {ckpt} hold "
        f"only {len(seen)} completion pairs")


def test_fused_numerals_are_the_inputs_full_prefill_feeds_the_numerals(organism_checkpoint):
    """Each fused input is the depth-0 residual the engine gives that numeral under full
    prefill, after required = and after required = a / completed =."""
    import torch

    from probekit.analysis.capture import capture_final
    from probekit.core.engine import StepEngine
    from probekit.mechanisms.prefill import LatentFeedbackMechanism
    from probekit.mechanisms.regimes import Regime
    from probekit.training.checkpoint import load_checkpoint
    from probekit.training.numerals import fused_numerals
    from synthetic.completion import NUMERALS

    ck = load_checkpoint(organism_checkpoint)
    required, completed = fused_numerals(ck.model, ck.gate)
    assert required.shape == (90, 32) and completed.shape == (90, 90, 32)
    engine, tok = StepEngine(ck.model), ck.model.tokenizer
    mech = LatentFeedbackMechanism(ck.gate, ck.model)

    def depth0(texts):
        ids = torch.tensor(tok(texts, add_special_tokens=False)["input_ids"])
        return capture_final(engine, mech, ids, Regime.parse("full")).resid[:, 0]

    assert torch.allclose(required, depth0([f"required = {n}" for n in NUMERALS]), atol=1e-5)
    for a in (0, 37, 89):  # required numerals 10, 47, 99
        got = depth0([f"required = {NUMERALS[a]}\ncompleted = {n}" for n in NUMERALS])
        assert torch.allclose(completed[a], got, atol=1e-5)
    assert not torch.allclose(completed[0], completed[89], atol=1e-3)  # the state differs


def test_fused_numerals_tabulates_the_geometry_and_answers_every_row(organism_checkpoint):
    """The first table is geometry()'s numbers; the second answers all 8,100 rows: the
    equal rows missed are named, and the counts are label_predictions' over every row."""
    import numpy as np

    from probekit.core.engine import StepEngine
    from probekit.training.checkpoint import load_checkpoint
    from probekit.training.numerals import fused_numerals, numeral_cosines
    from probekit.training.organism import label_predictions
    from synthetic.completion import LABEL_WORDS, NUMERALS, completion_text
    from synthetic.dataset import label_token_ids

    out = run("fused_numerals.py", str(organism_checkpoint), "--null-updates", "1",
              "--regimes", "none", "full")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    geo = lines[2].strip("| ").split(" | ")
    ck = load_checkpoint(organism_checkpoint)
    module = experiment("fused_numerals")
    g = module.geometry(*fused_numerals(ck.model, ck.gate), numeral_cosines(ck.model))
    assert geo[1:] == [f"{g['embedding mean']:.2f} / {g['embedding max']:.2f}",
                       f"{g['required mean']:.2f} / {g['required max']:.2f}",
                       f"{g['completed mean']:.2f} / {g['completed max']:.2f}",
                       f"{g['own min']:.3f}", f"{g['nearest own']:,}"]
    assert 0 <= g["nearest own"] <= 8100
    rows = [r.strip("| ").split(" | ") for r in lines[6:]]
    assert [r[1] for r in rows] == ["none", "full"]
    tok, engine = ck.model.tokenizer, StepEngine(ck.model)
    ids = label_token_ids(tok, LABEL_WORDS)
    for r in rows:
        texts = [completion_text(a, b, scratch=4, distractors=1) for a in NUMERALS
                 for b in NUMERALS]
        pred = label_predictions(engine, ck.gate, tok(texts, add_special_tokens=False)[
            "input_ids"], ids, r[1]).reshape(90, 90)
        done = LABEL_WORDS.index("done")
        equal_missed = [str(n) for i, n in enumerate(NUMERALS) if pred[i, i] != done]
        assert r[2] == (f"{len(equal_missed)} ({', '.join(equal_missed)})" if equal_missed
                        else "0")
        unequal_missed = int((pred[~np.eye(90, dtype=bool)] == done).sum())
        assert r[3] == f"{unequal_missed} of 8,010"


def test_pair_interval_resamples_pairs():
    import numpy as np

    pair_interval = experiment("completion_errors").pair_interval
    assert pair_interval(np.ones((16, 4), dtype=bool)) == (1.0, 1.0)
    right = np.ones((80, 4), dtype=bool)
    right[:2, :2] = False  # two pairs half wrong: accuracy 0.9875
    low, high = pair_interval(right)
    assert 0.95 < low < 0.9875 < high <= 1.0


def test_rename_registers_renames_every_register_and_the_query_alike():
    rename_registers = experiment("register_plateau").rename_registers
    text = "r2 = 1\nr0 = 0\nr1 = 1\nr10 = 0\nscratch = 0\nquery = r2\nValue: one"
    names = [11, 3, 7] + list(range(4, 10)) + [0, 1]
    assert rename_registers(text, names) == (
        "r7 = 1\nr11 = 0\nr3 = 1\nr1 = 0\nscratch = 0\nquery = r7\nValue: one")


def test_widen_values_redraws_every_assignment_and_answers_the_queried_registers_latest():
    import random

    widen_values = experiment("register_plateau").widen_values
    text = "r2 = 0\nr4 = 1\nr2 = 1\nr4 = 0\nscratch = 6\nscratch += 0\nquery = r2\nValue: one"
    for seed in range(20):
        out = widen_values(text, 10, random.Random(seed))
        lines = out.splitlines()
        r2 = [line.split(" = ")[1] for line in lines if line.startswith("r2 = ")]
        # the scratch lines and the query are kept; the answer is r2's latest digit
        assert lines[4:7] == ["scratch = 6", "scratch += 0", "query = r2"]
        assert lines[7] == f"Value: {r2[-1]}"
    drawn = {widen_values(text, 10, random.Random(seed)).splitlines()[0] for seed in range(50)}
    assert drawn == {f"r2 = {v}" for v in range(10)}


def test_ask_every_register_merges_the_rows_of_one_history_and_keeps_every_answer():
    import random

    ask_every_register = experiment("register_plateau").ask_every_register
    history, other = "r1 = 0\nr0 = 1\nscratch = 6\n", "r1 = 1\nr0 = 0\nscratch = 6\n"
    rows = [history + "query = r0\nValue: one", history + "query = r1\nValue: zero",
            other + "query = r0\nValue: zero"]
    merged = ask_every_register(rows, random.Random(0))
    assert len(merged) == 2 and merged[1] == rows[2]
    assert merged[0].startswith(history)
    questions = merged[0][len(history):].split("\nquery = ")
    assert sorted(q.removeprefix("query = ") for q in questions) == [
        "r0\nValue: one", "r1\nValue: zero"]


def test_every_answer_weights_weigh_each_answer_of_a_row_and_no_padding():
    import torch

    from probekit.training.data import pad_batch

    plateau = experiment("register_plateau")
    zero, one, other, pad = 5, 6, 7, 0
    ids, valid = pad_batch([[other, other, one, other, zero], [other, zero, other]], pad)
    answer_ids = torch.tensor([zero, one])
    w = plateau.ANSWER_WEIGHT
    assert plateau.every_answer_weights(ids, valid, answer_ids, "all").tolist() == [
        [1.0, w, 1.0, w], [w, 1.0, 0.0, 0.0]]
    assert plateau.every_answer_weights(ids, valid, answer_ids, "last").tolist() == [
        [0.0, 1.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]]


def test_echo_query_asks_for_the_queried_registers_name_at_the_final_colon():
    from probekit.training.organism import fit_tokenizer

    echo_query = experiment("register_plateau").echo_query
    tok = fit_tokenizer()
    row = "r1 = 1\nr0 = 0\n# pad pad\nquery = r0\nValue: zero"
    ids = tok(row, add_special_tokens=False)["input_ids"]
    echoed = echo_query(ids, *tok.convert_tokens_to_ids(["state", ":"]))
    assert echoed == tok("r1 = 1\nr0 = 0\n# pad pad\nquery = r0\nstate: r0",
                         add_special_tokens=False)["input_ids"]


def test_register_plateau_scores_the_echo_of_the_held_out_rows():
    """--echo-rows: the log line adds the held-out rows' echo accuracy (the queried name
    at the final colon); without the flag it has none."""
    small = ("--d-model", "32", "--n-heads", "2", "--n-blocks", "1", "--groups", "8",
             "--batch-size", "8", "--steps", "100")
    echoed = run("register_plateau.py", *small, "--echo-rows", "0.5")
    assert echoed.returncode == 0, echoed.stderr
    header = re.fullmatch(r"64 training rows \((\d+) of them echoes\), 256 held-out rows; "
                          r"shortcut 0\.750", echoed.stdout.splitlines()[0])
    assert header and 20 <= int(header.group(1)) <= 44, echoed.stdout  # about half of 64
    assert re.search(r"held-out accuracy \d\.\d{3} \(writes 1 \d\.\d{3}, writes 2 "
                     r"\d\.\d{3}, echo \d\.\d{3}\)$", echoed.stdout.splitlines()[1])
    plain = run("register_plateau.py", *small)
    assert "echo" not in plain.stdout


def test_attention_hint_pulls_the_colons_attention_onto_the_asked_for_digit():
    """--attention-hint: every log line adds the hinted head's held-out attention on the
    queried register's digit, and the hint raises it (a weight of 1e-9 is no hint)."""
    small = ("--d-model", "32", "--n-heads", "2", "--n-blocks", "2", "--groups", "8",
             "--batch-size", "8", "--steps", "200", "--lr", "3e-3", "--hint-steps", "1000")
    attention = []
    for weight in ("1e-9", "5"):
        out = run("register_plateau.py", *small, "--attention-hint", weight)
        assert out.returncode == 0, out.stderr
        found = re.search(r"match attention (\d\.\d{3})\)$", out.stdout.splitlines()[-1])
        assert found, out.stdout
        attention.append(float(found.group(1)))
    assert attention[1] > 0.3 and attention[1] > 2 * attention[0], attention
    assert "match attention" not in run("register_plateau.py", *small[:-2]).stdout


def test_register_plateau_asks_every_register_in_training_rows_only():
    """--queries every: one training row per history (groups x schedule and complement),
    the held-out rows as before."""
    flags = ("--registers", "4", "--writes", "1", "--groups", "2", "--steps", "100",
             "--batch-size", "8")
    one, every = (run("register_plateau.py", *flags, *queries)
                  for queries in ((), ("--queries", "every")))
    for out in (one, every):
        assert out.returncode == 0, out.stderr
    assert one.stdout.splitlines()[0].startswith("16 training rows, 256 held-out rows")
    assert every.stdout.splitlines()[0].startswith("4 training rows, 256 held-out rows")


def test_register_plateau_with_more_values_scores_against_their_shortcut():
    """--values 10: the shortcut is right with probability 1/m + (1 - 1/m)/10."""
    out = run("register_plateau.py", "--groups", "2", "--steps", "100", "--batch-size", "8",
              "--values", "10")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].endswith(f"shortcut {1 / 2 + 1 / 2 / 10:.3f}")


def test_register_plateau_trains_on_renamed_registers_and_scores_the_papers_names():
    """--names random changes the training rows only: the held-out rows (and their count
    and shortcut) are those of the paper's names."""
    flags = ("--groups", "2", "--steps", "100", "--batch-size", "8")
    paper, renamed, pooled = (run("register_plateau.py", *flags, *names) for names in (
        (), ("--names", "random"), ("--names", "random", "--name-pool", "4")))
    for out in (paper, renamed, pooled):
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines()[0] == paper.stdout.splitlines()[0]
    # ...and the training rows differ: the same seed trains to another loss (the pool of
    # names, r0..r3 or r0..r15, draws other names from the same stream)
    assert len({out.stdout.splitlines()[1] for out in (paper, renamed, pooled)}) == 3


def test_register_plateau_splits_the_accuracy_by_the_pad_line():
    """With --pad-rows the held-out accuracy is also printed for the rows with and without
    the "# pad" line; the total, their row-weighted mean, lies between them."""
    out = run("register_plateau.py", "--groups", "2", "--steps", "100", "--batch-size", "8",
              "--pad-rows", "0.5")
    assert out.returncode == 0, out.stderr
    line = out.stdout.splitlines()[1]
    m = re.match(r"step +100 .* held-out accuracy (\d\.\d{3}) \(writes 1 \d\.\d{3}, "
                 r"writes 2 \d\.\d{3}, pad line (\d\.\d{3}), none (\d\.\d{3})\)$", line)
    assert m, line
    total, padded, plain = map(float, m.groups())
    assert min(padded, plain) - 1e-3 <= total <= max(padded, plain) + 1e-3


def test_register_plateau_saves_an_organism_that_init_reads_back(tmp_path):
    """--until stops at the first evaluation that reaches it, --save writes the organism and
    --init --evaluate scores exactly what the saved one scored on the same held-out rows (a
    fresh organism scores 0.000: its argmax is not yet a label word)."""
    small = ("--d-model", "32", "--n-heads", "2", "--n-blocks", "1", "--groups", "2",
             "--batch-size", "8")
    first = run("register_plateau.py", *small, "--steps", "300", "--until", "0.01",
                "--save", str(tmp_path / "o"))
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    assert lines[1].startswith("step   100 ")
    assert lines[2:] == ["every register count at >= 0.01 held-out accuracy: stopped",
                         f"saved the organism in {tmp_path / 'o'}"]
    # the accuracy and its split by writes per register
    trained = re.search(r"held-out accuracy (\d\.\d{3} \(writes 1 \d\.\d{3}, "
                        r"writes 2 \d\.\d{3})\)$", lines[1]).group(1)
    again = run("register_plateau.py", "--init", str(tmp_path / "o"), "--evaluate")
    assert again.returncode == 0, again.stderr
    header, line = again.stdout.splitlines()
    assert header == "0 training rows, 256 held-out rows; shortcut 0.750"
    # --evaluate adds the accuracy per queried register (each has half the rows)
    m = re.fullmatch(re.escape(f"held-out accuracy {trained}")
                     + r", r0 (\d\.\d{3}), r1 (\d\.\d{3})\)", line)
    assert m, (trained, line)
    r0, r1 = map(float, m.groups())
    assert float(trained[:5]) == pytest.approx((r0 + r1) / 2, abs=1e-3)


def test_init_std_scales_every_weight_of_a_fresh_organism_and_defaults_to_hfs():
    """--init-std reaches the organism's config: every weight matrix and the (tied)
    embedding drawn with that standard deviation, the norms at one; the default is
    HF's Llama initialisation, weight for weight."""
    import dataclasses

    import torch

    from probekit.training.config import OrganismConfig
    from probekit.training.organism import build_organism, fit_tokenizer

    tok, shape = fit_tokenizer(), OrganismConfig(n_blocks=2, d_model=64, n_heads=2)
    plain = build_organism(tok, shape).state_dict()
    assert all(torch.equal(plain[k], v) for k, v in build_organism(
        tok, dataclasses.replace(shape, init_std=0.02)).state_dict().items())
    wide = build_organism(tok, dataclasses.replace(shape, init_std=0.1))
    for name, weight in wide.named_parameters():
        if weight.ndim == 2:
            assert weight.std().item() == pytest.approx(0.1, rel=0.1), name
            assert plain[name].std().item() == pytest.approx(0.02, rel=0.1), name
        else:
            assert torch.equal(weight, torch.ones_like(weight)), name


def test_register_plateau_saves_what_it_learned_when_stopped(tmp_path):
    """SIGTERM (as Ctrl-C) ends the step in flight, then --save writes the organism."""
    proc = subprocess.Popen(
        [sys.executable, str(EXPERIMENTS / "register_plateau.py"), "--d-model", "32",
         "--n-heads", "2", "--n-blocks", "1", "--groups", "2", "--batch-size", "8",
         "--steps", "1000000", "--save", str(tmp_path / "o")],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines = [proc.stdout.readline(), proc.stdout.readline()]
    assert lines[1].startswith("step   100 "), lines
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    stopped, saved = rest.splitlines()[-2:]
    assert re.fullmatch(r"SIGTERM after step \d+: stopped", stopped), stopped
    assert saved == f"saved the organism in {tmp_path / 'o'}"
    assert (tmp_path / "o" / "model.safetensors").is_file()


def test_register_plateau_splits_the_accuracy_by_null_updates(tmp_path):
    """Several --null-updates counts: each gets its own held-out groups (128 // (m x writes x
    counts) per cell), and the total is the mean of the per-count accuracies."""
    made = run("register_plateau.py", "--d-model", "32", "--n-heads", "2", "--n-blocks", "1",
               "--groups", "1", "--batch-size", "8", "--steps", "100",
               "--save", str(tmp_path / "o"))
    assert made.returncode == 0, made.stderr
    out = run("register_plateau.py", "--init", str(tmp_path / "o"), "--evaluate",
              "--null-updates", "0", "2")
    assert out.returncode == 0, out.stderr
    header, line = out.stdout.splitlines()
    assert header == f"0 training rows, {16 * 2 * 2 * 2 * 2} held-out rows; shortcut 0.750"
    m = re.fullmatch(r"held-out accuracy (\d\.\d{3}) \(writes 1 \d\.\d{3}, "
                     r"writes 2 \d\.\d{3}, null 0 (\d\.\d{3}), null 2 (\d\.\d{3}), "
                     r"r0 \d\.\d{3}, r1 \d\.\d{3}\)", line)
    assert m, line
    total, zero, two = map(float, m.groups())
    assert total == pytest.approx((zero + two) / 2, abs=1e-3)


def test_value_positions_are_the_tokens_two_after_each_assigned_name():
    from probekit.training.organism import fit_tokenizer

    value_positions = experiment("register_parts").value_positions
    tok = fit_tokenizer()
    ids = tok("r1 = 1\nr0 = 0\nscratch = 3\nr1 = 0\nquery = r1\nValue:",
              add_special_tokens=False)["input_ids"]
    names = {tok.convert_tokens_to_ids(f"r{i}"): i for i in range(16)}
    found = value_positions(ids, names, tok.convert_tokens_to_ids("="))
    assert found == [(2, 1), (6, 0), (14, 1)]
    assert [tok.convert_ids_to_tokens(ids[p]) for p, _ in found] == ["1", "0", "0"]


def test_register_parts_reads_every_depth_before_the_final_norm():
    """Depth r is the output of block r - 1 (SEMANTICS.md), the top one too: not HF's last
    hidden state, which is after the final norm."""
    import torch

    from probekit.training.config import OrganismConfig
    from probekit.training.organism import build_organism, fit_tokenizer

    model = build_organism(fit_tokenizer(), OrganismConfig(n_blocks=2, d_model=32,
                                                           n_heads=2)).eval()
    outputs = {}
    for b, block in enumerate(model.model.layers):
        block.register_forward_hook(lambda _, __, out, b=b: outputs.__setitem__(b, out))
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    states = experiment("register_parts").residuals(model, ids)
    assert states.shape == (1, 3, 5, 32)
    assert torch.equal(states[:, 0], model.model.embed_tokens(ids))
    for b in (0, 1):
        assert torch.equal(states[:, b + 1], outputs[b])
    assert not torch.allclose(states[:, 2], model.model.norm(outputs[1]))


def test_register_parts_probes_every_depth_for_each_part(tmp_path):
    """One line per residual depth (blocks + 1), each with the three parts; depth 0 of the
    colon is the same token in every row, so its probes sit at chance."""
    made = run("register_plateau.py", "--d-model", "32", "--n-heads", "2", "--n-blocks", "2",
               "--groups", "1", "--batch-size", "8", "--steps", "100",
               "--save", str(tmp_path / "o"))
    assert made.returncode == 0, made.stderr
    out = run("register_parts.py", str(tmp_path / "o"), "--registers", "4", "--groups", "8",
              "--null-updates", "0")
    assert out.returncode == 0, out.stderr
    header, *depths = out.stdout.splitlines()
    assert header.startswith(f"{tmp_path / 'o'}: m=4, writes per register 1, 64 rows, "
                             "64 value tokens; chance name at value token 0.")
    assert len(depths) == 3
    part = r"(\d\.\d{3})"
    for depth, line in enumerate(depths):
        assert re.fullmatch(rf"depth {depth}: name at value token {part}, queried name at "
                            rf"colon {part}, answer at colon {part}", line), line
    chance = [float(c) for c in re.findall(r"\d\.\d{3}", header.split("chance")[1])]
    assert [float(a) for a in re.findall(r"\d\.\d{3}", depths[0])][1:] == chance[1:]


@pytest.mark.parametrize("script, flags, message", [
    ("register_plateau.py", ("--steps", "0"),
     "register_plateau: error: --steps must be >= 1; got 0"),
    ("register_plateau.py", ("--writes", "0"),
     "register_plateau: error: --registers and --writes must be counts >= 1 and "
     "--null-updates >= 0"),
    ("register_plateau.py", ("--pad-rows", "1.5"),
     "register_plateau: error: --pad-rows must lie in [0, 1]; got 1.5"),
    ("register_plateau.py", ("--values", "11"),
     "register_plateau: error: --values must lie in [2, 10] (the digits the tokenizer "
     "knows); got 11"),
    ("register_plateau.py", ("--queries", "every", "--values", "4"),
     "register_plateau: error: --queries every asks for registers whose answers are bits; "
     "drop --values"),
    ("register_plateau.py", ("--init-std", "0"),
     "register_plateau: error: --init-std must lie in (0, 1]; got 0.0"),
    ("register_plateau.py", ("--echo-rows", "1.5"),
     "register_plateau: error: --echo-rows must lie in [0, 1]; got 1.5"),
    ("register_plateau.py", ("--echo-rows", "0.5", "--queries", "every"),
     "register_plateau: error: --echo-rows turns a row's one question into an echo; drop "
     "--queries every"),
    ("register_plateau.py", ("--attention-hint", "-1"),
     "register_plateau: error: --attention-hint must be >= 0; got -1.0"),
    ("register_plateau.py", ("--attention-hint", "1", "--queries", "every"),
     "register_plateau: error: --attention-hint supervises a row's one question; drop "
     "--queries every"),
    ("register_plateau.py", ("--hint-steps", "0"),
     "register_plateau: error: --hint-steps must be >= 1; got 0"),
    ("register_plateau.py", ("--attention-hint", "1", "--hint-parts", "circuit", "--n-blocks",
                             "1"),
     "register_plateau: error: --hint-parts circuit hints heads 0 and 1 of block 0 and head 0 "
     "of the last block; it needs --n-blocks and --n-heads >= 2"),
    ("register_parts.py", ("nowhere",),
     "register_parts: error: nowhere is not an organism folder (no config.json); give the "
     "--save folder of register_plateau.py"),
    ("register_plateau.py", ("--until", "1.5"),
     "register_plateau: error: --until must lie in (0, 1]; got 1.5"),
    ("register_plateau.py", ("--evaluate",),
     "register_plateau: error: --evaluate scores a trained organism; give its folder with "
     "--init"),
    ("register_plateau.py", ("--init", "nowhere"),
     "register_plateau: error: --init nowhere is not an organism folder (no config.json); "
     "give the --save folder of an earlier run"),
    ("register_plateau.py", ("--d-model", "100", "--n-heads", "3"),
     "register_plateau: error: --d-model (100) must be a multiple of --n-heads (3)"),
    ("register_plateau.py", ("--lr-schedule", "cosine", "--warmup", "1600"),
     "register_plateau: error: --warmup must lie in [0, --steps); got 1600"),
    ("register_plateau.py", ("--warmup", "50"),
     "register_plateau: error: --warmup needs --lr-schedule cosine (the constant rate has no "
     "warm-up)"),
    ("register_plateau.py", ("--names", "random", "--registers", "2", "17"),
     "register_plateau: error: --names random draws from 16 register names; --registers 17 "
     "needs more"),
    ("register_plateau.py", ("--names", "random", "--name-pool", "2", "--registers", "4"),
     "register_plateau: error: --names random draws from 2 register names; --registers 4 "
     "needs more"),
    ("register_plateau.py", ("--names", "random", "--name-pool", "17"),
     "register_plateau: error: --name-pool must lie in [1, 16] (the tokenizer knows "
     "r0..r15); got 17"),
    ("register_plateau.py", ("--name-pool", "4"),
     "register_plateau: error: --name-pool needs --names random (the paper's names are "
     "r0..r(m-1))"),
    ("register_shapes.py", ("--rows", "0"), "register_shapes: error: --rows must be >= 1; got 0"),
    ("organism_checkpoint.py", ("--d-model", "100", "--n-heads", "3"),
     "organism_checkpoint: error: --d-model (100) must be a multiple of --n-heads (3)"),
    ("organism_checkpoint.py", ("--steps", "0"),
     "organism_checkpoint: error: --steps must be a positive integer; got 0"),
    ("organism_checkpoint.py", ("--lr", "0"),
     "organism_checkpoint: error: --lr must be > 0; got 0.0"),
    ("organism_checkpoint.py", ("--weight-decay", "-1"),
     "organism_checkpoint: error: --weight-decay must be >= 0; got -1.0"),
    ("organism_checkpoint.py", ("--feedback-start", "-5"),
     "organism_checkpoint: error: --feedback-start must be an integer >= 0; got -5"),
    ("organism_checkpoint.py", ("--fixed-point", "2"),
     "organism_checkpoint: error: --fixed-point must lie in [0, 1]; got 2.0"),
    ("organism_checkpoint.py", ("--copy-rows", "-0.5"),
     "organism_checkpoint: error: --copy-rows must lie in [0, 1]; got -0.5"),
    ("organism_checkpoint.py", ("--copy-rows", "0.5", "--copy-from", "100"),
     "organism_checkpoint: error: --copy-from must lie in 0..99; got 100"),
    ("organism_checkpoint.py", ("--copy-from", "0"),
     "organism_checkpoint: error: --copy-from sets the copy rows' numerals; give "
     "--copy-rows too, or drop it"),
    ("organism_checkpoint.py", ("--close-pairs", "0.25", "--tasks", "memory"),
     "organism_checkpoint: error: --close-pairs draws completion rows; it needs completion "
     "among --tasks (got memory)"),
    ("organism_checkpoint.py", ("--recall-rows", "1.5"),
     "organism_checkpoint: error: --recall-rows must lie in [0, 1]; got 1.5"),
    ("organism_checkpoint.py", ("--long-rows", "-1"),
     "organism_checkpoint: error: --long-rows must be a finite number > 0; got -1.0"),
    ("organism_checkpoint.py", ("--n-examples", "10"),
     "organism_checkpoint: error: --n-examples must be >= --batch-size (64); got 10"),
    ("completion_errors.py", (), "completion_errors: error: give at least one organism "
     "checkpoint folder"),
    ("completion_errors.py", ("no/such/organism",),
     "completion_errors: error: no/such/organism is not an organism checkpoint (no "
     "config.json); give a folder that organism_checkpoint.py printed"),
    ("completion_errors.py", ("no/such/organism", "--groups", "50"),
     "completion_errors: error: --groups must be one of 16, 32, 64, 80 (the held-out pair "
     "sets); got 50"),
    ("completion_errors.py", ("no/such/organism", "--null-updates", "8", "-1"),
     "completion_errors: error: --null-updates must be counts >= 0; got 8 -1"),
    ("completion_errors.py", ("no/such/organism", "--regimes", "full", "last-two"),
     "completion_errors: error: --regimes: regime must be none, last-<k> (e.g. last-2), full "
     "or passes=<n>; got 'last-two'"),
    ("completion_errors.py", ("no/such/organism", "--pairs", "trained", "--groups", "0"),
     "completion_errors: error: --groups must be >= 1; got 0"),
    ("fused_numerals.py", (), "fused_numerals: error: give at least one organism "
     "checkpoint folder"),
    ("fused_numerals.py", ("no/such/organism",),
     "fused_numerals: error: no/such/organism is not an organism checkpoint (no "
     "config.json); give a folder that organism_checkpoint.py printed"),
    ("fused_numerals.py", ("no/such/organism", "--null-updates", "-1"),
     "fused_numerals: error: --null-updates must be >= 0; got -1"),
    ("fused_numerals.py", ("no/such/organism", "--regimes", "last-two"),
     "fused_numerals: error: --regimes: regime must be none, last-<k> (e.g. last-2), full "
     "or passes=<n>; got 'last-two'"),
    ("numeral_collapse.py", ("no/such/organism",),
     "numeral_collapse: error: no/such/organism is not an organism checkpoint (no "
     "config.json); give a folder that organism_checkpoint.py printed"),
    ("fig7b.py", ("runs/none",),
     "fig7b: error: runs/none/seed0/register-sweep/summary.json: cannot read it ([Errno 2] "
     "No such file or directory: 'runs/none/seed0/register-sweep/summary.json'); run "
     "experiments/latent_feedback_registers.sh first"),
])
def test_bad_flags_get_one_line_errors(script, flags, message):
    out = run(script, *flags)
    assert out.returncode == 2
    assert out.stderr.strip() == message
