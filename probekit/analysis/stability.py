"""Stability of the learned feedback map under many fused passes (full-bandwidth paper Fig. 3).

    probekit feedback-stability --checkpoint runs/train-feedback-<hash>/checkpoint --passes 32
    curves = stability_curves(engine, gate, input_ids, n_passes=32)

The paper checks whether latent feedback stays well behaved far beyond the 2-3 passes
seen in training by iterating fused prefill passes (Eqs. 9-11) and plotting, against
the pass number ``k``, (left) the validation loss of pass ``k`` and (right) the size of
the update ``||h(k) - h(k-1)||`` of the top-layer states. A stable map keeps the loss
flat and the update decaying to a small plateau (a contraction toward a fixed point);
an unstable one shows rising loss and oscillating updates.

Measured here with the engine's own ``passes=n`` regime (one run with ``n`` passes;
:class:`probekit.mechanisms.latent_feedback.LatentFeedback`'s ``on_pass`` callback sees
every pass), on sequences of ``T`` tokens:

- ``loss[k]``: mean next-token loss of pass ``k`` (``k = 1`` is the plain model);
- ``update[k]`` (``k >= 2``): mean over positions of ``||h_t(k) - h_t(k-1)||_2`` and the
  same divided by the mean ``||h_t(k)||`` (``relative_update``), where ``h`` is the state
  the gate feeds back (what ``on_pass`` sees): after the final norm for a
  ``feed="normed"`` gate, the un-normed top residual for ``"residual"`` (the map whose
  fixed point is in question is the one from fed-back state to fed-back state; the
  loss reads the normed state either way). Pass ``k`` makes
  positions ``< k`` exact, so their update is exactly 0 from then on; to keep that
  trivial convergence out of the curve the mean is taken over positions
  ``t >= n`` only (never exact within the run), which needs ``T > n``.

The rows must all have the same length ``T``; :func:`equal_length_rows` picks them from
ragged task rows (the longest length enough rows share). ``probekit feedback-stability``
chooses the data (docs/commands/feedback-stability.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from probekit.core.engine import Step, StepEngine
from probekit.mechanisms.latent_feedback import FeedbackGate, LatentFeedback


@torch.no_grad()
def stability_curves(
    engine: StepEngine,
    gate: FeedbackGate,
    input_ids: Tensor,
    n_passes: int,
    *,
    answer_positions: Tensor | None = None,
) -> dict[str, Any]:
    """Per-pass loss and state update of ``n_passes`` Jacobi passes over ``input_ids``.

    Args:
        input_ids: ``[batch, T]`` equal-length rows with ``T > n_passes``.
        answer_positions: ``[batch]`` optional position whose next token is the answer
            (a task's label); adds ``answer_accuracy[k]``.

    Returns:
        dict with lists indexed by pass ``k - 1``: ``loss``, ``update``,
        ``relative_update`` (NaN at ``k = 1``), and ``answer_accuracy`` if asked.
    """
    ids = torch.as_tensor(input_ids)
    if ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, T]; got shape {tuple(ids.shape)}")
    T = ids.shape[1]
    if not isinstance(n_passes, int) or n_passes < 1:
        raise ValueError(f"n_passes must be an integer >= 1; got {n_passes!r}")
    if T <= n_passes:
        raise ValueError(
            f"sequences of {T} tokens are exact after {T} passes; use sequences longer than "
            f"--passes {n_passes} (or fewer passes)"
        )
    lm_head = engine.model.hf_model.lm_head
    rec: LatentFeedback  # bound below; on_pass runs inside engine.run
    targets = ids[:, 1:]
    loss, update, relative, accuracy = [], [], [], []
    previous: list[Tensor] = []

    def on_pass(j: int, step: Step, h: Tensor) -> None:
        logits = lm_head(rec.normed(h)).float()  # h is the fed-back state (gate.feed)
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, targets[..., None])[..., 0]
        loss.append(float(-lp.mean()))
        if answer_positions is not None:
            b = torch.arange(len(ids))
            pred = logits[b, answer_positions].argmax(-1)
            accuracy.append(float((pred == ids[b, answer_positions + 1]).float().mean()))
        tail = h[:, n_passes:]
        if previous:
            diff = (tail - previous[0]).norm(dim=-1).mean()
            update.append(float(diff))
            relative.append(float(diff / tail.norm(dim=-1).mean()))
        else:
            update.append(float("nan"))
            relative.append(float("nan"))
        previous[:] = [tail]

    rec = LatentFeedback(gate, engine.model, passes=n_passes, on_pass=on_pass)
    engine.run(ids, rec, block_size=T)
    out = {"passes": list(range(1, n_passes + 1)), "loss": loss, "update": update,
           "relative_update": relative, "seq_len": T, "n_sequences": len(ids)}
    if answer_positions is not None:
        out["answer_accuracy"] = accuracy
    return out


def equal_length_rows(rows: list[list[int]], n_passes: int, *,
                      min_rows: int = 16) -> tuple[Tensor, Tensor]:
    """The rows of the longest length that at least ``min_rows`` of ``rows`` share, as
    ``[batch, T]`` ids, and the position predicting each row's last token (a task row's
    label). Longest, so that the measured positions ``t >= n_passes`` are most of each row.
    """
    lengths = np.array([len(r) for r in rows])
    values, counts = np.unique(lengths, return_counts=True)
    values = values[counts >= min_rows]
    if not values.size or values.max() <= n_passes:
        raise ValueError(f"no {min_rows} probe sequences are longer than {n_passes} tokens; "
                         f"use fewer --passes")
    T = int(values.max())
    keep = [r for r in rows if len(r) == T]
    return torch.tensor(keep), torch.full((len(keep),), T - 2)
