"""Tests that pin formulas, boundaries and messages a mutation run found unpinned.

Each test here kills mutants that survived ``tests/mutation/run.sh`` (mutmut over the
core maths: engine, KV cache, recirculation, latent feedback, regimes, lag, probing);
tests/mutation/README.md lists them. Expected values come from SEMANTICS.md or are
written out by hand, never computed with the function under test.
"""

import numpy as np
import pytest
import torch
from engine_helpers import random_ids

from probekit.analysis import lag
from probekit.mechanisms.recirculation import Recirculation
from probekit.mechanisms.regimes import Regime, parse_regimes, plan


# ----------------------------------------------------------------------- regimes
def test_one_pass_is_a_valid_regime():
    # passes=1 is the plain model (Regime's docstring): the bound is n >= 1, not n >= 2.
    assert Regime("passes", passes=1).passes == 1
    assert Regime.parse("passes=1") == Regime("passes", passes=1)
    assert plan(Regime.parse("passes=1"), [4]).passes == 1


def test_no_regime_message_is_whole():
    with pytest.raises(ValueError, match=r"^give at least one regime: none, last-k \(with "
                                         r"--k\), last-<k>, full or passes=<n>$"):
        parse_regimes([" , "])


def test_plans_accept_length_one_rows():
    # lengths >= 1: a one-token prompt is a valid row for every regime but last-k.
    assert plan(Regime("full"), [1]).block_size == 1
    assert plan(Regime("none"), [1, 3]).mask.shape == (2, 3)
    assert plan(Regime.parse("passes=2"), [1]).block_size == 1


def test_none_plan_mask_is_boolean():
    # The engine takes bool (or 0/1 integer) masks; a float mask of zeros is rejected.
    mask = plan(Regime("none"), [3, 2]).mask
    assert mask.dtype == torch.bool


# --------------------------------------------------------------------------- lag
def test_check_lag_inputs_takes_lists_and_one_window():
    ids = lag.check_lag_inputs([[5, 6, 7, 8], [1, 2, 3, 4]], [0], 1)
    assert ids.dtype == torch.long and ids.tolist() == [[5, 6, 7, 8], [1, 2, 3, 4]]
    one = lag.check_lag_inputs(torch.tensor([5, 6, 7, 8]), [0], 1)
    assert one.tolist() == [[5, 6, 7, 8]]
    with pytest.raises(ValueError, match=r"^input_ids must be \[windows, T\]; got shape "
                                         r"\(1, 2, 4\)$"):
        lag.check_lag_inputs(torch.zeros(1, 2, 4, dtype=torch.long), [0], 1)


def test_check_positions_bounds():
    lag.check_positions([0], 3, 1)  # max_lag 1 and T = max_lag + 2 are allowed: last = 0
    with pytest.raises(ValueError, match=r"^max_lag must be an integer >= 1; got True$"):
        lag.check_positions([0], 10, True)
    with pytest.raises(ValueError, match=r"^no positions to recirculate: give at least one "
                                         r"\(--positions a:b\)$"):
        lag.check_positions([], 10, 2)


def test_parse_positions_details():
    assert lag.parse_positions(None, 3, 5) == []  # no room: nothing, not position 0
    assert lag.parse_positions("1,5:7", 20, 5) == [1, 5, 6]  # a single item, then more
    with pytest.raises(ValueError, match=r"^--positions '0:2, a:b:c:d': expected ranges"):
        lag.parse_positions("0:2, a:b:c:d", 20, 5)
    with pytest.raises(ValueError, match=r"^--positions '0:2,x': expected ranges"):
        lag.parse_positions(["0:2", "x"], 20, 5)
    with pytest.raises(ValueError, match=r"^--positions '0:4:0': step must be >= 1$"):
        lag.parse_positions("0:4:0", 20, 5)


def test_lag_needs_a_recirculation_named_in_the_error(tiny_engine):
    with pytest.raises(TypeError, match=r"^lag analysis needs a Recirculation \(a recurrence "
                                        r"that acts only after the first pass, through the "
                                        r"position mask\); got str$"):
        lag.single_token_benefit(tiny_engine, random_ids(1, 8), "rec", [0], 1)


def test_lag_zero_guard_reports_the_lag_zero_entry():
    broken = torch.zeros(1, 2, 3)
    broken[0, 1, 0] = 0.5
    broken[0, 0, 1] = 7.0  # a large lag-1 entry must not be what the message reports
    with pytest.raises(RuntimeError, match=r"max \|B\(t,0\)\| = 0\.5\)"):
        lag._check_lag_zero(broken, "single-token")


def test_lag_progress_bar_only_when_asked(tiny_engine, capsys):
    rec = Recirculation(3, 1, alpha=0.5)
    ids = random_ids(1, 6)
    lag.single_token_benefit(tiny_engine, ids, rec, [0, 1], 1, progress=False)
    assert "positions" not in capsys.readouterr().err
    lag.single_token_benefit(tiny_engine, ids, rec, [0, 1], 1, progress=True)
    err = capsys.readouterr().err
    assert err.startswith("\rpositions:")
    assert not err.endswith("\n")  # leave=False: the finished bar is cleared, not kept


# ----------------------------------------------------------------------- probing
def planted(n_groups=16, d_model=8, seed=0, scale=1.0, labels=(0, 1, 1, 0)):
    """Groups of four with ``labels`` each; depth 0 carries the label along one axis
    (times ``scale``) plus noise, depth 1 is noise."""
    rng = np.random.default_rng(seed)
    y = np.tile(labels, n_groups)
    groups = np.repeat(np.arange(n_groups), 4)
    X = rng.normal(size=(y.size, 2, d_model))
    X[:, 0, 0] = scale * ((2 * y - 1) * 2.0 + 0.3 * rng.normal(size=y.size))
    return X, y, groups


@pytest.mark.filterwarnings("ignore:The least populated class:UserWarning")
def test_grouped_folds_defaults_and_boundaries():
    from probekit.analysis.probing import grouped_folds

    _, y, groups = planted(n_groups=12)
    default = grouped_folds(y, groups)
    assert len(default) == 4  # four folds (the paper's), seed 0
    assert [t.tolist() for _, t in default] == [
        t.tolist() for _, t in grouped_folds(y, groups, 4, 0)]
    assert [t.tolist() for _, t in default] != [
        t.tolist() for _, t in grouped_folds(y, groups, 4, 1)]
    # exactly n_folds groups is enough; one example per group is a valid test fold
    assert len(grouped_folds(y[:16], groups[:16], 4)) == 4
    singles = grouped_folds([0, 0, 0, 0, 1], [0, 1, 2, 3, 4], 4)
    assert sorted(t.size for _, t in singles) == [1, 1, 1, 2]


@pytest.mark.filterwarnings("ignore:The least populated class:UserWarning")
def test_grouped_folds_rejects_an_empty_test_fold():
    from probekit.analysis.probing import grouped_folds

    # Four groups, four folds, yet the stratified assignment leaves one fold empty.
    groups = [0, 0, 1, 1, 1, 1, 2, 2, 3]
    y = [0, 0, 0, 1, 1, 0, 0, 0, 1]
    with pytest.raises(ValueError, match=r"^n_folds=4 leaves a test fold empty for these "
                                         r"groups$"):
        grouped_folds(y, groups, 4, seed=0)


def test_depth_probe_defaults():
    from probekit.analysis.probing import DepthProbe

    assert DepthProbe().get_params() == {"C": 1.0, "n_folds": 4, "max_iter": 1000,
                                         "seed": 0, "standardize": True}


def test_depth_probe_parameter_bounds():
    from probekit.analysis.probing import DepthProbe

    X, y, groups = planted(n_groups=4)
    assert DepthProbe(n_folds=2).fit(X, y, groups).fold_accuracies_.shape == (2, 2)
    with pytest.warns(Warning):  # one lbfgs iteration is allowed (and does not converge)
        DepthProbe(max_iter=1).fit(X, y, groups)
    with pytest.raises(ValueError, match=r"^max_iter must be an integer >= 1; got 1\.5$"):
        DepthProbe(max_iter=1.5).fit(X, y, groups)


def test_depth_probe_uses_its_c_and_max_iter():
    from sklearn.exceptions import ConvergenceWarning

    from probekit.analysis.probing import DepthProbe

    X, y, groups = planted(labels=(0, 1, 1, 1))
    assert DepthProbe().fit(X, y, groups).accuracy_mean_[0] > 0.95
    # A vanishing C shrinks every weight to ~0, leaving the (unpenalised) intercept: the
    # constant majority prediction, at most chance (75 % ones).
    weak = DepthProbe(C=1e-9).fit(X, y, groups)
    assert weak.accuracy_mean_[0] <= weak.chance_ + 1e-12
    with pytest.warns(ConvergenceWarning):  # max_iter reaches lbfgs (its default is 100)
        DepthProbe(max_iter=2).fit(X, y, groups)


def test_standardize_false_fits_raw_features():
    from probekit.analysis.probing import DepthProbe

    # The signal lives in a dimension a million times smaller than the noise: raw, the
    # L2 penalty forbids the huge weight it needs; standardised, it is easy.
    X, y, groups = planted(scale=1e-6)
    assert DepthProbe(standardize=True).fit(X, y, groups).accuracy_mean_[0] > 0.95
    raw = DepthProbe(standardize=False).fit(X, y, groups)
    assert raw.accuracy_mean_[0] <= raw.chance_ + 1e-12


def test_depth_probe_shape_error_names_n_examples():
    from probekit.analysis.probing import DepthProbe

    X, y, groups = planted(n_groups=4)  # X: [16, 2, 8]
    with pytest.raises(ValueError, match=r"^y must have shape \[n_examples\] = \(16,\); "
                                         r"got \(15,\)$"):
        DepthProbe().fit(X, y[:-1], groups)


def test_depth_probe_folds_follow_its_seed():
    from probekit.analysis.probing import DepthProbe, grouped_folds

    X, y, groups = planted(n_groups=12)
    a = DepthProbe(seed=3).fit(X, y, groups)
    b = DepthProbe(seed=3).fit(X, y, groups)
    expected = [t.tolist() for _, t in grouped_folds(y, groups, 4, 3)]
    assert [t.tolist() for _, t in a.folds_] == expected
    assert [t.tolist() for _, t in b.folds_] == expected


def test_to_dict_is_complete_and_needs_a_finished_fit():
    from sklearn.exceptions import NotFittedError

    from probekit.analysis.probing import DepthProbe

    X, y, groups = planted(n_groups=8)
    probe = DepthProbe()
    with pytest.raises(ValueError, match="y has a single class"):
        probe.fit(X, np.zeros_like(y), groups)  # fails after setting classes_
    with pytest.raises(NotFittedError, match="not fitted yet"):
        probe.to_dict()
    out = probe.fit(X, y, groups).to_dict()
    assert set(out) == {"params", "splitter", "n_depths", "n_groups", "classes", "chance",
                        "accuracy_mean", "accuracy_std", "fold_accuracies"}
    assert out["splitter"] == "StratifiedGroupKFold"
    assert out["n_groups"] == 8 and out["n_depths"] == 2 and out["classes"] == [0, 1]
    assert out["accuracy_std"] == probe.fold_accuracies_.std(axis=1).tolist()
    assert out["fold_accuracies"] == probe.fold_accuracies_.tolist()
    assert len(out["fold_accuracies"]) == 2 and len(out["fold_accuracies"][0]) == 4


# ----------------------------------------------------------------- recirculation
def test_block_indices_must_be_integers():
    from probekit.mechanisms.recirculation import RecirculationPath

    with pytest.raises(ValueError, match=r"^source must be an integer block index; got '3'$"):
        RecirculationPath("3", 1, 0.1)
    with pytest.raises(ValueError, match=r"^destination must be an integer block index; "
                                         r"got 1\.0$"):
        RecirculationPath(3, 1.0, 0.1)


def test_recirculation_needs_both_blocks():
    message = r"^give source and destination, or paths=\[RecirculationPath, \.\.\.\]$"
    with pytest.raises(ValueError, match=message):
        Recirculation(source=3)
    with pytest.raises(ValueError, match=message):
        Recirculation(destination=1)


def test_paths_or_blocks_not_both_and_not_none():
    from probekit.mechanisms.recirculation import RecirculationPath

    path = RecirculationPath(3, 1, 0.1)
    for kw in ({"source": 3}, {"destination": 1}, {"source": 3, "destination": 1}):
        with pytest.raises(ValueError, match=r"^give either source/destination or paths, "
                                             r"not both$"):
            Recirculation(paths=[path], **kw)
    with pytest.raises(ValueError, match=r"^paths must not be empty$"):
        Recirculation(paths=[])


def test_recirculation_repr_names_every_path():
    from probekit.mechanisms.recirculation import RecirculationPath

    rec = Recirculation(paths=[RecirculationPath(4, 2, 0.3), RecirculationPath(2, 0, 0.2, 1.0)],
                        norm="none", ramp=3, iterations=2)
    assert repr(rec) == ("Recirculation(s=2 d=0 alpha=0.2 beta=1.0, s=4 d=2 alpha=0.3 "
                         "beta=None, norm=none, ramp=3, iterations=2)")


@pytest.mark.parametrize("n_blocks, pair", [
    (2, (1, 0)), (3, (2, 1)), (4, (3, 1)), (18, (12, 6)), (26, (17, 9)), (30, (20, 10)),
])
def test_default_pair_by_hand(n_blocks, pair):
    # s = round(2L/3), d = round(L/3), clipped to 0 <= d < s <= L-1 (worked out by hand)
    from probekit.mechanisms.recirculation import default_pair

    assert default_pair(n_blocks) == pair


@pytest.mark.parametrize("n_blocks", [1, 0, 2.0])
def test_default_pair_needs_two_blocks(n_blocks):
    from probekit.mechanisms.recirculation import default_pair

    with pytest.raises(ValueError, match=rf"^recirculation needs a model of at least 2 "
                                         rf"blocks; got {n_blocks}$"):
        default_pair(n_blocks)


def test_ratio_norm_rescales_a_short_source_too():
    from probekit.mechanisms.recirculation import mix

    # ||z_s|| = 0.5 (below 1): f(z_s) = ||z_d|| / ||z_s|| * z_s = (0, 5), not 0
    z_s, z_d = torch.tensor([[0.0, 0.5]]), torch.tensor([[3.0, 4.0]])
    out = mix(z_s, z_d, torch.tensor(1.0), torch.tensor(0.0), "ratio")
    assert torch.allclose(out, torch.tensor([[0.0, 5.0]]))


# ---------------------------------------------------------------------- KV cache
def filled_cache(batch=2, heads=1, length=4, head_dim=3, max_len=6, blocks=1, seed=0):
    from probekit.core.kv_cache import KVCache

    g = torch.Generator().manual_seed(seed)
    cache = KVCache(blocks, max_len)
    k = torch.randn(batch, heads, length, head_dim, generator=g)
    v = torch.randn(batch, heads, length, head_dim, generator=g)
    for b in range(blocks):
        cache.update(k, v, b)
    return cache, k, v


def test_cache_overflow_names_block_and_sizes():
    cache, k, v = filled_cache(length=4, max_len=6)
    with pytest.raises(RuntimeError, match=r"^KV cache overflow in block 0: 8 > max_len 6$"):
        cache.update(k, v, 0)


def test_kept_chunk_must_match_the_write():
    cache, k, v = filled_cache(batch=2, length=4, head_dim=3, max_len=8)
    cache.truncate(range(1), 2)
    keep = torch.tensor([[True, False], [False, True]])  # a chunk of 2 positions at 2
    # one position, same batch: only the length differs (and it is not head_dim, 3)
    with cache.keeping(2, keep), pytest.raises(
            RuntimeError, match=r"^block 0: a write of 1 positions at 2 does not match the "
                                r"kept chunk of 2 positions at 2$"):
        cache.update(k[:, :, :1], v[:, :, :1], 0)
    # the right length, but one row instead of two
    with cache.keeping(2, keep), pytest.raises(RuntimeError, match="does not match the kept"):
        cache.update(k[:1, :, :2], v[:1, :, :2], 0)


def test_truncate_to_the_current_length_is_allowed_and_longer_is_not():
    cache, _, _ = filled_cache(length=4)
    cache.truncate(range(1), 4)  # a no-op, not an error
    assert cache.lengths == [4]
    cache.truncate(range(1), 2)
    with pytest.raises(RuntimeError, match=r"^cannot truncate block 0 from 2 to 3$"):
        cache.truncate(range(1), 3)


def test_copy_defaults_to_every_position_and_is_independent():
    cache, k, v = filled_cache(batch=2, heads=1, length=4, head_dim=3, max_len=6)
    whole = cache.copy()
    assert whole.lengths == [4] and whole.max_len == 6
    assert torch.equal(whole.block_kv(0)[0], k) and torch.equal(whole.block_kv(0)[1], v)
    same = cache.copy(length=4)  # copying exactly what is there is fine
    assert torch.equal(same.block_kv(0)[0], k)
    whole.keys[0].zero_()
    assert torch.equal(cache.block_kv(0)[0], k)  # the original is untouched
    with pytest.raises(ValueError, match=r"^block 0 holds 4 positions, not 5$"):
        cache.copy(length=5)


def test_get_seq_length_reads_block_0_by_default():
    from probekit.core.kv_cache import KVCache

    cache = KVCache(2, 6)
    cache.update(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2), 0)
    cache.update(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2), 1)
    assert cache.get_seq_length() == 3 and cache.get_seq_length(1) == 1


# ------------------------------------------------------------------------ engine
class _StubBackend:
    """Just enough of a backend to build an engine around a stub model."""

    n_blocks, n_ctx, vocab_size = 2, 8, 10


@pytest.mark.parametrize("tokenizer, pad_id", [
    ({"pad_token_id": 3, "eos_token_id": 7}, 3),
    ({"pad_token_id": None, "eos_token_id": 7}, 7),
    ({"eos_token_id": 7}, 7),
    ({"pad_token_id": 3}, 3),
    ({"pad_token_id": None, "eos_token_id": None}, 0),
    ({}, 0),
])
def test_pad_id_is_pad_else_eos_else_zero(tokenizer, pad_id):
    from types import SimpleNamespace

    from probekit.core.engine import StepEngine

    model = SimpleNamespace(tokenizer=SimpleNamespace(**tokenizer))
    engine = StepEngine(model, backend=_StubBackend())
    assert engine.pad_id == pad_id and engine.model is model
    ids, lengths = engine.batch([[1, 2, 3], [4]])
    assert ids.tolist() == [[1, 2, 3], [4, pad_id, pad_id]] and lengths.tolist() == [3, 1]


def test_engine_keeps_its_model_and_names_its_backend(tiny_model):
    from probekit.core.engine import StepEngine

    assert StepEngine(tiny_model).model is tiny_model
    with pytest.raises(ValueError, match=r"^unknown backend 'bogus'"):
        StepEngine(tiny_model, "bogus")


def test_batch_shapes_limits_and_messages():
    from types import SimpleNamespace

    from probekit.core.engine import StepEngine

    engine = StepEngine(SimpleNamespace(tokenizer=None), backend=_StubBackend())
    ids, _ = engine.batch(torch.tensor([1, 2, 3]))  # one sequence as a 1-D tensor
    assert ids.tolist() == [[1, 2, 3]]
    with pytest.raises(ValueError, match=r"^input_ids must be \[batch, seq\]; got shape "
                                         r"\(1, 2, 3\)$"):
        engine.batch(torch.zeros(1, 2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^empty input: every sequence needs at least one "
                                         r"token$"):
        engine.batch([[1], []])
    assert engine.batch([[1] * 8])[0].shape == (1, 8)  # exactly n_ctx tokens fit
    engine.batch([[9]])  # the largest id, vocab - 1, is valid; vocab is not
    with pytest.raises(ValueError, match=r"^token ids must lie in \[0, 10\); got 1\.\.10$"):
        engine.batch([[1, 10]])


def test_active_mask_covers_exactly_the_real_tokens():
    from probekit.core.engine import StepEngine

    lengths = torch.tensor([2, 3])
    assert StepEngine.active_mask(None, lengths, 3).tolist() == [[True, True, False],
                                                                  [True, True, True]]
    got = StepEngine.active_mask(torch.tensor([0, 1, 1]), lengths, 3)
    assert got.tolist() == [[False, True, False], [False, True, True]]


def test_active_mask_rejects_float_zero_one_and_a_wrong_batch():
    from probekit.core.engine import StepEngine

    lengths = torch.tensor([3, 3])
    with pytest.raises(ValueError, match=r"^mask must be boolean \(or 0/1 integers\); got "
                                         r"float32$"):
        StepEngine.active_mask(torch.tensor([0.0, 1.0, 1.0]), lengths, 3)
    with pytest.raises(ValueError, match=r"^mask must be \[seq\] or \[batch, seq\] = 2 x 3; "
                                         r"got \(3, 3\)$"):
        StepEngine.active_mask(torch.ones(3, 3, dtype=torch.bool), lengths, 3)


class _RerunAll:
    """A recurrence that re-runs blocks 1.. from block 0's first-pass output, replacing
    every pair (``replace`` omitted), or with a ``replace`` of the wrong shape."""

    name = "rerun-all"
    capture_first = frozenset({0})

    def __init__(self, bad_replace=False):
        self.bad_replace = bad_replace

    def check(self, n_blocks):
        pass

    def begin(self, batch_size, seq_len):
        pass

    def form_input(self, step, embeds):
        return embeds

    def after_first_pass(self, step, captured, top, rerun):
        if self.bad_replace:
            rerun(1, captured[0], replace=torch.ones(1, 2, dtype=torch.bool))
        else:
            rerun(1, captured[0])


def test_rerun_without_replace_rewrites_every_pair_identically(tiny_engine):
    ids = random_ids(2, 6, seed=4)
    plain = tiny_engine.run(ids, return_cache=True)
    again = tiny_engine.run(ids, _RerunAll(), return_cache=True)
    assert torch.equal(again.log_probs, plain.log_probs)  # the readout is the first pass
    for b in range(tiny_engine.n_blocks):  # the same inputs recomputed: the same K/V
        for got, want in zip(again.cache.block_kv(b), plain.cache.block_kv(b)):
            assert torch.allclose(got, want, atol=1e-6)
    with pytest.raises(ValueError, match=r"^replace must be \[batch, pos\] = \(2, 1\); got "
                                         r"\(1, 2\)$"):
        tiny_engine.run(ids, _RerunAll(bad_replace=True))


def test_forward_is_one_parallel_chunk_at_its_temperature(tiny_engine):
    ids = random_ids(1, 7, seed=5)
    calls = []

    def hook(act, hook=None):
        calls.append(act.shape[1])
        return act

    out = tiny_engine.forward(ids, temperature=2.0, return_logits=True,
                              fwd_hooks=[("blocks.0.hook_resid_post", hook)])
    assert calls == [7]  # one chunk of all seven positions
    expected = torch.log_softmax(out.logits[:, :-1] / 2.0, -1).gather(-1, ids[:, 1:, None])
    assert torch.allclose(out.log_probs, expected[..., 0], atol=1e-6)


def test_run_with_cache_one_chunk_and_user_hooks(tiny_engine):
    ids = random_ids(1, 5, seed=6)
    seen = []

    def user(act, hook=None):
        seen.append(tuple(act.shape))
        return act

    name = "blocks.1.hook_resid_post"
    result, acts = tiny_engine.run_with_cache(ids, names=[name], block_size=5,
                                              fwd_hooks=[(name, user)])
    assert seen and seen[0][:2] == (1, 5)  # the user's hook ran too
    assert acts[name].shape == (1, 5, seen[0][2])
    assert not torch.isnan(acts[name]).any()


# --------------------------------------------------------------- latent feedback
@pytest.fixture(scope="module")
def random_gate(tiny_model):
    from probekit.mechanisms.latent_feedback import FeedbackGate

    return FeedbackGate.for_model(tiny_model, init="random", seed=2)


def test_gate_width_checks():
    from probekit.mechanisms.latent_feedback import FeedbackGate

    assert FeedbackGate(1).d_model == 1  # one dimension is a (degenerate) valid width
    for bad in (0, 2.0, "4"):
        with pytest.raises(ValueError, match=rf"^d_model must be a positive integer; got "
                                             rf"{bad!r}$"):
            FeedbackGate(bad)
    gate = FeedbackGate(4)
    with pytest.raises(ValueError, match=r"^gate of d_model 4 got states of width 5 and "
                                         r"embeddings of width 4$"):
        gate(torch.zeros(1, 2, 5), torch.zeros(1, 2, 4))
    with pytest.raises(ValueError, match=r"^gate of d_model 4 got states of width 4 and "
                                         r"embeddings of width 3$"):
        gate(torch.zeros(1, 2, 4), torch.zeros(1, 2, 3))


def test_gate_uses_its_eps_in_both_norms():
    from probekit.mechanisms.latent_feedback import FeedbackGate

    # Identity weights, unit norm weights: u = h * sigmoid(e / sqrt(mean(e^2) + eps)) and
    # out = u / sqrt(mean(u^2) + eps), written out by hand. Small inputs make eps matter.
    eps = 0.25
    gate = FeedbackGate(2, eps=eps)
    h, e = torch.tensor([[0.3, -0.1]]), torch.tensor([[0.2, 0.4]])
    gate_in = e / torch.sqrt((e ** 2).mean() + eps)
    u = h * torch.sigmoid(gate_in)
    expected = u / torch.sqrt((u ** 2).mean() + eps)
    assert torch.allclose(gate(h, e), expected, atol=1e-6)


def test_for_model_seed_and_init(tiny_model):
    from probekit.mechanisms.latent_feedback import FeedbackGate

    default = FeedbackGate.for_model(tiny_model, init="random")
    seeded = FeedbackGate.for_model(tiny_model, init="random", seed=0)
    assert torch.equal(default.W_U.weight, seeded.W_U.weight)  # the default seed is 0
    assert not torch.equal(default.W_U.weight, torch.eye(tiny_model.d_model))


def test_latent_feedback_construction_checks(tiny_model, random_gate):
    from probekit.mechanisms.latent_feedback import LatentFeedback

    rec = LatentFeedback(random_gate, tiny_model)
    assert rec.passes == 1 and rec.state is None  # defaults: one pass, no state yet
    with pytest.raises(ValueError, match=r"^passes must be an integer >= 1; got True$"):
        LatentFeedback(random_gate, tiny_model, passes=True)
    D = tiny_model.d_model
    with pytest.raises(ValueError, match=rf"^initial_state must be \[batch, {D}\]; got "
                                         rf"\(1, {D + 1}\)$"):
        LatentFeedback(random_gate, tiny_model, initial_state=torch.zeros(1, D + 1))
    n = tiny_model.n_blocks
    with pytest.raises(ValueError, match=rf"^LatentFeedback was built for a {n}-block model; "
                                         rf"the engine runs {n + 2} blocks$"):
        rec.check(n + 2)
    carried = LatentFeedback(random_gate, tiny_model, initial_state=torch.zeros(1, D))
    with pytest.raises(ValueError, match=r"^initial_state has 1 rows but the batch has 2$"):
        carried.begin(2, 5)


def test_latent_feedback_continuing_at_position_one_needs_the_state(tiny_engine, tiny_model,
                                                                    random_gate):
    from probekit.mechanisms.latent_feedback import LatentFeedback

    ids = random_ids(1, 4, seed=7)
    base = tiny_engine.forward(ids[:, :1], return_cache=True)
    cache = base.cache.copy(max_len=4)
    with pytest.raises(ValueError, match=r"^latent feedback at position 1 needs the state of "
                                         r"position 0"):
        tiny_engine.run(ids, LatentFeedback(random_gate, tiny_model), start=1, cache=cache)


def test_jacobi_passes_in_later_chunks_equal_token_by_token(tiny_engine, tiny_model,
                                                            random_gate):
    from probekit.mechanisms.latent_feedback import LatentFeedback

    # A chunk of K positions is exact after K passes, also when it is not the first chunk
    # (it then starts from the carried state h of the previous chunk's last position).
    ids = random_ids(2, 6, seed=8)
    exact = LatentFeedback(random_gate, tiny_model)
    want = tiny_engine.run(ids, exact, block_size=1)
    jacobi = LatentFeedback(random_gate, tiny_model, passes=3)
    got = tiny_engine.run(ids, jacobi, block_size=[1, 3, 2], readout="last")
    assert torch.allclose(got.log_probs, want.log_probs, atol=3e-5)
    assert torch.allclose(jacobi.state, exact.state, atol=3e-5)
    # and fewer passes than the chunk's width are not exact there
    short = tiny_engine.run(ids, LatentFeedback(random_gate, tiny_model, passes=2),
                            block_size=[1, 3, 2], readout="last")
    assert (short.log_probs - want.log_probs).abs().max() > 1e-4


def test_on_pass_sees_every_pass_in_order(tiny_engine, tiny_model, random_gate):
    from probekit.mechanisms.latent_feedback import LatentFeedback

    seen = []
    rec = LatentFeedback(random_gate, tiny_model, passes=3,
                         on_pass=lambda j, step, h: seen.append((j, step.start, h.shape[1])))
    tiny_engine.run(random_ids(1, 5, seed=9), rec, block_size=[2, 3], readout="last")
    assert seen == [(0, 0, 2), (1, 0, 2), (0, 2, 3), (1, 2, 3), (2, 2, 3)]


def test_first_jacobi_pass_fuses_only_each_chunks_first_position(tiny_engine, tiny_model,
                                                                 random_gate):
    from probekit.mechanisms.latent_feedback import LatentFeedback

    # Pass 1 of a chunk fuses its first position with the carried state and runs the
    # others on plain embeddings (Jacobi pass 1), read out from that pass (readout=True):
    # the same as token by token with feedback off inside each chunk. Chunks [2, 3, 1]
    # start at 0, 2 and 5; position 0 never has a state.
    ids = random_ids(2, 6, seed=10)
    chunked = LatentFeedback(random_gate, tiny_model)
    got = tiny_engine.run(ids, chunked, block_size=[2, 3, 1])
    stepped = LatentFeedback(random_gate, tiny_model)
    mask = torch.tensor([True, False, True, False, False, True])
    want = tiny_engine.run(ids, stepped, block_size=1, mask=mask)
    assert torch.allclose(got.log_probs, want.log_probs, atol=3e-5)
    assert torch.allclose(chunked.state, stepped.state, atol=3e-5)


def test_prefill_defaults_to_the_plain_regime(tiny_engine, random_gate):
    from probekit.mechanisms.latent_feedback import prefill

    ids = random_ids(1, 5, seed=11)
    default = prefill(tiny_engine, ids, random_gate)
    assert torch.equal(default.log_probs, prefill(tiny_engine, ids, random_gate,
                                                  "none").log_probs)
    assert torch.allclose(default.log_probs, tiny_engine.forward(ids).log_probs, atol=3e-5)
