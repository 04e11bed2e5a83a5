"""Final-token capture (probekit.analysis.capture), causal patching (probekit.analysis.causal)
and the prefill mechanisms they run (probekit.mechanisms.prefill).

Tiny random Llamas: every check is against a slower definition or an exact invariant
of SEMANTICS.md's readout rule.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import pytest
import torch
from engine_helpers import random_ids

from probekit.analysis.capture import capture_final, depth_hook_names
from probekit.analysis.causal import (
    flip_statistics,
    partner_index,
    patched_label_logits,
    readout_logits,
    reference_patched_logits,
)
from probekit.mechanisms.prefill import (
    MECHANISMS,
    LatentFeedbackMechanism,
    Mechanism,
    RecirculationMechanism,
    mechanism_class,
    register,
)
from probekit.mechanisms.regimes import Regime, plan

torch.set_num_threads(1)
ATOL = 2e-5
L = 5  # tiny-5 (conftest)
NONE, FULL = Regime("none"), Regime("full")


@pytest.fixture(scope="module")
def mech():
    return RecirculationMechanism(3, 1, alpha=0.5)


def plain_final_logits(engine, ids, rec=None, mask=None):
    return engine.run(ids, rec, mask=mask, return_logits=True).logits[:, -1]


# ---------------------------------------------------------------------- mechanisms
def test_unknown_or_missing_mechanism():
    assert mechanism_class("recirculation") is RecirculationMechanism
    with pytest.raises(ValueError, match="mechanism must be one of"):
        mechanism_class("loop")


def test_both_mechanisms_are_registered_the_same_way(monkeypatch):
    assert MECHANISMS == {"recirculation": RecirculationMechanism,
                          "latent-feedback": LatentFeedbackMechanism}
    monkeypatch.setattr("probekit.mechanisms.prefill.MECHANISMS", dict(MECHANISMS))

    @register
    class Later(Mechanism):
        name = "later"

        def run(self, engine, input_ids, regime, *, fwd_hooks=()):
            raise NotImplementedError

    assert mechanism_class("later") is Later


def test_recirculation_has_no_passes_regime():
    """Jacobi passes are latent feedback's (SEMANTICS.md); recirculation says so, naming the
    flag, and any other regime or a string is refused before anything runs."""
    with pytest.raises(ValueError, match=r"^--recurrence passes=3: the recirculation mechanism "
                                         r"runs none, last-<k>, full; not passes=<n> "
                                         r"\(--mechanism latent-feedback runs it\)$"):
        RecirculationMechanism.check_regime(Regime.parse("passes=3"))
    LatentFeedbackMechanism.check_regime(Regime.parse("passes=3"))
    with pytest.raises(TypeError, match=r"regime must be a Regime"):
        RecirculationMechanism.check_regime("full")


def test_bad_recirculation_parameters_fail_at_construction():
    with pytest.raises(ValueError, match=r"source \(2\) must be a deeper block than destination"):
        RecirculationMechanism(2, 2)


# ------------------------------------------------------------------------ capture
@pytest.mark.parametrize("regime", ["none", "last-1", "last-3", "full"])
def test_capture_matches_the_engine_and_hook_names(tiny_engine, mech, regime):
    """Depth r of the capture is run_with_cache's hook at the final token; the readout
    logits from depth L equal the engine's own logits."""
    ids, regime = random_ids(3, 10, seed=1), Regime.parse(regime)
    cap = capture_final(tiny_engine, mech, ids, regime)
    assert cap.resid.shape == (3, L + 1, 64) and cap.position == 9 and cap.pass_index == 0
    p = plan(regime, [10] * 3)
    rec = None if p.off else mech.recurrence()
    names = depth_hook_names(L)
    res, acts = tiny_engine.run_with_cache(ids, rec, names=names, mask=p.mask,
                                           block_size=p.block_size, return_logits=True)
    for r, name in enumerate(names):
        assert torch.allclose(cap.resid[:, r], acts[name][:, -1], atol=ATOL), r
    assert torch.allclose(readout_logits(tiny_engine, cap.readout_top), res.logits[:, -1],
                          atol=ATOL)
    assert cap.cache.lengths == [9] * L


@pytest.mark.parametrize("regime", ["none", "last-3", "full"])
def test_the_fast_and_the_hooked_capture_agree(tiny_engine, mech, regime):
    """Recirculation captures by re-running the final position; any extra hook forces the
    general path, which reads every depth through hooks during the run."""
    ids, regime = random_ids(3, 10, seed=14), Regime.parse(regime)
    fast = capture_final(tiny_engine, mech, ids, regime)
    noop = [("blocks.0.hook_resid_pre", lambda act, hook=None: act)]
    hooked = capture_final(tiny_engine, mech, ids, regime, fwd_hooks=noop)
    assert torch.allclose(fast.resid, hooked.resid, atol=ATOL)
    assert torch.allclose(fast.readout_top, hooked.readout_top, atol=ATOL)
    assert fast.cache.lengths == hooked.cache.lengths == [9] * L
    for a, b in zip(fast.cache.keys, hooked.cache.keys, strict=True):
        assert torch.allclose(a[:, :, :9], b[:, :, :9], atol=ATOL)


def test_depth_zero_is_the_token_embedding(tiny_engine, mech):
    ids = random_ids(2, 6, seed=2)
    cap = capture_final(tiny_engine, mech, ids, FULL)
    emb = tiny_engine.embed(ids[:, -1:])[:, 0]
    assert torch.equal(cap.resid[:, 0], emb)


def test_last_1_equals_none_at_the_final_token(tiny_engine, mech):
    """The final position's own recirculation cannot reach its readout."""
    ids = random_ids(2, 12, seed=3)
    none = capture_final(tiny_engine, mech, ids, NONE).resid
    last1 = capture_final(tiny_engine, mech, ids, Regime.parse("last-1")).resid
    last3 = capture_final(tiny_engine, mech, ids, Regime.parse("last-3")).resid
    assert torch.allclose(none, last1, atol=ATOL)
    assert (last3 - none).abs().max() > 1e-2  # two earlier positions recirculated


def test_depths_up_to_destination_plus_one_never_change(tiny_engine, mech):
    """Blocks 0..d keep first-pass keys/values, so depths 0..d+1 (d = 1) match `none`
    under every regime, and deeper ones do not under `full`."""
    ids = random_ids(2, 12, seed=4)
    none = capture_final(tiny_engine, mech, ids, NONE).resid
    full = capture_final(tiny_engine, mech, ids, FULL).resid
    diff = (full - none).abs().amax(dim=(0, 2))
    assert (diff[:3] < ATOL).all()
    assert (diff[3:] > 1e-2).all()


def test_pass_one_starts_from_the_mixed_destination(tiny_engine, mech):
    """pass_index=1: depths 0..d come from pass 0, depth d+1 is z'_d = mix(z_s, z_d)."""
    ids = random_ids(2, 8, seed=5)
    p0 = capture_final(tiny_engine, mech, ids, FULL)
    p1 = capture_final(tiny_engine, mech, ids, FULL, pass_index=1)
    assert p1.pass_index == 1
    assert torch.allclose(p1.resid[:, :2], p0.resid[:, :2], atol=ATOL)
    z_s, z_d = p0.resid[:, 4], p0.resid[:, 2]  # outputs of blocks s=3 and d=1
    # SEMANTICS.md, written out: z'_d = alpha f(z_s) + (1 - alpha) z_d, alpha = 0.5 (no ramp),
    # f(z_s) = ||z_d|| / ||z_s|| * z_s
    ratio = z_d.norm(dim=-1, keepdim=True) / z_s.norm(dim=-1, keepdim=True)
    expected = 0.5 * ratio * z_s + 0.5 * z_d
    assert torch.allclose(p1.resid[:, 2], expected, atol=ATOL)
    assert torch.allclose(p1.readout_top, p0.resid[:, -1], atol=ATOL)  # logits: pass 0
    # no second pass at the final token under `none`: the state as of pass 1 is pass 0's
    none = capture_final(tiny_engine, mech, ids, NONE)
    assert torch.allclose(capture_final(tiny_engine, mech, ids, NONE, pass_index=1).resid,
                          none.resid, atol=ATOL)


def test_capture_rejects_ragged_or_flat_input(tiny_engine, mech):
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, T\] with equal-length rows"):
        capture_final(tiny_engine, mech, torch.tensor([1, 2, 3]), NONE)


# ------------------------------------------------------------------------- causal
@pytest.mark.parametrize("regime", ["none", "last-3", "full"])
def test_fast_patch_equals_the_hooked_rerun(tiny_engine, mech, regime):
    """The fast path (blocks r..L-1 for the final position on the cache) equals the slow
    definition (the whole regime re-run with a hook replacing the residual)."""
    ids, regime = random_ids(2, 9, seed=6), Regime.parse(regime)
    cap = capture_final(tiny_engine, mech, ids, regime)
    donors = capture_final(tiny_engine, mech, random_ids(2, 9, seed=7), regime).resid
    vocab = list(range(257))
    fast = patched_label_logits(tiny_engine, cap, donors, vocab)
    for r in (0, 2, 4, L):
        slow = reference_patched_logits(tiny_engine, mech, ids, regime, donors[:, r], r)
        assert torch.allclose(fast[:, r], slow, atol=ATOL), r
    assert cap.cache.lengths == [8] * L  # the cache is left as it was


def test_self_patch_is_a_no_op_and_top_patch_copies_the_donor(tiny_engine, mech):
    ids, other = random_ids(3, 9, seed=8), random_ids(3, 9, seed=9)
    labels = [5, 17, 200]
    cap = capture_final(tiny_engine, mech, ids, FULL)
    clean = readout_logits(tiny_engine, cap.readout_top)[:, labels]
    same = patched_label_logits(tiny_engine, cap, cap.resid, labels)
    assert torch.allclose(same, clean[:, None].expand_as(same), atol=ATOL)
    donor = capture_final(tiny_engine, mech, other, FULL)
    top = patched_label_logits(tiny_engine, cap, donor.resid, labels, depths=[L])[:, 0]
    assert torch.allclose(top, readout_logits(tiny_engine, donor.readout_top)[:, labels],
                          atol=ATOL)


def test_depth_zero_patch_changes_nothing_when_tokens_match(tiny_engine, mech):
    """Prompts ending with the same token have the same depth-0 residual."""
    ids = random_ids(2, 9, seed=10)
    ids[:, -1] = 58  # ':'
    cap = capture_final(tiny_engine, mech, ids, NONE)
    swapped = patched_label_logits(tiny_engine, cap, cap.resid.flip(0), [1, 2], depths=[0, 3])
    clean = readout_logits(tiny_engine, cap.readout_top)[:, [1, 2]]
    assert torch.allclose(swapped[:, 0], clean, atol=ATOL)
    assert (swapped[:, 1] - clean).abs().max() > 1e-3


def test_partner_index():
    assert partner_index(np.array([0, 1, 0, -1, 1])).tolist() == [2, 4, 0, -1, 1]
    with pytest.raises(ValueError, match="pair 0 has 3 members; a matched pair has 2"):
        partner_index(np.array([0, 0, 0]))


def test_flip_statistics_by_hand():
    # Examples 0/1 and 2/3 are pairs with labels 0/1. Columns: label-0 logit, label-1 logit.
    labels = np.array([0, 1, 0, 1])
    partners = np.array([1, 0, 3, 2])
    clean = np.array([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0], [3.0, 0.0]])  # example 3 is wrong
    patched = np.array([
        [[2.0, 0.0], [0.0, 1.0]],   # depth 1: prefers the partner's label 1 -> flip
        [[0.0, 2.0], [0.0, 2.0]],   # never flips
        [[2.0, 0.0], [1.0, 0.5]],   # shifts toward label 1 but no flip
        [[3.0, 0.0], [0.0, 3.0]],   # model wrong unpatched: not counted
    ])
    s = flip_statistics(clean, patched, labels, partners)
    assert s.accuracy == 0.75 and s.n_recipients == 4 and s.n_correct == 3
    assert s.flip_rate.tolist() == [0.0, 1 / 3]
    assert np.allclose(s.flip_se, [0.0, np.sqrt(1 / 3 * 2 / 3 / 3)])
    # ld = logit(partner's label) - logit(own label): shifts 0, and (3 + 0 + 1.5 + (-6)) / 4
    moved = np.array([3.0, 0.0, 1.5, -6.0])
    assert np.allclose(s.shift, [0.0, moved.mean()])
    assert np.allclose(s.shift_se, [0.0, moved.std() / 2])


class _Plain(Mechanism):
    """A mechanism written from scratch: the interface is enough for capture and patching."""

    name = "plain"

    def run(self, engine, input_ids, regime, *, fwd_hooks=()):
        return engine.forward(input_ids, fwd_hooks=fwd_hooks, return_cache=True)


def test_a_new_mechanism_only_needs_run(tiny_engine):
    ids = random_ids(2, 7, seed=11)
    cap = capture_final(tiny_engine, _Plain(), ids, NONE)
    assert torch.allclose(readout_logits(tiny_engine, cap.readout_top),
                          plain_final_logits(tiny_engine, ids), atol=ATOL)


@pytest.mark.parametrize("regime", ["last-3", "full", "passes=3"])
def test_the_contract_holds_for_latent_feedback(tiny_model, tiny_engine, regime):
    """Capture and the fast patch rely only on the Mechanism contract: they must agree with
    latent feedback's own prefill and with the hooked re-run, multi-pass readout included."""
    from probekit.mechanisms.latent_feedback import FeedbackGate, prefill

    gate = FeedbackGate.for_model(tiny_model, init="random", seed=1)
    lf = LatentFeedbackMechanism(gate, tiny_model)
    ids, other = random_ids(2, 9, seed=12), random_ids(2, 9, seed=13)
    regime = Regime.parse(regime)
    cap = capture_final(tiny_engine, lf, ids, regime)
    assert cap.pass_index == (2 if regime.kind == "passes" else 0)
    own = prefill(tiny_engine, ids, gate, regime, return_logits=True).logits[:, -1]
    assert torch.allclose(readout_logits(tiny_engine, cap.readout_top), own, atol=ATOL)
    donors = capture_final(tiny_engine, lf, other, regime).resid
    fast = patched_label_logits(tiny_engine, cap, donors, list(range(257)))
    for r in (0, 3):
        slow = reference_patched_logits(tiny_engine, lf, ids, regime, donors[:, r], r)
        assert torch.allclose(fast[:, r], slow, atol=ATOL), r
