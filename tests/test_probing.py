"""Depth probes with grouped cross-validation (App. F "Probe construction")."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.exceptions import NotFittedError

from probekit.analysis.probing import DepthProbe, grouped_folds


def toy(n_groups=64, n_depths=4, d_model=64, strength=1.0, seed=0):
    """Groups of four with balanced labels. Depth 0: identical features for every example
    (the shared final token under standard prefill); depth 1: noise; depth >= 2: noise
    plus a planted linear signal along one random direction."""
    rng = np.random.default_rng(seed)
    y = np.tile([0, 1, 1, 0], n_groups)
    groups = np.repeat(np.arange(n_groups), 4)
    X = rng.normal(size=(y.size, n_depths, d_model))
    X[:, 0] = rng.normal(size=d_model)
    direction = rng.normal(size=d_model) / np.sqrt(d_model)
    X[:, 2:] += strength * (2 * y - 1)[:, None, None] * direction * np.sqrt(d_model)
    return X, y, groups


def test_recovers_a_planted_linear_signal():
    X, y, groups = toy()
    probe = DepthProbe().fit(X, y, groups)
    assert probe is not None and probe.n_depths_ == 4
    assert (probe.accuracy_mean_[2:] > 0.9).all()
    assert probe.accuracy_mean_[1] < 0.65
    assert probe.fold_accuracies_.shape == (4, 4)
    assert probe.accuracy_std_.shape == (4,)


def test_shuffled_labels_stay_near_chance():
    X, y, groups = toy()
    shuffled = np.random.default_rng(1).permutation(y)
    probe = DepthProbe().fit(X, shuffled, groups)
    assert (probe.accuracy_mean_ < 0.65).all()


def test_identical_features_give_chance():
    X, y, groups = toy()
    probe = DepthProbe().fit(X, y, groups)
    assert probe.chance_ == 0.5  # labels are balanced within every group
    assert probe.accuracy_mean_[0] == pytest.approx(probe.chance_)


def test_chance_is_the_majority_rate_of_each_test_fold():
    X, y, groups = toy()
    y = np.tile([0, 1, 1, 1], 64)  # 75 % ones in every group
    probe = DepthProbe().fit(X, y, groups)
    assert probe.chance_ == pytest.approx(0.75)
    assert probe.accuracy_mean_[0] <= probe.chance_ + 1e-12


def test_folds_never_split_a_group():
    _, y, groups = toy(n_groups=30)
    folds = grouped_folds(y, groups, n_folds=4, seed=0)
    assert len(folds) == 4
    tested = np.concatenate([test for _, test in folds])
    assert np.array_equal(np.sort(tested), np.arange(y.size))  # every example tested once
    for train, test in folds:
        assert not set(groups[train]) & set(groups[test])
        assert np.bincount(y[test]).tolist() == [test.size // 2] * 2


def leaky_groups(n_groups=40, size=4, noise_dims=16, seed=0):
    """Each group with its own feature signature: feature ``g`` is ``+1`` for group ``g``'s
    label-1 members, ``-1`` for its label-0 members and 0 for every other example. Within a
    group it predicts the label perfectly; across groups it carries nothing (a test group's
    feature is all zero in any training fold that holds none of its members). Labels are
    balanced within every group, as in the task generators; the rest is noise."""
    rng = np.random.default_rng(seed)
    groups = np.repeat(np.arange(n_groups), size)
    y = np.concatenate([rng.permutation([0, 1] * (size // 2)) for _ in range(n_groups)])
    signature = np.zeros((y.size, n_groups))
    signature[np.arange(y.size), groups] = 2 * y - 1
    X = np.concatenate([signature, rng.normal(size=(y.size, noise_dims))], axis=1)
    return X[:, None], y, groups  # one depth


def test_group_signatures_do_not_leak_through_grouped_folds():
    """SEMANTICS.md "Probing": no group is in both train and test, so a feature that only
    identifies the group (and its label within the group) gives chance under grouped CV;
    with every example its own group (ungrouped CV) the same data looks perfectly decodable
    -- the leak grouped folds exist to stop."""
    X, y, groups = leaky_groups()
    grouped = DepthProbe().fit(X, y, groups)
    assert grouped.chance_ == 0.5
    assert grouped.accuracy_mean_[0] < 0.6
    ungrouped = DepthProbe().fit(X, y, np.arange(y.size))
    assert ungrouped.accuracy_mean_[0] > 0.9


def test_folds_depend_on_the_seed_only():
    _, y, groups = toy(n_groups=30)
    same = [t.tolist() for _, t in grouped_folds(y, groups, seed=5)]
    assert same == [t.tolist() for _, t in grouped_folds(y, groups, seed=5)]
    assert same != [t.tolist() for _, t in grouped_folds(y, groups, seed=6)]


@pytest.mark.parametrize("kwargs, args, message", [
    ({}, "2d", r"X must have shape \[n_examples, n_depths, d_model\]"),
    ({}, "short_y", r"y must have shape \[n_examples\]"),
    ({}, "short_groups", r"groups must have shape \[n_examples\]"),
    ({}, "three_groups", "groups has 3 distinct groups but n_folds=4"),
    ({}, "one_class", "y has a single class"),
    ({"C": 0.0}, "ok", "C must be > 0"),
    ({"n_folds": 1}, "ok", "n_folds must be an integer >= 2"),
])
def test_errors_name_the_wrong_parameter(kwargs, args, message):
    X, y, groups = toy(n_groups=8)
    inputs = {
        "2d": (X[:, 0], y, groups),
        "short_y": (X, y[:-1], groups),
        "short_groups": (X, y, groups[:-1]),
        "three_groups": (X[:12], y[:12], groups[:12]),
        "one_class": (X, np.zeros_like(y), groups),
        "ok": (X, y, groups),
    }[args]
    with pytest.raises(ValueError, match=message):
        DepthProbe(**kwargs).fit(*inputs)


def test_init_only_stores_parameters_and_clones():
    probe = DepthProbe(C=0.5, n_folds=3, seed=7)
    assert probe.get_params() == {"C": 0.5, "n_folds": 3, "max_iter": 1000, "seed": 7,
                                  "standardize": True}
    assert clone(probe).get_params() == probe.get_params()


def test_to_dict_needs_fit_and_is_json():
    probe = DepthProbe()
    with pytest.raises(NotFittedError, match="This DepthProbe instance is not fitted yet"):
        probe.to_dict()
    X, y, groups = toy()
    out = json.loads(json.dumps(probe.fit(X, y, groups).to_dict()))
    assert out["n_depths"] == 4 and len(out["accuracy_mean"]) == 4
    assert out["chance"] == 0.5 and out["params"]["n_folds"] == 4


def test_without_standardisation_still_recovers_the_signal():
    X, y, groups = toy()
    probe = DepthProbe(standardize=False).fit(X, y, groups)
    assert (probe.accuracy_mean_[2:] > 0.9).all()


def test_full_model_sized_probe_recovers_the_signal():
    # SmolLM2-135M: 31 residual depths, d_model 576; ~256 examples. How long it takes is
    # benchmarks/bench_probing.py's to measure (a wall-clock bound here was flaky on a
    # shared machine and proved nothing about the result).
    X, y, groups = toy(n_depths=31, d_model=576, strength=0.3)
    probe = DepthProbe().fit(X.astype(np.float32), y, groups)
    assert (probe.accuracy_mean_[2:] > 0.9).all()
