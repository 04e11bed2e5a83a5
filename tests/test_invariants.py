"""Invariants of SEMANTICS.md "Recirculation" on every recirculation configuration.

- **Readout rule**: the logits at ``t`` come from ``t``'s first pass, so they do not
  depend on whether ``t`` recirculates; in a chunk of ``K`` positions (blockwise), they
  depend only on the mask of the positions before the chunk.
- **First-pass keys/values**: blocks ``0 .. d`` (``d`` the lowest destination) hold the
  first-pass keys *and* values of every position; blocks above ``d`` hold the last
  recurrent pass's for positions that recirculate and the first pass's for the others.

Each is checked with iterations > 1, several paths, block size > 1, per-row masks on
ragged rows, and runs continued from a cache (``start``/``cache``). Expected values
come from the definitions, never from the functions under test.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch

from probekit.core.kv_cache import KVCache
from probekit.mechanisms.recirculation import Recirculation, RecirculationPath

torch.set_num_threads(1)

CONFIGS = {
    "ratio-convex": Recirculation(3, 1, alpha=0.5),
    "none-beta1-ramp": Recirculation(4, 0, alpha=0.4, beta=1.0, norm="none", ramp=3),
    "explicit-beta-iterations-3": Recirculation(4, 2, alpha=0.6, beta=0.7, iterations=3),
    "two-paths-iterations-2": Recirculation(
        paths=[RecirculationPath(4, 2, 0.3), RecirculationPath(3, 0, 0.5, 0.9)], iterations=2),
}
LOWEST_DESTINATION = {"ratio-convex": 1, "none-beta1-ramp": 0,
                      "explicit-beta-iterations-3": 2, "two-paths-iterations-2": 0}
LENGTHS = [11, 7, 9]
T = max(LENGTHS)


def ragged_rows(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (len(LENGTHS), T), generator=g)
    return [ids[i, :n].tolist() for i, n in enumerate(LENGTHS)]


def random_mask(seed, p=0.5):
    """A per-row ``[batch, T]`` mask; about half the positions recirculate."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(len(LENGTHS), T, generator=g) < p


def chunk_end(t, block_size, start=0):
    """One past the last position of the chunk holding ``t`` (chunks of ``block_size``
    positions from ``start``)."""
    return min(T, start + ((t - start) // block_size + 1) * block_size)


def toggles(start=0):
    """``(row, t)`` pairs to flip: chunk starts, middles and ends, in every row."""
    return [(i, t) for i, n in enumerate(LENGTHS) for t in (start, start + 1, 5, 6, n - 2)
            if start <= t < n]


# ------------------------------------------------------------------- readout rule
@pytest.mark.parametrize("block_size", [1, 3])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_at_t_do_not_depend_on_t_recirculating(tiny_engine, name, block_size):
    """Flip one (row, t) of a per-row mask: that row's logits up to the end of t's chunk
    stay bitwise the same, later ones move, and the other rows do not change at all."""
    rec = CONFIGS[name]
    rows, mask = ragged_rows(1), random_mask(2)
    base = tiny_engine.run(rows, rec, mask=mask, block_size=block_size,
                           return_logits=True).logits
    for i, t in toggles():
        flipped = mask.clone()
        flipped[i, t] = ~flipped[i, t]
        out = tiny_engine.run(rows, rec, mask=flipped, block_size=block_size,
                              return_logits=True).logits
        end, n = chunk_end(t, block_size), LENGTHS[i]
        assert torch.equal(out[i, :end], base[i, :end]), (i, t)
        for j, m in enumerate(LENGTHS):
            if j != i:
                assert torch.allclose(out[j, :m], base[j, :m], atol=1e-6), (i, t, j)
        if end < n and not (rec.ramp and t == 0):  # (a ramp makes alpha_0 = 0)
            # not vacuous: the readouts after t's chunk do see t's recirculation
            assert (out[i, end:n] - base[i, end:n]).abs().max() > 1e-4, (i, t)


@pytest.mark.parametrize("block_size", [2, 4])
@pytest.mark.parametrize("name", ["ratio-convex", "two-paths-iterations-2"])
def test_a_chunks_readout_depends_only_on_the_mask_before_it(tiny_engine, name, block_size):
    """Blockwise: the first pass of a chunk sees the cache of the positions before it, so
    its logits are the same for any mask that agrees on those positions."""
    rec = CONFIGS[name]
    rows = ragged_rows(3)
    mask, other = random_mask(4), random_mask(5)
    base = tiny_engine.run(rows, rec, mask=mask, block_size=block_size,
                           return_logits=True).logits
    for c0 in range(0, T, block_size):
        mixed = torch.cat([mask[:, :c0], other[:, c0:]], dim=1)
        out = tiny_engine.run(rows, rec, mask=mixed, block_size=block_size,
                              return_logits=True).logits
        c1 = chunk_end(c0, block_size)
        for i, n in enumerate(LENGTHS):
            assert torch.allclose(out[i, : min(c1, n)], base[i, : min(c1, n)], atol=1e-6), c0


@pytest.mark.parametrize("block_size", [1, 3])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_continued_run_equals_the_full_run_and_keeps_the_readout_rule(tiny_engine, name,
                                                                       block_size):
    """Continue from ``start`` on the full run's cache: the logits from ``start`` on equal
    the full run's; flipping a position at or after ``start`` leaves the readout up to the
    end of its chunk unchanged."""
    rec, start = CONFIGS[name], 6  # chunk boundaries agree for block sizes 1 and 3
    rows, mask = ragged_rows(6), random_mask(7)
    full = tiny_engine.run(rows, rec, mask=mask, block_size=block_size, return_logits=True,
                           return_cache=True)

    def continued(m):
        return tiny_engine.run(rows, rec, mask=m, block_size=block_size, start=start,
                               cache=full.cache.copy(length=start), return_logits=True)

    cont = continued(mask)
    for i, n in enumerate(LENGTHS):
        assert torch.allclose(cont.logits[i, start:n], full.logits[i, start:n], atol=2e-5), i
        assert torch.allclose(cont.sequence_log_probs(i)[start:],
                              full.sequence_log_probs(i)[start:], atol=2e-5), i
        assert torch.isnan(cont.log_probs[i, :start]).all()  # not run, not scored
    for i, t in toggles(start):
        flipped = mask.clone()
        flipped[i, t] = ~flipped[i, t]
        out = continued(flipped).logits
        end = chunk_end(t, block_size, start)
        assert torch.equal(out[i, start:end], cont.logits[i, start:end]), (i, t)


# ------------------------------------------------------------- first-pass K/V
class WriteLog(KVCache):
    """A KV cache that records every key/value a pass computes, per (block, position), in
    order: ``writes[(b, p)][0]`` is the first pass's, ``[-1]`` the last pass's."""

    def __init__(self, n_blocks, max_len):
        super().__init__(n_blocks, max_len)
        self.writes = {}  # (block, position) -> [(keys, values), ...], each [batch, heads, dim]

    def update(self, key, value, layer_idx, *args, **kwargs):
        start = self.lengths[layer_idx]
        for j in range(key.shape[2]):
            self.writes.setdefault((layer_idx, start + j), []).append(
                (key[:, :, j].clone(), value[:, :, j].clone()))
        return super().update(key, value, layer_idx, *args, **kwargs)


def check_kept_kv(engine, cache, writes, mask, d, rec, start=0, block_size=1):
    """Every (block, row, position) of ``cache`` holds the keys and values SEMANTICS.md
    keeps: the first pass's in blocks ``0 .. d`` and for positions that do not recirculate;
    the last of ``1 + iterations`` passes' above ``d`` for those that do."""
    iterations = rec.iterations
    L = engine.n_blocks
    replaced = 0
    for b in range(L):
        keys, values = cache.block_kv(b)
        for i, n in enumerate(LENGTHS):
            for p in range(start, n):
                passes = writes[(b, p)]
                c0 = start + (p - start) // block_size * block_size
                chunk_recirculates = bool(mask[:, c0:chunk_end(p, block_size, start)].any())
                assert len(passes) == (1 + iterations if b > d and chunk_recirculates else 1)
                if mask[i, p] and b > d:
                    want_k, want_v = (x[i] for x in passes[-1])
                    # the recurrent pass really wrote something else than the first pass
                    # (unless a ramp makes alpha_0 = 0 and beta_0 = 1: nothing mixed in)
                    if not (rec.ramp and p == 0):
                        assert not torch.allclose(passes[0][0][i], want_k), (b, i, p)
                        assert not torch.allclose(passes[0][1][i], want_v), (b, i, p)
                        replaced += 1
                else:
                    want_k, want_v = (x[i] for x in passes[0])
                assert torch.equal(keys[i, :, p], want_k), ("keys", b, i, p)
                assert torch.equal(values[i, :, p], want_v), ("values", b, i, p)
    assert replaced > 0


@pytest.mark.parametrize("block_size", [1, 3, 4])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cache_holds_first_pass_kv_except_where_t_recirculates_above_d(tiny_engine, name,
                                                                      block_size):
    rec = CONFIGS[name]
    rows, mask = ragged_rows(8), random_mask(9, p=0.4)
    real = torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]
    mask &= real
    cache = WriteLog(tiny_engine.n_blocks, T)
    res = tiny_engine.run(rows, rec, mask=mask, block_size=block_size, cache=cache,
                          return_cache=True)
    check_kept_kv(tiny_engine, res.cache, cache.writes, mask, LOWEST_DESTINATION[name], rec,
                  block_size=block_size)


@pytest.mark.parametrize("block_size", [1, 3])
@pytest.mark.parametrize("name", ["explicit-beta-iterations-3", "two-paths-iterations-2"])
def test_a_continued_run_keeps_the_given_cache_and_the_first_pass_kv(tiny_engine, name,
                                                                     block_size):
    """Positions before ``start`` keep exactly the entries of the cache the run was given;
    positions from ``start`` on obey the rule above."""
    rec, start = CONFIGS[name], 3
    rows, mask = ragged_rows(10), random_mask(11, p=0.4)
    mask &= torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]
    given = tiny_engine.run(rows, rec, mask=mask, return_cache=True).cache.copy(length=start)
    cache = WriteLog(tiny_engine.n_blocks, T)
    for b in range(tiny_engine.n_blocks):  # the same entries, in a recording cache
        cache.keys[b], cache.values[b] = given.keys[b].clone(), given.values[b].clone()
        cache.lengths[b] = start
    res = tiny_engine.run(rows, rec, mask=mask, block_size=block_size, start=start,
                          cache=cache, return_cache=True)
    for b in range(tiny_engine.n_blocks):
        keys, values = res.cache.block_kv(b)
        assert torch.equal(keys[:, :, :start], given.keys[b][:, :, :start]), b
        assert torch.equal(values[:, :, :start], given.values[b][:, :, :start]), b
    check_kept_kv(tiny_engine, res.cache, cache.writes, mask, LOWEST_DESTINATION[name], rec,
                  start=start, block_size=block_size)
