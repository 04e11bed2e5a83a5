"""Register matched pairs (App. F: same update history, different queried register), the
complement pairing kept as an option, and the organism's register training text.

Uses the real default tokenizer (SmolLM2's, ``smollm2_tokenizer`` in conftest)."""

import hashlib
import itertools
import re

import numpy as np
import pytest

from synthetic import make_task
from synthetic.registers import (
    OVERWRITE_LENGTHS,
    latest_value,
    probe_schedules,
    query_pairs,
    registers_dataset,
    training_examples,
    training_texts,
)

REGISTER_TASKS = ("registers", "register-sweep", "overwrite-sweep")
WRITE = re.compile(r"^r(\d) = ([01])$", re.MULTILINE)


def datasets(result):
    return list(result.items()) if isinstance(result, dict) else [(None, result)]


@pytest.fixture(scope="module")
def tasks(smollm2_tokenizer):
    """The register tasks at their default sizes, both pairings."""
    return {(name, pairing): make_task(name, smollm2_tokenizer, pairing=pairing)
            for name in REGISTER_TASKS for pairing in ("query", "complement")}


def text_hash(texts):
    return hashlib.sha256("\0".join(texts).encode()).hexdigest()[:16]


def schedule_of(text):
    return tuple((int(r), int(v)) for r, v in WRITE.findall(text))


def members(ds, pair):
    return [ds[i] for i in np.flatnonzero(ds.pairs == pair)]


# ---------------------------------------------------------------- the pairing rule
def test_query_pairs_rule_on_examples():
    assert query_pairs([0, 0, 1, 1]) == [(0, 2), (1, 3)]
    assert query_pairs([0, 1, 0, 1]) == [(0, 1), (2, 3)]
    assert query_pairs([1, 0, 0, 0]) == [(0, 1)]
    assert query_pairs([1, 1, 1]) == [] and query_pairs([0]) == []


@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
def test_query_pairs_is_a_maximum_matching_of_opposite_values(m):
    for latest in itertools.product((0, 1), repeat=m):
        pairs = query_pairs(latest)
        used = [r for pair in pairs for r in pair]
        assert len(used) == len(set(used))                      # each register at most once
        assert all(i < j and latest[i] != latest[j] for i, j in pairs)
        assert len(pairs) == min(latest.count(0), latest.count(1))


# ------------------------------------------------------- query pairs (the default)
def test_query_pairs_share_the_history_and_differ_only_in_the_query(tasks, smollm2_tokenizer):
    for name in REGISTER_TASKS:
        for key, ds in datasets(tasks[(name, "query")]):
            if ds.metadata["m"] == 1:
                continue
            assert ds.metadata["pairing"] == "query"
            assert (ds.pairs >= 0).any()
            for pair in np.unique(ds.pairs[ds.pairs >= 0]):
                a, b = pair_members = members(ds, pair)
                assert len(pair_members) == 2
                assert a.group == b.group and a.label_id != b.label_id
                assert a.condition["complement"] == b.condition["complement"]
                assert a.condition["query"] != b.condition["query"]
                la, lb = a.text.split("\n"), b.text.split("\n")
                assert len(la) == len(lb)
                diff = [i for i, (x, y) in enumerate(zip(la, lb)) if x != y]
                assert diff == [len(la) - 2], (name, key, diff)    # only "query = rI"
                assert la[-2] == f"query = r{a.condition['query']}"


def test_query_pairs_label_is_the_queried_latest_value(tasks):
    ds = tasks[("registers", "query")]
    for ex in ds:
        assert ex.label_id == latest_value(schedule_of(ex.text), ex.condition["query"])


def test_unpaired_queries_have_no_possible_partner(tasks):
    """Maximal: within a schedule (or its complement), the unpaired queries all have the
    same latest value, so no further pair with opposite labels exists."""
    for name in REGISTER_TASKS:
        for _, ds in datasets(tasks[(name, "query")]):
            if ds.metadata["m"] == 1:
                continue
            for g in np.unique(ds.groups):
                for c in (False, True):
                    free = [ex.label_id for ex in ds
                            if ex.group == g and ex.condition["complement"] == c and ex.pair < 0]
                    assert len(set(free)) <= 1


def test_pairing_does_not_change_examples_or_groups(tasks):
    for name in REGISTER_TASKS:
        query, complement = datasets(tasks[(name, "query")]), datasets(tasks[(name, "complement")])
        for (k1, q), (k2, c) in zip(query, complement):
            assert k1 == k2 and q.texts == c.texts
            assert q.labels.tolist() == c.labels.tolist()
            assert q.groups.tolist() == c.groups.tolist()
            assert [e.condition for e in q] == [e.condition for e in c]


def test_pair_ids_stay_inside_their_group(tasks):
    for name in REGISTER_TASKS:
        for _, ds in datasets(tasks[(name, "query")]):
            m = ds.metadata["m"]
            paired = ds.pairs >= 0
            assert ((ds.pairs[paired] // m) == ds.groups[paired]).all()


def test_consumers_accept_unpaired_examples(tasks):
    from probekit.analysis.causal import flip_statistics, partner_index
    from probekit.analysis.state_tracking import plan_batches

    ds = tasks[("registers", "query")]
    partners = partner_index(ds.pairs)
    assert ((partners >= 0) == (ds.pairs >= 0)).all()
    idx = np.flatnonzero(partners >= 0)
    assert (partners[partners[idx]] == idx).all()
    assert (ds.labels[idx] != ds.labels[partners[idx]]).all()
    for batch in plan_batches(np.full(len(ds), 50), ds.pairs, batch_tokens=400, max_batch=8):
        inside = set(batch.tolist())
        assert all(int(partners[i]) in inside for i in batch if partners[i] >= 0)
    clean = np.eye(2)[ds.labels]                      # a model that is always right
    stats = flip_statistics(clean, clean[:, None], ds.labels, partners)
    assert stats.n_recipients == int((ds.pairs >= 0).sum()) < len(ds)


# ------------------------------------------------------------------------- m = 1
def test_one_register_falls_back_to_complement_pairs(tasks, smollm2_tokenizer):
    one = tasks[("register-sweep", "query")][1]
    assert one.metadata["pairing"] == "complement"
    assert one.pairs.tolist() == tasks[("register-sweep", "complement")][1].pairs.tolist()
    assert (one.pairs >= 0).all()
    ds = registers_dataset(smollm2_tokenizer, m=1, writes_per_register=3, n_groups=3)
    assert ds.metadata["pairing"] == "complement"
    assert ds.pairs.tolist() == [0, 0, 1, 1, 2, 2]
    for a, b in zip(ds.examples[::2], ds.examples[1::2]):
        assert (a.condition["complement"], b.condition["complement"]) == (False, True)
        assert a.label_id != b.label_id


# ---------------------------------------------------- the complement option (old pairs)
def test_complement_option_reproduces_the_old_pairs(smollm2_tokenizer):
    """Recorded from the implementation before query pairs existed (seed 0)."""
    ds = registers_dataset(smollm2_tokenizer, m=4, writes_per_register=2, n_groups=2,
                           pairing="complement")
    assert ds.pairs.tolist() == [q // 2 for q in range(16)]
    assert ds.labels.tolist() == [1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 0, 1, 1, 0]
    assert text_hash(ds.texts) == "d4b5d77a200961bd"
    sweep = make_task("register-sweep", smollm2_tokenizer, n_examples=60,
                      pairing="complement")
    assert {m: text_hash(d.texts) for m, d in sweep.items()} == {
        1: "0068bef4e3f8105b", 2: "e2f2197191e7a368", 4: "9dbfc9491e323c60",
        8: "0f5f9e432d641cc3"}
    for m, d in sweep.items():
        assert d.pairs.tolist() == [i // 2 for i in range(4 * m)]


def test_complement_pairs_are_group_times_m_plus_query(tasks):
    for name in REGISTER_TASKS:
        for _, ds in datasets(tasks[(name, "complement")]):
            m = ds.metadata["m"]
            expected = [ex.group * m + ex.condition["query"] for ex in ds]
            assert ds.pairs.tolist() == expected
            assert ds.metadata["pairing"] == "complement"


def test_query_pairs_on_the_small_recorded_dataset(smollm2_tokenizer):
    ds = registers_dataset(smollm2_tokenizer, m=4, writes_per_register=2, n_groups=2)
    # group 0: every register ends at 1 (complement: 0), so nothing pairs; group 1 ends
    # (1, 1, 0, 1): r0 pairs with r2, the complement likewise
    assert ds.pairs.tolist() == [-1] * 8 + [4, 5, -1, -1, 4, 5, -1, -1]


def test_bad_pairing_is_rejected(smollm2_tokenizer):
    with pytest.raises(ValueError, match="pairing must be one of"):
        registers_dataset(smollm2_tokenizer, m=2, n_groups=1, pairing="value")
    with pytest.raises(ValueError, match="pairing must be one of"):
        make_task("overwrite-sweep", smollm2_tokenizer, n_examples=48, pairing="values")


# ------------------------------------------------------------- organism training text
def test_training_examples_are_deterministic_per_seed():
    first = training_examples(300, seed=5)
    assert first == training_examples(300, seed=5)
    assert [e.text for e in first] != [e.text for e in training_examples(300, seed=6)]
    assert training_texts(20, seed=5) == [e.text + " " + e.label for e in first[:20]]


def test_training_examples_cover_the_shapes_evenly():
    examples = training_examples(4000, seed=0)
    n = len(examples)
    ms = np.array([e.condition["m"] for e in examples])
    ws = np.array([e.condition["writes_per_register"] for e in examples])
    ds = np.array([e.condition["distractors"] for e in examples])
    assert set(ms.tolist()) == {1, 2, 4, 8} and set(ws.tolist()) == {1, 2, 4, 8, 16}
    assert set(ds.tolist()) == set(range(51))  # up to the sweeps' 50 padding lines
    for m in (1, 2, 4, 8):
        assert abs((ms == m).mean() - 1 / 4) < 0.03
        n_writes = 4 if m == 8 else 5  # m = 8 with 16 writes exceeds 64 assignments
        assert abs((ws[ms == m] == 8).mean() - 1 / n_writes) < 0.06
    # null updates: 0-8 eight times as often as each of 9-50
    share = np.array([8] * 9 + [1] * 42) / 114
    assert np.abs(np.bincount(ds, minlength=51) / n - share).max() < 0.015
    assert set(training_examples(300, seed=0, distractors=(3, 5))[i].condition["distractors"]
               for i in range(300)) == {3, 5}
    padded = np.array(["#" in e.text for e in examples])
    assert abs(padded.mean() - 0.5) < 0.03  # the sweeps' "# pad ..." line, half the rows
    assert padded.tolist() == [e.condition["pad_line"] for e in examples]
    assert not any("#" in e.text for e in training_examples(300, seed=0, pad_rows=0.0))
    assert abs(np.mean([e.label_id for e in examples]) - 0.5) < 0.03
    assert (ms * ws <= 64).all()
    # half the rows carry intermediate reads, after about half of their assignments (those
    # with another register written before: a read never asks for the one just written, so
    # one-register rows have none)
    reads = np.array([e.condition["reads"] for e in examples])
    long = (ms >= 2) & (ms * ws >= 8)
    assert abs((reads[long] > 0).mean() - 0.5) < 0.04
    ratio = reads[long & (reads > 0)].sum() / (ms * ws)[long & (reads > 0)].sum()
    assert 0.4 < ratio < 0.5
    assert (reads[ms == 1] == 0).all()
    plain = training_examples(200, seed=0, read_rows=0.0)
    assert all(e.condition["reads"] == 0 and "Value: " not in e.text for e in plain)


def test_training_example_format_and_labels():
    pattern = (r"((?:r\d = [01]\n(?:query = r\d\nValue: (?:zero|one)\n)*)+)scratch = \d\n"
               r"((?:scratch \+= 0\n)*)(?:#(?: pad)*\n)?query = r(\d)\nValue:")
    read = re.compile(r"^query = r(\d)\nValue: (zero|one)$", re.MULTILINE)
    for ex in training_examples(500, seed=2):
        writes, nulls, query = re.fullmatch(pattern, ex.text).groups()
        schedule = schedule_of(writes)
        m, w = ex.condition["m"], ex.condition["writes_per_register"]
        assert sorted(r for r, _ in schedule) == sorted(list(range(m)) * w)
        assert nulls.count("\n") == ex.condition["distractors"]
        assert int(query) == ex.condition["query"] < m
        assert ex.label == ("zero", "one")[latest_value(schedule, int(query))]
        assert ex.pair == -1
        # every intermediate read answers with the register's latest value so far, and
        # reads only registers already written
        reads = list(read.finditer(writes))
        assert len(reads) == ex.condition["reads"]
        for r in reads:
            so_far = schedule_of(writes[: r.start()])
            reg = int(r.group(1))
            assert reg in {q for q, _ in so_far} and reg != so_far[-1][0]
            assert r.group(2) == ("zero", "one")[latest_value(so_far, reg)]


def test_max_assignments_limits_the_writes():
    examples = training_examples(400, seed=1, max_assignments=8)
    shapes = {(e.condition["m"], e.condition["writes_per_register"]) for e in examples}
    assert all(m * w <= 8 for m, w in shapes)
    assert {w for m, w in shapes if m == 8} == {1}
    with pytest.raises(ValueError, match="leaves no writes for m=8"):
        training_examples(4, register_counts=(8,), writes=(2,), max_assignments=8)
    with pytest.raises(ValueError, match="n_examples must be >= 1"):
        training_examples(0)
    with pytest.raises(ValueError, match="distractors must be counts >= 0"):
        training_examples(3, distractors=())
    with pytest.raises(ValueError, match=r"read_rate must lie in \[0, 1\]; got 1.5"):
        training_examples(3, read_rate=1.5)
    with pytest.raises(ValueError, match=r"pad_rows must lie in \[0, 1\]; got -0.1"):
        training_examples(3, pad_rows=-0.1)


def test_probe_schedules_are_those_of_the_probe_sets(tasks):
    """The RNG replay covers every schedule (and complement) of the seed-0 probe sets."""
    replayed = probe_schedules()
    assert len(replayed) == 2 * 128 * (1 + 4 + len(OVERWRITE_LENGTHS))
    for name in REGISTER_TASKS:
        for _, ds in datasets(tasks[(name, "query")]):
            assert {schedule_of(t) for t in ds.texts} <= replayed


def test_training_schedules_never_repeat_a_probe_schedule():
    probes = probe_schedules()
    default = training_examples(3000, seed=0)
    assert not {schedule_of(e.text) for e in default} & probes
    # m = 1 with 16 writes is the one probe shape with a small space (2^16 schedules,
    # 256 of them probed): there the exclusion has something to do
    kw = {"register_counts": (1,), "writes": (16,), "seed": 0}
    kept = training_examples(2000, **kw)
    raw = training_examples(2000, exclude_probe_schedules=False, **kw)
    assert sum(schedule_of(e.text) in probes for e in raw) > 0
    assert sum(schedule_of(e.text) in probes for e in kept) == 0
