"""The step engine's public operations below a whole run, and its readout options.

``embed``, ``unembed``, ``hooks``, ``run_blocks``, ``rerun_position`` and
``run(readout=True | "last" | False)`` are what analyses use instead of the backend.
"""

import pytest
import torch
from engine_helpers import random_ids

from probekit.core.kv_cache import KVCache
from probekit.mechanisms.recirculation import Recirculation

ATOL = 2e-5


def hf_logits(model, ids):
    with torch.no_grad():
        return model.hf_model(ids).logits


def cache_contents(cache):
    return [tuple(t.clone() for t in cache.block_kv(b)) for b in range(cache.n_blocks)]


# ------------------------------------------------------------------- run_blocks
def test_embed_run_blocks_unembed_is_the_model(tiny_model, tiny_engine):
    ids = random_ids(2, 9, seed=20)
    L = tiny_engine.n_blocks
    x = tiny_engine.embed(ids)
    assert torch.equal(x, tiny_model.hf_model.get_input_embeddings()(ids))
    cache = KVCache(L, 9)
    seen = []
    hooks = [("blocks.2.hook_resid_post",
              lambda a, hook=None: seen.append(tiny_engine.state.pass_index) or a)]
    with tiny_engine.hooks(hooks):
        top, captured = tiny_engine.run_blocks(0, L, x, torch.arange(9), cache, capture=[1, 3],
                                               pass_index=2)
    assert seen == [2]  # hooks attached by engine.hooks see the pass index given
    assert tiny_engine.state.pass_index == 0 and tiny_engine.state.positions is None
    assert cache.lengths == [9] * L
    logits = tiny_engine.unembed(top)
    assert logits.dtype == torch.float32
    assert torch.allclose(logits, hf_logits(tiny_model, ids), atol=ATOL)
    # captured block outputs are hidden_states[b + 1] (SEMANTICS.md "Indexing")
    with torch.no_grad():
        hidden = tiny_model.hf_model(ids, output_hidden_states=True).hidden_states
    for b in (1, 3):
        assert torch.allclose(captured[b], hidden[b + 1], atol=ATOL)
    # in two ranges of blocks on a cache, position by position: the same
    cache = KVCache(L, 9)
    for t in range(9):
        mid, _ = tiny_engine.run_blocks(0, 2, x[:, t : t + 1], torch.tensor([t]), cache)
        out, _ = tiny_engine.run_blocks(2, L, mid, torch.tensor([t]), cache)
        assert torch.allclose(tiny_engine.unembed(out)[:, 0], logits[:, t], atol=ATOL)
    seen.clear()
    tiny_engine.run(ids)
    assert not seen  # the hook left with its context


def test_n_ctx_and_dtype(tiny_model, tiny_engine):
    assert tiny_engine.n_ctx == tiny_model.hf_model.config.max_position_embeddings
    assert tiny_engine.dtype == torch.float32


# --------------------------------------------------------------- rerun_position
@pytest.mark.parametrize("start", [0, 2, 5])
def test_rerun_position_equals_the_full_run_and_leaves_the_cache(tiny_engine, start):
    """A position's readout depends only on the cache of earlier positions, so re-running
    it from depth ``start`` (its residual there taken from the run) gives the run's logits."""
    L = tiny_engine.n_blocks
    ids = random_ids(2, 10, seed=21)
    rec = Recirculation(3, 1, alpha=0.5)
    names = [f"blocks.{b}.hook_resid_post" for b in range(L)]
    full, acts = tiny_engine.run_with_cache(ids, rec, names=names, return_logits=True,
                                            return_cache=True)
    for t in (0, 4, 9):
        cache = full.cache.copy(length=t)
        before = cache_contents(cache)
        resid = tiny_engine.embed(ids[:, t]) if start == 0 else acts[names[start - 1]][:, t]
        top, captured = tiny_engine.rerun_position(cache, t, resid, start, capture=[3, 4])
        assert torch.allclose(tiny_engine.unembed(top), full.logits[:, t], atol=ATOL)
        for b in (3, 4):
            if b >= start:
                assert torch.allclose(captured[b], acts[names[b]][:, t], atol=ATOL)
        assert cache.lengths == [t] * L
        for (k0, v0), (k1, v1) in zip(before, cache_contents(cache)):
            assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_rerun_position_bad_inputs(tiny_engine):
    L = tiny_engine.n_blocks
    ids = random_ids(1, 6, seed=22)
    cache = tiny_engine.forward(ids, return_cache=True).cache
    resid = tiny_engine.embed(ids[:, 3])
    with pytest.raises(ValueError,
                       match=r"the cache must hold exactly positions < 3; it holds \[6\]"):
        tiny_engine.rerun_position(cache, 3, resid)
    with pytest.raises(ValueError, match=f"start must lie in 0..{L}; got {L + 1}"):
        tiny_engine.rerun_position(cache.copy(length=3), 3, resid, L + 1)
    top, captured = tiny_engine.rerun_position(cache.copy(length=3), 3, resid, L)
    assert torch.equal(top, resid) and captured == {}  # no block left to run


# ---------------------------------------------------------------------- readout
def test_readout_false_skips_the_unembedding(tiny_engine, monkeypatch):
    ids = random_ids(2, 8, seed=23)
    rec = Recirculation(3, 1, alpha=0.5)
    _, want = tiny_engine.run_with_cache(ids, rec, names=["blocks.4.hook_resid_post"])

    def no_unembed(resid):
        raise AssertionError("readout=False must not unembed")

    monkeypatch.setattr(tiny_engine.backend, "unembed", no_unembed)
    res, got = tiny_engine.run_with_cache(ids, rec, names=["blocks.4.hook_resid_post"],
                                          readout=False)
    assert torch.isnan(res.log_probs).all() and res.logits is None
    assert torch.equal(got["blocks.4.hook_resid_post"], want["blocks.4.hook_resid_post"])
    with pytest.raises(ValueError, match=r"return_logits needs a readout \(readout=True or "):
        tiny_engine.run(ids, readout=False, return_logits=True)
    with pytest.raises(ValueError, match="readout must be True, False or 'last'; got 'first'"):
        tiny_engine.run(ids, readout="first")


def test_readout_last_is_the_first_pass_without_a_rerun(tiny_engine):
    ids = random_ids(2, 10, seed=24)
    rec = Recirculation(3, 1, alpha=0.5)
    off = torch.zeros(10, dtype=torch.bool)  # nothing recirculates: no recurrent pass
    for block_size in (1, 4):
        first = tiny_engine.run(ids, rec, mask=off, block_size=block_size, return_logits=True)
        last = tiny_engine.run(ids, rec, mask=off, block_size=block_size, return_logits=True,
                               readout="last")
        assert torch.equal(last.logits, first.logits)
        assert torch.equal(last.log_probs, first.log_probs)


def test_readout_last_reads_the_last_recurrent_pass(tiny_engine):
    L = tiny_engine.n_blocks
    ids = random_ids(1, 8, seed=25)
    rec = Recirculation(3, 1, alpha=0.5, iterations=2)
    top = f"blocks.{L - 1}.hook_resid_post"
    _, acts = tiny_engine.run_with_cache(ids, rec, names=[top], pass_index=2)
    last = tiny_engine.run(ids, rec, readout="last", return_logits=True)
    assert torch.allclose(last.logits, tiny_engine.unembed(acts[top]), atol=ATOL)
    first = tiny_engine.run(ids, rec, return_logits=True)
    assert (last.logits - first.logits).abs().max() > 1e-3  # the readout rule's default


# ----------------------------------------------------------------- the KV cache
def test_cache_keeping_holds_marked_pairs_of_a_rewritten_chunk():
    g = torch.Generator().manual_seed(26)
    cache = KVCache(1, 6)
    first_k, first_v = torch.randn(2, 1, 6, 3, generator=g), torch.randn(2, 1, 6, 3, generator=g)
    cache.update(first_k, first_v, 0)
    new_k, new_v = torch.randn(2, 1, 4, 3, generator=g), torch.randn(2, 1, 4, 3, generator=g)
    keep = torch.tensor([[False, True, False, True], [True, False, False, False]])
    cache.truncate(range(1), 2)
    with cache.keeping(2, keep):
        k, v = cache.update(new_k, new_v, 0)
    m = keep[:, None, :, None]
    assert torch.equal(k[:, :, 2:], torch.where(m, first_k[:, :, 2:], new_k))
    assert torch.equal(v[:, :, 2:], torch.where(m, first_v[:, :, 2:], new_v))
    assert torch.equal(cache.block_kv(0)[0], k) and torch.equal(k[:, :, :2], first_k[:, :, :2])
    cache.truncate(range(1), 2)
    with cache.keeping(3, keep), pytest.raises(RuntimeError, match="does not match the kept"):
        cache.update(new_k, new_v, 0)
    k, _ = cache.update(new_k, new_v, 0)  # the context has closed: everything is replaced
    assert torch.equal(k[:, :, 2:], new_k)
