"""The step engine and recirculation against SEMANTICS.md "Recirculation".

Tiny random Llamas for the exhaustive checks; a few `slow` checks on SmolLM2-135M.
"""

import itertools

import pytest
import torch
from engine_helpers import (
    check_engine_equals_reference,
    check_fast_path_equals_bridge,
    hf_log_probs,
    random_ids,
)

from probekit.core.engine import StepEngine
from probekit.core.kv_cache import KVCache
from probekit.mechanisms.recirculation import Recirculation, RecirculationPath, mix
from probekit.mechanisms.reference import reference_recirculation

ATOL = 2e-5  # float32: the cached and uncached paths sum in different orders


# ------------------------------------------------------------ plain model equality
def test_cached_decoding_equals_full_forward(tiny_model, tiny_engine):
    """Guards the transformers/TransformerLens cache trap (DESIGN.md): token-by-token
    decoding on the cache must equal one parallel forward."""
    ids = random_ids(3, 20)
    ref_lp, ref_logits = hf_log_probs(tiny_model, ids)
    stepped = tiny_engine.run(ids, return_logits=True)
    assert torch.allclose(stepped.logits, ref_logits, atol=ATOL)
    assert torch.allclose(stepped.log_probs, ref_lp, atol=ATOL)
    parallel = tiny_engine.forward(ids)
    assert torch.allclose(parallel.log_probs, ref_lp, atol=ATOL)


def test_hf_own_cached_loop_through_bridge_equals_full_forward(tiny_model, tiny_engine):
    """HF's generate-style loop on the bridged model fills the cache (the 5.24 trap)."""
    from transformers import DynamicCache

    ids = random_ids(2, 12, seed=3)
    _, ref_logits = hf_log_probs(tiny_model, ids)
    cache = DynamicCache(config=tiny_model.hf_model.config)
    steps = []
    with torch.no_grad():
        for t in range(ids.shape[1]):
            out = tiny_model.hf_model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
    assert cache.get_seq_length() == ids.shape[1]
    assert torch.allclose(torch.cat(steps, 1), ref_logits, atol=ATOL)


@pytest.mark.parametrize("beta", [None, 1.0])
def test_alpha_zero_is_the_plain_model(tiny_model, tiny_engine, beta):
    ids = random_ids(2, 16, seed=1)
    ref_lp, _ = hf_log_probs(tiny_model, ids)
    rec = Recirculation(3, 1, alpha=0.0, beta=beta)
    assert torch.allclose(tiny_engine.run(ids, rec).log_probs, ref_lp, atol=ATOL)


def test_recirculation_changes_the_model(tiny_model, tiny_engine):
    """Counterpart of the alpha = 0 test: a non-zero alpha must change later positions."""
    ids = random_ids(1, 16, seed=1)
    ref_lp, _ = hf_log_probs(tiny_model, ids)
    out = tiny_engine.run(ids, Recirculation(3, 1, alpha=0.5)).log_probs
    assert torch.allclose(out[:, 0], ref_lp[:, 0], atol=ATOL)  # t = 0 sees no earlier position
    assert (out - ref_lp).abs().max() > 1e-2


# ------------------------------------------------------------------ readout rule
def test_logits_at_t_do_not_depend_on_t_recirculating(tiny_engine):
    ids = random_ids(1, 14, seed=2)
    rec = Recirculation(4, 1, alpha=0.4)
    full = tiny_engine.run(ids, rec, return_logits=True).logits
    for t in (3, 7, 13):
        mask = torch.ones(14, dtype=torch.bool)
        mask[t] = False
        without_t = tiny_engine.run(ids, rec, mask=mask, return_logits=True).logits
        assert torch.allclose(without_t[:, : t + 1], full[:, : t + 1], atol=ATOL)
        if t < 13:  # ...but the next position sees the difference
            assert (without_t[:, t + 1] - full[:, t + 1]).abs().max() > 1e-3


def test_cache_keeps_first_pass_kv_where_nothing_recirculates(tiny_engine):
    """Final cache = first-pass K/V in blocks 0..d everywhere and in every block for
    positions outside the mask; the second pass's K/V above d where the mask is on."""
    s, d, L, T = 4, 1, tiny_engine.n_blocks, 10
    ids = random_ids(1, T, seed=4)
    mask = torch.tensor([i % 3 == 0 for i in range(T)])
    seen = {}  # (block, pass, position) -> rotated keys [kv_heads, head_dim]

    def recorder(b):
        def hook(k, hook=None):
            pos = tiny_engine.state.positions
            for j, p in enumerate(pos.tolist()):
                seen[(b, tiny_engine.state.pass_index, p)] = k[0, j].clone()  # [pos, heads, d]
            return k
        return hook

    hooks = [(f"blocks.{b}.attn.hook_rot_k", recorder(b)) for b in range(L)]
    res = tiny_engine.run(ids, Recirculation(s, d, alpha=0.5), mask=mask, fwd_hooks=hooks,
                          return_cache=True)
    for b in range(L):
        keys, _ = res.cache.block_kv(b)
        for p in range(T):
            second = (b, 1, p) in seen
            assert second == bool(mask[p] and b > d), (b, p)
            expected = seen[(b, 1, p)] if second else seen[(b, 0, p)]
            assert torch.equal(keys[0, :, p], expected), (b, p)
            if second:
                assert not torch.allclose(seen[(b, 0, p)], seen[(b, 1, p)])


class RecordingCache(KVCache):
    """A KV cache that remembers the first keys/values ever written at each (block,
    position): a position's first-pass entries, whatever later passes write."""

    def __init__(self, n_blocks, max_len):
        super().__init__(n_blocks, max_len)
        self.first = {}  # (block, position) -> (keys, values), each [batch, kv_heads, head_dim]

    def update(self, key, value, layer_idx, *args, **kwargs):
        start = self.lengths[layer_idx]
        for j in range(key.shape[2]):
            self.first.setdefault((layer_idx, start + j),
                                  (key[:, :, j].clone(), value[:, :, j].clone()))
        return super().update(key, value, layer_idx, *args, **kwargs)


@pytest.mark.parametrize("block_size", [1, 3, 4])
def test_inactive_positions_keep_first_pass_kv_in_every_block(tiny_engine, block_size):
    """SEMANTICS.md: positions that do not recirculate keep first-pass K/V everywhere, also
    in a chunk of K > 1 positions where an active position precedes them (issue 8: the
    whole chunk used to be re-run, giving them new K/V). Per-row masks, ragged rows."""
    s, d, L = 4, 1, tiny_engine.n_blocks
    lengths = [12, 9, 11]
    ids = random_ids(3, 12, seed=12)
    rows = [ids[i, :n].tolist() for i, n in enumerate(lengths)]
    mask = torch.zeros(3, 12, dtype=torch.bool)
    mask[0, 1] = True  # the case: K=4, mask {1}
    mask[1, [0, 5, 6]] = True
    mask[2, [2, 3, 7, 10]] = True
    cache = RecordingCache(L, 12)
    rec = Recirculation(s, d, alpha=0.5, iterations=2)
    res = tiny_engine.run(rows, rec, mask=mask, block_size=block_size, cache=cache,
                          return_cache=True)
    for b in range(L):
        keys, values = res.cache.block_kv(b)
        for i, n in enumerate(lengths):
            for p in range(n):
                k0, v0 = (x[i] for x in cache.first[(b, p)])
                kept = torch.equal(keys[i, :, p], k0) and torch.equal(values[i, :, p], v0)
                if mask[i, p] and b > d:
                    assert not kept, (b, i, p)  # the recurrent pass replaced them
                else:
                    assert kept, (b, i, p)


# ------------------------------------------------------- fast engine == reference
CASES = [
    dict(source=3, destination=1, alpha=0.3),
    dict(source=4, destination=0, alpha=0.7, beta=1.0),
    dict(source=2, destination=1, alpha=0.2, norm="none"),
    dict(source=4, destination=2, alpha=0.5, ramp=4),
    dict(source=3, destination=0, alpha=0.25, beta=0.6, ramp=3, iterations=3),
    dict(source=4, destination=3, alpha=1.0),
    dict(paths=[RecirculationPath(4, 2, 0.3), RecirculationPath(3, 0, 0.2, 0.9)]),
    dict(paths=[RecirculationPath(4, 1, 0.4, 1.0), RecirculationPath(3, 2, 0.3)], iterations=2,
         norm="none"),
]
LENGTHS = [10, 6, 8]


@pytest.mark.parametrize("case,block_size,masked",
                         list(itertools.product(range(len(CASES)), [1, 3], [False, True])))
def test_engine_equals_slow_reference(tiny_model, tiny_engine, case, block_size, masked):
    check_engine_equals_reference(tiny_model, tiny_engine, Recirculation(**CASES[case]), LENGTHS,
                                  seed=10 + case, mask_seed=case, block_size=block_size,
                                  masked=masked, atol=ATOL)


@pytest.mark.parametrize("block_size", [1, 4, [2, 5, 3, 2]])
def test_engine_equals_reference_with_one_mask_for_every_row(tiny_model, tiny_engine,
                                                              block_size):
    """A ``[seq]`` mask shared by ragged rows, incl. the issue-8 case (mask {1}, K = 4:
    positions 2, 3 follow an active position inside its chunk), and explicit chunk sizes."""
    rec = Recirculation(4, 1, alpha=0.5)
    ids = random_ids(3, 12, seed=13)
    rows = [ids[0].tolist(), ids[1, :7].tolist(), ids[2, :10].tolist()]
    for active in ([1], [1, 6, 7], [0, 2, 3, 9]):
        mask = torch.zeros(12, dtype=torch.bool)
        mask[active] = True
        out = tiny_engine.run(rows, rec, mask=mask, block_size=block_size)
        for i, r in enumerate(rows):
            ref = reference_recirculation(tiny_model, r, rec, mask=mask[: len(r)].tolist(),
                                          block_size=block_size)
            assert torch.allclose(out.sequence_log_probs(i), ref, atol=ATOL), (active, i)


@pytest.mark.parametrize("iterations", [1, 2])
def test_zero_norm_source_mixes_nothing_in(tiny_model, tiny_engine, iterations):
    """SEMANTICS.md: f(z_s) = 0 where ||z_s|| = 0 (ratio norm). A hook zeroes block s's
    output wherever its first coordinate is <= 0, in the engine and the reference alike;
    the model stays non-trivial because other positions keep theirs."""
    s, d = 3, 1
    zeroed = []

    def zero_some(act, hook=None):
        keep = act[..., :1] > 0
        zeroed.append(int((~keep).sum()))
        return act * keep

    hooks = [(f"blocks.{s}.hook_resid_post", zero_some)]
    rec = Recirculation(s, d, alpha=0.5, iterations=iterations)
    ids = random_ids(1, 12, seed=14)
    out = tiny_engine.run(ids, rec, block_size=3, fwd_hooks=hooks).log_probs[0]
    assert sum(zeroed) > 0 and torch.isfinite(out).all()
    with tiny_engine.hooks(hooks):
        ref = reference_recirculation(tiny_model, ids[0].tolist(), rec, block_size=3)
    assert torch.allclose(out, ref, atol=ATOL)
    plain = reference_recirculation(tiny_model, ids[0].tolist(), rec, block_size=3)
    assert (out - plain).abs().max() > 1e-2  # the hook did change the model


def test_ragged_batch_equals_each_sequence_alone(tiny_engine):
    rec = Recirculation(3, 1, alpha=0.4, ramp=2)
    ids = random_ids(3, 12, seed=5)
    rows = [ids[0, :12].tolist(), ids[1, :5].tolist(), ids[2, :9].tolist()]
    together = tiny_engine.run(rows, rec)
    for i, r in enumerate(rows):
        alone = tiny_engine.run([r], rec).log_probs[0]
        assert torch.allclose(together.sequence_log_probs(i), alone, atol=ATOL)


def test_blockwise_k1_is_exact_and_k_gt_1_differs(tiny_engine):
    ids = random_ids(2, 12, seed=6)
    rec = Recirculation(4, 1, alpha=0.5)
    exact = tiny_engine.run(ids, rec).log_probs
    assert torch.equal(tiny_engine.run(ids, rec, block_size=1).log_probs, exact)
    assert (tiny_engine.run(ids, rec, block_size=4).log_probs - exact).abs().max() > 1e-4


def test_continuing_from_a_baseline_cache_equals_a_full_run(tiny_engine):
    """The lag fast path: reuse the baseline cache up to t, recirculate t, score the rest
    in one parallel chunk."""
    ids = random_ids(2, 14, seed=7)
    base = tiny_engine.forward(ids, return_cache=True)
    rec = Recirculation(3, 1, alpha=0.6)
    for t in (0, 5, 9):
        onehot = torch.zeros(t + 5, dtype=torch.bool)
        onehot[t] = True
        fast = tiny_engine.run(ids[:, : t + 5], rec, mask=onehot, start=t,
                               cache=base.cache.copy(length=t), block_size=[1, 4])
        slow = tiny_engine.run(ids[:, : t + 5], rec, mask=onehot)
        assert torch.allclose(fast.log_probs[:, t:], slow.log_probs[:, t:], atol=ATOL)
        assert torch.isnan(fast.log_probs[:, :t]).all()


# -------------------------------------------------------------------------- maths
def test_mix_ratio_norm_and_zero_source():
    z_d = torch.tensor([[3.0, 4.0]])  # norm 5
    z_s = torch.tensor([[0.0, 10.0]])  # norm 10 -> rescaled to (0, 5)
    out = mix(z_s, z_d, torch.tensor(0.2), torch.tensor(0.8), "ratio")
    assert torch.allclose(out, 0.2 * torch.tensor([[0.0, 5.0]]) + 0.8 * z_d)
    assert torch.allclose(mix(z_s, z_d, torch.tensor(0.2), torch.tensor(0.8), "none"),
                          0.2 * z_s + 0.8 * z_d)
    zero = mix(torch.zeros(1, 2), z_d, torch.tensor(0.5), torch.tensor(0.5), "ratio")
    assert torch.equal(zero, 0.5 * z_d)  # f(z_s) = 0 when ||z_s|| = 0


def test_ramp_and_beta_coefficients():
    rec = Recirculation(3, 1, alpha=0.2, ramp=4)
    a, b = rec.coefficients(rec.paths[0], torch.arange(6))
    assert torch.allclose(a.flatten(), torch.tensor([0, 0.05, 0.1, 0.15, 0.2, 0.2]))
    assert torch.allclose(b.flatten(), 1 - a.flatten())  # convex beta follows alpha_t
    rec = Recirculation(3, 1, alpha=0.2, beta=1.0, ramp=4)
    _, b = rec.coefficients(rec.paths[0], torch.arange(6))
    assert torch.equal(b.flatten(), torch.ones(6))  # explicit beta stays fixed


# ------------------------------------------------------------------------- hooks
def test_user_hooks_see_the_second_pass(tiny_engine):
    s, d = 4, 1
    ids = random_ids(1, 9, seed=8)
    rec = Recirculation(s, d, alpha=0.5, ramp=4)
    res, acts = tiny_engine.run_with_cache(
        ids, rec, names=[f"blocks.{s}.hook_resid_post", f"blocks.{d + 1}.hook_resid_pre"],
        pass_index=1)
    second_top = acts[f"blocks.{s}.hook_resid_post"]
    assert second_top.shape == (1, 9, tiny_engine.backend.d_model)
    _, first = tiny_engine.run_with_cache(ids, rec, names=[f"blocks.{s}.hook_resid_post",
                                                          f"blocks.{d}.hook_resid_post"])
    # The second pass starts from z'_d = alpha_t f(z_s) + beta_t z_d, written out from
    # SEMANTICS.md with pass-0 values: f(z_s) = ||z_d|| / ||z_s|| * z_s; zero-based ramp
    # alpha_t = min(t / 4, 1) * 0.5; convex beta_t = 1 - alpha_t.
    z_s, z_d = first[f"blocks.{s}.hook_resid_post"], first[f"blocks.{d}.hook_resid_post"]
    f = z_d.norm(dim=-1, keepdim=True) / z_s.norm(dim=-1, keepdim=True) * z_s
    alpha = torch.tensor([min(t / 4, 1.0) * 0.5 for t in range(9)])[None, :, None]
    z_mixed = alpha * f + (1 - alpha) * z_d
    assert torch.allclose(acts[f"blocks.{d + 1}.hook_resid_pre"], z_mixed, atol=1e-5)
    assert not torch.allclose(second_top, first[f"blocks.{s}.hook_resid_post"])
    # Blocks at or below d never run a second pass.
    with pytest.raises(ValueError, match="never fired on pass 1"):
        tiny_engine.run_with_cache(ids, rec, names=[f"blocks.{d}.hook_resid_post"], pass_index=1)


def test_user_hook_can_intervene_during_a_recurrent_run(tiny_engine):
    ids = random_ids(1, 8, seed=9)
    rec = Recirculation(3, 1, alpha=0.3)
    plain = tiny_engine.run(ids, rec).log_probs

    def zero_second_pass(resid, hook=None):
        return resid * 0 if tiny_engine.state.pass_index == 1 else resid

    hooked = tiny_engine.run(ids, rec, fwd_hooks=[("blocks.3.hook_resid_post", zero_second_pass)])
    assert torch.allclose(hooked.log_probs[:, 0], plain[:, 0], atol=ATOL)
    assert (hooked.log_probs - plain).abs().max() > 1e-3
    assert torch.allclose(tiny_engine.run(ids, rec).log_probs, plain)  # hook removed after run


# -------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("kwargs,message", [
    (dict(source=3, destination=3, alpha=0.1),
     r"source \(3\) must be a deeper block than destination \(3\): need 0 <= destination < source"),
    (dict(source=2, destination=4, alpha=0.1), r"source \(2\) must be a deeper block"),
    (dict(source=3, destination=-1, alpha=0.1), r"destination must be >= 0; got -1"),
    (dict(source=3, destination=1, alpha=1.5), r"alpha must lie in \[0, 1\]; got 1.5"),
    (dict(source=3, destination=1, alpha=-0.1), r"alpha must lie in \[0, 1\]; got -0.1"),
    (dict(source=3, destination=1, alpha=0.1, beta=2.0),
     r"beta must lie in \[0, 1\] \(or None for 1 - alpha\); got 2.0"),
    (dict(source=3, destination=1, norm="l1"), r"norm must be one of \('ratio', 'none'\)"),
    (dict(source=3, destination=1, ramp=-1), r"ramp must be an integer >= 0"),
    (dict(source=3, destination=1, iterations=0), r"iterations must be an integer >= 1"),
    (dict(paths=[RecirculationPath(3, 1, 0.1), RecirculationPath(4, 1, 0.1)]),
     r"paths must have distinct destinations; got \[1, 1\]"),
])
def test_bad_recirculation_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Recirculation(**kwargs)


def test_bad_run_inputs_fail_before_any_state(tiny_engine):
    ids = random_ids(1, 6)
    with pytest.raises(ValueError, match=r"source block 5 is out of range: this model has 5 "
                                         r"blocks, numbered 0..4"):
        tiny_engine.run(ids, Recirculation(5, 1, alpha=0.1))
    with pytest.raises(ValueError, match="empty input: every sequence needs at least one token"):
        tiny_engine.run([[]], Recirculation(3, 1))
    with pytest.raises(ValueError, match="empty input"):
        tiny_engine.run([], Recirculation(3, 1))
    n_ctx = tiny_engine.backend.n_ctx
    with pytest.raises(ValueError, match=f"sequence of {n_ctx + 1} tokens exceeds the model's "
                                         f"context of {n_ctx} tokens"):
        tiny_engine.run([[1] * (n_ctx + 1)])
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, "):
        tiny_engine.run([[1, 99999]])
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        tiny_engine.run(ids, block_size=0)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        tiny_engine.run(ids, temperature=0)
    # A failed call leaves no hook behind and the engine idle.
    bad_hook = [("blocks.0.hook_resid_post", lambda x, hook=None: x * 0)]
    with pytest.raises(ValueError, match="source block 9 is out of range"):
        tiny_engine.run(ids, Recirculation(9, 1), fwd_hooks=bad_hook)
    assert tiny_engine.state.pass_index == 0 and tiny_engine.state.positions is None
    ref_lp = tiny_engine.forward(ids).log_probs
    assert torch.isfinite(ref_lp).all() and ref_lp.abs().max() > 0


def test_missing_model_file_error(tmp_path):
    from probekit.core.models import ModelNotFoundError, load_model

    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelNotFoundError, match=str(missing)):
        load_model(str(missing))


# ---------------------------------------------------------------- default model
@pytest.mark.slow
def test_default_model_alpha_zero_and_cached_decoding(default_model, default_engine):
    tok = default_model.tokenizer
    ids = torch.tensor([tok("The quick brown fox jumps over the lazy dog because it was")
                        ["input_ids"]])
    ref_lp, ref_logits = hf_log_probs(default_model, ids)
    stepped = default_engine.run(ids, return_logits=True)
    assert (stepped.logits - ref_logits).abs().max() < 1e-3
    assert (stepped.log_probs - ref_lp).abs().max() < 1e-4
    zero = default_engine.run(ids, Recirculation(20, 10, alpha=0.0))
    assert (zero.log_probs - ref_lp).abs().max() < 1e-4


@pytest.mark.slow
def test_default_model_engine_equals_reference(default_model, default_engine):
    tok = default_model.tokenizer
    ids = tok("Recirculation mixes a deep state into a shallow layer.")["input_ids"][:10]
    rec = Recirculation(20, 10, alpha=0.2, ramp=3)
    fast = default_engine.run([ids], rec).log_probs[0]
    ref = reference_recirculation(default_model, ids, rec)
    assert (fast - ref).abs().max() < 1e-4
    base, _ = hf_log_probs(default_model, torch.tensor([ids]))
    assert (fast - base[0]).abs().max() > 1e-3  # and recirculation did something


# ------------------------------------------------------ fast path vs bridge path
def test_fast_block_path_equals_the_bridge(tiny_model, tiny_engine, monkeypatch):
    """Without hooks, blocks run probekit.core.backends.llama_block on the bridge's weights; it must
    equal the bridge's own computation, and hooks must switch it off."""
    from probekit.core.backends.lens import LensBackend

    bridge_engine = StepEngine(tiny_model, LensBackend(tiny_model, fast=False))
    check_fast_path_equals_bridge(tiny_engine, bridge_engine, monkeypatch, "llama_block",
                                  random_ids(2, 12, seed=11),
                                  Recirculation(4, 1, alpha=0.5, iterations=2), 2, ATOL)
