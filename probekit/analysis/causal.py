"""Causal accessibility: is a decodable state also *used*? Patching at the final token.

The latent-feedback paper stresses (Sec. 4.4, last paragraph) that a probe reading a
state at some depth shows the information is present, not that the model uses it to
choose the next token. This module measures use by activation patching on the matched
pairs of the synthetic tasks (``synthetic.Example.pair``: same group, same length,
opposite labels, differing only in the state-determining content).

For a pair ``(a, b)`` and a residual depth ``r``: run ``b`` under the same regime, but
replace the final token's depth-``r`` residual (in its readout pass) with ``a``'s, and
read the final logits. With ``y_a``, ``y_b`` the two label tokens::

    ld(b)          = logit_b(y_a) - logit_b(y_b)          unpatched; < 0: b's own label wins
    ld_r(b <- a)   = the same under the patch at depth r
    flip at r      = ld(b) < 0  and  ld_r(b <- a) > 0      (the preference moves to a's label)

``flip_rate[r]`` is the fraction of recipients the model gets right unpatched
(``ld(b) < 0``) whose preference flips; ``shift[r]`` is the mean of
``ld_r(b <- a) - ld(b)`` over all recipients (in logits: how far the patch pushes toward
``a``'s label). Every pair is used both ways (``a -> b`` and ``b -> a``). The model's own
``accuracy`` (how often ``ld < 0``) is reported beside them: a flip rate means little
when the model rarely prefers the right label in the first place.

Fast path (:func:`patched_label_logits`): only the final position is affected, and only
from depth ``r`` upward, so the patched readout is blocks ``r .. L-1`` run for that one
position on the cache of positions ``< T-1`` the readout pass attended to
(:class:`probekit.analysis.capture.Capture`), then the unembedding. That is exact for any
mechanism whose final-token readout is a plain pass over that cache (the
:class:`probekit.mechanisms.prefill.Mechanism` contract). The slow definition
(:func:`reference_patched_logits`: re-run the whole regime with a hook replacing the
residual) is kept for tests. Invariants the tests pin: patching a row with its own
residuals reproduces its clean logits at every depth; patching depth ``L`` gives the
donor's logits; patching depth 0 under ``none`` changes nothing (every example ends with
the same token, so the depth-0 residuals are identical).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from probekit.analysis.capture import Capture, capture_final, depth_hook_names
from probekit.core.engine import StepEngine
from probekit.mechanisms.prefill import Mechanism
from probekit.mechanisms.regimes import Regime


@torch.no_grad()
def readout_logits(engine: StepEngine, top: Tensor) -> Tensor:
    """Logits ``[batch, vocab]`` from final-token residuals at depth ``L`` ``[batch, d_model]``."""
    return engine.unembed(top[:, None])[:, 0]


@torch.no_grad()
def patched_label_logits(
    engine: StepEngine,
    capture: Capture,
    donors: Tensor,
    label_ids: Sequence[int],
    depths: Sequence[int] | None = None,
) -> Tensor:
    """Final-token logits of the label tokens when depth ``r`` is replaced by ``donors[:, r]``.

    Args:
        capture: the recipients' capture (its cache is used and left as it was).
        donors: ``[batch, L + 1, d_model]`` residuals to write in, row by row.
        label_ids: the token ids whose logits are returned.
        depths: residual depths to patch (default all ``0 .. L``).

    Returns:
        ``[batch, len(depths), len(label_ids)]`` float32 logits.
    """
    L = engine.n_blocks
    depths = list(range(L + 1)) if depths is None else list(depths)
    batch = capture.resid.shape[0]
    if donors.shape != capture.resid.shape:
        raise ValueError(
            f"donors must have the capture's shape {tuple(capture.resid.shape)}; "
            f"got {tuple(donors.shape)}"
        )
    if any(not 0 <= r <= L for r in depths):
        raise ValueError(f"depths must lie in 0..{L}; got {depths}")
    cache, t = capture.cache, capture.position
    if any(n != t for n in cache.lengths):
        raise RuntimeError(f"the capture's cache must hold exactly positions < {t}")
    labels = torch.as_tensor(list(label_ids), dtype=torch.long)
    out = torch.empty(batch, len(depths), len(labels))
    for j, r in enumerate(depths):
        # blocks r .. L-1 for the final position only (none when r = L); cache unchanged
        top, _ = engine.rerun_position(cache, t, donors[:, r].to(engine.dtype), start=r)
        out[:, j] = engine.unembed(top[:, None])[:, 0, labels]
    return out


@torch.no_grad()
def reference_patched_logits(
    engine: StepEngine,
    mechanism: Mechanism,
    input_ids: Tensor,
    regime: Regime,
    donor: Tensor,
    depth: int,
) -> Tensor:
    """Slow definition: the final-token logits ``[batch, vocab]`` of a full run under
    ``regime`` whose hook at ``depth`` replaces the final token's residual by ``donor``
    ``[batch, d_model]`` in the readout pass."""
    final = input_ids.shape[1] - 1
    name = depth_hook_names(engine.n_blocks)[depth]
    readout = {"pass": 0}

    def patch(act: Tensor, hook=None) -> Tensor:
        positions = engine.state.positions  # the hooks' read-only view of the engine
        if (engine.state.pass_index == readout["pass"]
                and int(positions[0]) <= final <= int(positions[-1])):
            act = act.clone()
            act[:, final - int(positions[0])] = donor.to(act.dtype)
        return act

    cap = capture_final(engine, mechanism, input_ids, regime, fwd_hooks=[(name, patch)])
    if cap.pass_index != 0:  # a multi-pass readout: patch that pass instead
        readout["pass"] = cap.pass_index
        cap = capture_final(engine, mechanism, input_ids, regime, fwd_hooks=[(name, patch)])
    return readout_logits(engine, cap.resid[:, -1])


def partner_index(pairs: np.ndarray) -> np.ndarray:
    """``[n]`` index of each example's matched partner (-1 when unpaired)."""
    pairs = np.asarray(pairs)
    out = np.full(pairs.shape, -1, dtype=np.int64)
    for pair in np.unique(pairs[pairs >= 0]):
        idx = np.flatnonzero(pairs == pair)
        if idx.size != 2:
            raise ValueError(f"pair {pair} has {idx.size} members; a matched pair has 2")
        out[idx[0]], out[idx[1]] = idx[1], idx[0]
    return out


@dataclass
class FlipStats:
    """Per-depth causal accessibility of one task under one regime (module docstring).

    Attributes:
        flip_rate: ``[n_depths]`` flips / recipients the model got right (NaN if none).
        flip_se: ``[n_depths]`` binomial standard error of ``flip_rate``.
        shift: ``[n_depths]`` mean change of ``ld`` (logits toward the donor's label);
            at depth ``L`` it is the mean gap between the partner's and the recipient's
            own ``ld``, the most any patch can move.
        shift_se: ``[n_depths]`` standard error of ``shift``.
        accuracy: fraction of examples whose own label token beats the other label.
        n_recipients: examples with a partner; ``n_correct``: those the model got right.
    """

    flip_rate: np.ndarray
    flip_se: np.ndarray
    shift: np.ndarray
    shift_se: np.ndarray
    accuracy: float
    n_recipients: int
    n_correct: int

    def to_dict(self) -> dict:
        return {"flip_rate": self.flip_rate.tolist(), "flip_se": self.flip_se.tolist(),
                "shift": self.shift.tolist(), "shift_se": self.shift_se.tolist(),
                "accuracy": self.accuracy,
                "n_recipients": self.n_recipients, "n_correct": self.n_correct}


def flip_statistics(
    clean: np.ndarray, patched: np.ndarray, labels: np.ndarray, partners: np.ndarray
) -> FlipStats:
    """Flip rates from label logits.

    Args:
        clean: ``[n, n_labels]`` unpatched label logits of every example.
        patched: ``[n, n_depths, n_labels]`` label logits with the partner's residual
            patched in at each depth.
        labels: ``[n]`` class index of every example (its label token's column).
        partners: ``[n]`` partner index (:func:`partner_index`; -1: no partner).
    """
    clean, patched = np.asarray(clean, float), np.asarray(patched, float)
    labels, partners = np.asarray(labels), np.asarray(partners)
    own_wins = clean.argmax(1) == labels
    rec = np.flatnonzero(partners >= 0)                      # recipients
    mine, theirs = labels[rec], labels[partners[rec]]
    ld_clean = clean[rec, theirs] - clean[rec, mine]                    # [m]
    ld_patch = patched[rec, :, theirs] - patched[rec, :, mine]          # [m, n_depths]
    correct = ld_clean < 0
    n_correct = int(correct.sum())
    nan = np.full(patched.shape[1], np.nan)
    if n_correct:
        rate = ((ld_patch > 0) & correct[:, None]).sum(0) / n_correct
        se = np.sqrt(rate * (1 - rate) / n_correct)
    else:
        rate, se = nan, nan.copy()
    moved = ld_patch - ld_clean[:, None]
    shift = moved.mean(0) if rec.size else nan.copy()
    shift_se = moved.std(0) / np.sqrt(rec.size) if rec.size else nan.copy()
    accuracy = float(own_wins.mean()) if labels.size else float("nan")
    return FlipStats(rate, se, shift, shift_se, accuracy, int(rec.size), n_correct)
