"""Helpers shared by the engine tests (not a test module): seeded ids, the Hugging Face
reference log-probs, and the fast-block-path-vs-bridge check every family with a fast
path runs."""

from __future__ import annotations

import torch


def random_ids(batch, seq, seed=0, vocab=256):
    """``[batch, seq]`` token ids, seeded."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def hf_log_probs(model, ids):
    """``(log p(x[t+1]), logits)`` of one parallel Hugging Face forward."""
    with torch.no_grad():
        logits = model.hf_model(ids).logits
    lp = torch.log_softmax(logits[:, :-1], -1)
    return lp.gather(-1, ids[:, 1:, None])[..., 0], logits


def check_fast_path_equals_bridge(fast_engine, bridge_engine, monkeypatch, block_fn: str,
                                  ids, rec, hook_block: int, atol: float) -> None:
    """Without hooks the lens backend runs ``block_fn`` (its fast block path) and equals the
    bridge-only engine under recirculation at K = 1 and 5; with any hook attached every
    block goes through the bridge instead."""
    from probekit.core.backends import lens as lens_backend

    calls = []
    real = getattr(lens_backend, block_fn)
    monkeypatch.setattr(lens_backend, block_fn, lambda *a: calls.append(1) or real(*a))
    for block_size in (1, 5):
        fast = fast_engine.run(ids, rec, block_size=block_size, return_logits=True)
        assert calls, "the fast path was not used"
        slow = bridge_engine.run(ids, rec, block_size=block_size, return_logits=True)
        assert torch.allclose(fast.logits, slow.logits, atol=atol)
    calls.clear()
    fired = []
    fast_engine.run(ids, rec, fwd_hooks=[(f"blocks.{hook_block}.hook_resid_post",
                                          lambda x, hook=None: fired.append(1) or x)])
    assert fired and not calls  # a hook anywhere -> every block through the bridge


def check_engine_equals_reference(model, engine, rec, lengths, *, seed, mask_seed, block_size,
                                  masked, atol):
    """Ragged rows of ``lengths`` (random ids from ``seed``), optionally a random per-row
    mask: the engine's log-probs equal the slow reference's row by row, and padding is NaN,
    never a number."""
    from probekit.mechanisms.reference import reference_recirculation

    ids = random_ids(len(lengths), max(lengths), seed=seed)
    rows = [ids[i, :n].tolist() for i, n in enumerate(lengths)]
    g = torch.Generator().manual_seed(mask_seed)
    mask = torch.rand(len(lengths), max(lengths), generator=g) > 0.4 if masked else None
    out = engine.run(rows, rec, mask=mask, block_size=block_size)
    for i, n in enumerate(lengths):
        m = None if mask is None else mask[i, :n].tolist()
        ref = reference_recirculation(model, rows[i], rec, mask=m, block_size=block_size)
        assert torch.allclose(out.sequence_log_probs(i), ref, atol=atol), i
        assert torch.isnan(out.log_probs[i, n - 1:]).all()
