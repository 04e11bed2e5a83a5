"""Looping baseline (probekit/mechanisms/looping.py) against SEMANTICS.md "Looping baseline"."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch

from probekit.core.models import load_model
from probekit.mechanisms.looping import Looping, reference_looping

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def fresh_tiny():
    """The same weights as the session's tiny-5, never wrapped by a TransformerLens bridge,
    so the reference runs Hugging Face's own unmodified modules."""
    return load_model("tiny-5", seed=0)


def ragged_ids(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (19, 11, 16)]


@pytest.mark.parametrize("l1,l2", [(0, 1), (1, 3), (0, 4), (2, 4)])
def test_looping_equals_hf_forward_of_the_looped_layer_list(tiny_model, tiny_engine, fresh_tiny,
                                                           l1, l2):
    assert fresh_tiny.content_hash == tiny_model.content_hash
    seqs = ragged_ids()
    loop = Looping(l1, l2)
    out = loop.run(tiny_engine, seqs)
    plain = tiny_engine.forward(seqs)
    for i, seq in enumerate(seqs):
        want = reference_looping(fresh_tiny, seq, loop)
        assert (out.sequence_log_probs(i) - want).abs().max() <= 1e-5
        # Looping is a different model: the comparison above is not vacuous.
        assert (plain.sequence_log_probs(i) - want).abs().max() > 1e-3
    assert torch.isnan(out.log_probs[1, 10:]).all()  # padding is never scored


def test_duplicated_blocks_need_their_own_keys_and_values(tiny_engine, fresh_tiny):
    """Appending the copy's keys/values to the same cache as the first application is a
    different (wrong) model: the copy would also attend to the first application's
    keys/values. The test shows that this mistake is visible to the reference check."""
    from probekit.core.kv_cache import KVCache

    seq = ragged_ids(1)[0]
    loop = Looping(1, 3)
    want = reference_looping(fresh_tiny, seq, loop)
    engine, L, T = tiny_engine, tiny_engine.n_blocks, len(seq)
    ids = torch.tensor([seq])
    pos = torch.arange(T)
    shared = KVCache(L, 2 * T)
    with torch.no_grad():
        x, _ = engine.run_blocks(0, 4, engine.embed(ids), pos, shared)
        x, _ = engine.run_blocks(2, 4, x, pos, shared)  # appends after the first copy's
        x, _ = engine.run_blocks(4, L, x, pos, shared)
        lp = torch.log_softmax(engine.unembed(x)[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    assert (lp - want).abs().max() > 1e-3
    assert (loop.run(tiny_engine, [seq]).sequence_log_probs(0) - want).abs().max() <= 1e-5


def test_block_order_and_validation():
    assert Looping(1, 3).block_order(5) == [0, 1, 2, 3, 2, 3, 4]
    assert Looping(0, 4).block_order(5) == [0, 1, 2, 3, 4, 1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"l2 \(2\) must be a deeper block than l1 \(2\)"):
        Looping(2, 2)
    with pytest.raises(ValueError, match="l1 must be >= 0"):
        Looping(-1, 2)
    with pytest.raises(ValueError, match=r"l2 = 5 is out of range: this model has 5 blocks"):
        Looping(1, 5).block_order(5)
    with pytest.raises(TypeError, match="l1 must be an integer block index"):
        Looping(1.0, 3)


def test_hooks_see_the_copy_as_pass_one(tiny_engine):
    seen = []

    def hook(act, hook):
        seen.append(tiny_engine.state.pass_index)
        return act

    names = [f"blocks.{b}.hook_resid_post" for b in range(tiny_engine.n_blocks)]
    Looping(1, 3).run(tiny_engine, [[1, 2, 3, 4]], fwd_hooks=[(n, hook) for n in names])
    # blocks 0 1 2 3 | copy of 2 3 | 4
    assert seen == [0, 0, 0, 0, 1, 1, 0]
    assert tiny_engine.state.pass_index == 0 and tiny_engine.state.positions is None
