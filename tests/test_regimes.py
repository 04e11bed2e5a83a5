"""Prefill regimes (probekit.mechanisms.regimes): one value type, parsed once, planned once.

Pure functions: no model. The engine-level meaning of each plan is pinned where it runs
(tests/test_capture.py for recirculation, tests/test_latent_feedback.py for latent feedback).
"""

import numpy as np
import pytest
import torch

from probekit.mechanisms.regimes import Regime, exact_chunks, parse_regimes, plan


# ------------------------------------------------------------------------- parsing
def test_parse_every_kind_and_print_it_back():
    assert Regime.parse("none") == Regime("none")
    assert Regime.parse(" FULL ") == Regime("full")
    assert Regime.parse("last-3") == Regime("last-k", k=3)
    assert Regime.parse("passes=4") == Regime("passes", passes=4)
    for word in ("none", "full", "last-3", "passes=4"):
        assert str(Regime.parse(word)) == word
    assert Regime.parse("last-2").needs_prompt_longer_than == 2
    assert Regime.parse("full").needs_prompt_longer_than == 0


@pytest.mark.parametrize("word, message", [
    ("jacobi", r"regime must be none, last-<k> \(e.g. last-2\), full or passes=<n>; "
               r"got 'jacobi'"),
    ("last-k", r"regime must be none, last-<k> \(e.g. last-2\), full or passes=<n>; "
               r"got 'last-k'"),
    ("last-0", r"regime last-k needs k >= 1 \(e.g. last-2\); got k=0"),
    ("passes=0", r"regime passes=<n> needs n >= 1; got 0"),
    ("passes=x", r"got 'passes=x'"),
])
def test_bad_words(word, message):
    with pytest.raises(ValueError, match=message):
        Regime.parse(word)


@pytest.mark.parametrize("kwargs, message", [
    ({"kind": "sometimes"}, r"regime must be none, last-<k>, full or passes=<n>; got 'sometimes'"),
    ({"kind": "last-k"}, r"regime last-k needs k >= 1 \(e.g. last-2\); got k=None"),
    ({"kind": "full", "k": 2}, r"only last-k takes k; got full with k=2"),
    ({"kind": "none", "passes": 2}, r"only passes=<n> takes a pass count; got none"),
    ({"kind": "passes", "passes": True}, r"regime passes=<n> needs n >= 1; got True"),
])
def test_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Regime(**kwargs)


def test_parse_regimes_expands_last_k_and_keeps_order():
    got = parse_regimes(["none,last-k", "full", "last-3", "none", "passes=2"], ks=[1, 2])
    assert [str(r) for r in got] == ["none", "last-1", "last-2", "full", "last-3", "passes=2"]
    assert parse_regimes(["last-k"], ks=[2]) == [Regime("last-k", k=2)]


def test_parse_regimes_errors():
    with pytest.raises(ValueError, match=r"--k must list integers >= 1 for last-k; got \[0\]"):
        parse_regimes(["last-k"], ks=[0])
    with pytest.raises(ValueError, match=r"give at least one regime"):
        parse_regimes([" , "])
    with pytest.raises(ValueError, match=r"got 'twice'"):
        parse_regimes(["full,twice"])


# --------------------------------------------------------------------------- plans
def test_plans_of_none_full_and_passes():
    none = plan(Regime("none"), [7, 5])
    assert none.off and none.block_size == 7 and none.passes == 1
    assert not none.mask.any() and none.mask.shape == (2, 7)
    full = plan(Regime("full"), [7, 5])
    assert full.mask is None and full.block_size == 1 and not full.off
    passes = plan(Regime.parse("passes=3"), [7, 5])
    assert passes.mask is None and passes.block_size == 7 and passes.passes == 3


def test_last_k_plan_of_equal_rows():
    p = plan(Regime.parse("last-2"), [7, 7])
    assert p.block_size == [5, 1, 1]
    assert p.mask.tolist() == [[False] * 5 + [True] * 2] * 2


def test_last_k_plan_of_ragged_rows_uses_each_rows_own_suffix():
    p = plan(Regime.parse("last-2"), torch.tensor([9, 12]))
    assert p.block_size == [7] + [1] * 5  # shortest row 9: parallel 0..6, then one by one
    assert p.mask[0].tolist() == [False] * 7 + [True] * 2 + [False] * 3
    assert p.mask[1].tolist() == [False] * 10 + [True] * 2
    assert sum(p.block_size) == 12


def test_last_k_needs_a_longer_prompt():
    with pytest.raises(ValueError, match=r"regime last-7 needs prompts longer than k=7 tokens; "
                                         r"the shortest prompt has 7"):
        plan(Regime.parse("last-7"), [9, 7])
    assert plan(Regime.parse("last-6"), [7]).block_size == [1] * 7


def test_plan_takes_regime_values_and_real_lengths():
    with pytest.raises(TypeError, match=r"regime must be a Regime \(Regime.parse\('full'\)\); "
                                        r"got 'full'"):
        plan("full", [3])
    with pytest.raises(ValueError, match=r"lengths must be a non-empty list of lengths >= 1"):
        plan(Regime("full"), [3, 0])
    with pytest.raises(ValueError, match=r"lengths must be a non-empty list of lengths >= 1"):
        plan(Regime("full"), [])
    # a fractional length is a caller's bug, not a length to truncate
    with pytest.raises(ValueError, match=r"lengths must be whole numbers; got \[3.0, 2.5\]"):
        plan(Regime("full"), [3.0, 2.5])
    assert plan(Regime.parse("last-1"), np.array([3.0, 2.0])).block_size == [1, 1, 1]


# ---------------------------------------------------------------------- exact chunks
def test_exact_chunks_end_at_every_marked_position():
    mask = np.array([[0, 1, 0, 0, 0, 0], [0, 0, 0, 1, 1, 0]], bool)
    assert exact_chunks(mask) == [2, 2, 1, 1]  # chunks end at 1, 3, 4 (any row); tail 5
    assert exact_chunks(np.zeros(5, bool)) == [5]
    assert exact_chunks(np.array([0, 0, 1], bool)) == [3]
    assert exact_chunks(torch.ones(4, dtype=torch.bool)) == [1, 1, 1, 1]
