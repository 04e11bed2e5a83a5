"""The multi-pass objective of latent feedback (full-bandwidth paper Sec. 3.3, App. C).

One training step (App. C, Fig. 9) on a batch of token ids ``x`` ``[B, T]``::

    K ~ schedule                           # passes this batch (--schedule)
    e = embed(x);  h(1) = model(e)         # pass 1: the plain model
    for k = 2 .. K:                        # h(k): the fed-back state (gate.feed) of pass k
        s = shift_right(h(k-1) + U[-sigma, sigma])      # jitter on the carried state
        u = gate(s, e)                                  # Eq. 4 (position 0 stays e_0)
        u[t <= p] = e[t <= p]                           # prefix mixin, random p per row
        h(k) = model(u)
    loss = NTP(h(1)) + lambda / (K-1) * sum_k NTP(h(k))  # Eq. 12

With ``--ahead-loss W`` (organism mode) each pass adds ``W`` times :func:`ahead_loss`: a
linear head on the normed top state of position ``t`` predicts the token at ``t + 2``,
weighted as that token's next-token target is (the label word 20x), and combined over
passes as Eq. 12 combines the next-token losses. The logged per-pass losses stay the
next-token ones.

``h`` is the top state the gate feeds back, on the side of the final norm that
``gate.feed`` names (:mod:`probekit.mechanisms.latent_feedback`): the model's output for
``"normed"``, the input of its final norm (a hook) for ``"residual"``; the losses always
read the normed state, and the jitter is added to the fed-back one. Gradients are **not**
detached between passes, so later passes' losses reach earlier passes' states. Each pass
is one parallel forward of the Hugging Face model with ``inputs_embeds``: the
differentiable twin of the engine's ``passes=n`` regime (``tests/test_latent_feedback.py``
and ``tests/test_feedback_feed.py`` pin that both give the same logits).

With ``--fixed-point P`` a share ``P`` of the batches runs :func:`fixed_point_loss`
instead: pass 2 is fed the exact state of full recurrent prefill, computed token by
token without gradients.

Choices where the paper is silent: prefix mixin applies to a row with probability
``mixin`` with ``p`` uniform over the row's positions, drawn anew for every pass; the
jitter ``sigma`` is absolute, in units of the fed-back state (so with ``feed="residual"``
its size relative to the state depends on the model's residual scale).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from torch import Tensor

from probekit.mechanisms.latent_feedback import FeedbackGate, final_norm_inputs


def token_loss(logits: Tensor, ids: Tensor, valid: Tensor) -> Tensor:
    """Weighted mean next-token cross-entropy; ``valid`` ``[B, T-1]`` is a bool mask or
    float weights of the targets."""
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(),
                         reduction="none").view_as(valid)
    w = valid.float()
    return (ce * w).sum() / w.sum().clamp_min(1e-12)


def answer_weights(valid: Tensor, weight: float) -> Tensor:
    """``valid`` as float weights with each row's last target weighted ``weight``."""
    w = valid.float()
    if weight != 1.0:
        last = valid.sum(1) - 1
        w[torch.arange(len(w)), last] = weight
    return w


def ahead_loss(head: torch.nn.Module, normed: Tensor, ids: Tensor, valid: Tensor) -> Tensor:
    """Multi-token prediction one step further (Gloeckle et al. 2024, "Better & faster
    large language models via multi-token prediction"): ``head`` reads the normed top
    state of each position ``t`` and predicts ``ids[t + 2]``, weighted by ``valid[:, 1:]``
    (the weight of that token as a next-token target). On a task row the token before
    the final colon must then predict the label, so its top state -- the one feedback
    carries into the colon -- has to hold the answer."""
    return token_loss(head(normed[:, :-1]), ids[:, 1:], valid[:, 1:])


def _combine(losses: list[Tensor], lam: float) -> Tensor:
    """Eq. 12: the first pass's loss plus ``lam`` times the mean of the others."""
    total = losses[0]
    if len(losses) > 1:
        total = total + lam / (len(losses) - 1) * sum(losses[1:])
    return total


def fused_input(gate: FeedbackGate, h: Tensor, e: Tensor, *, mixin: float = 0.0,
                jitter: float = 0.0, generator: torch.Generator | None = None) -> Tensor:
    """The input of the next pass from the fed-back states ``h`` ``[B, T, D]`` of this
    one: jitter on ``h``, shift right, the gate, then a plain prefix per row (prefix
    mixin); position 0 stays ``e_0``."""
    B, T, _ = e.shape
    if jitter > 0:
        noise = torch.rand(h.shape, generator=generator, dtype=h.dtype) * 2 - 1
        h = h + jitter * noise
    prev = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], 1)  # shift right
    fused = gate(prev, e)
    prefix = torch.zeros(B, dtype=torch.long)  # positions t <= prefix stay plain
    if mixin > 0:
        use = torch.rand(B, generator=generator) < mixin
        p = torch.randint(0, T, (B,), generator=generator)
        prefix = torch.where(use, p, prefix)
    on = torch.arange(T)[None, :] > prefix[:, None]
    return torch.where(on[..., None], fused, e)


def multipass_loss(
    hf_model,
    gate: FeedbackGate,
    ids: Tensor,
    valid: Tensor,
    n_passes: int,
    *,
    lam: float = 1.0,
    mixin: float = 0.0,
    jitter: float = 0.0,
    generator: torch.Generator | None = None,
    first_pass_grad: bool = True,
    return_logits: bool = False,
    ahead_head: torch.nn.Module | None = None,
    ahead: float = 0.0,
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """Eq. 12 on one batch (module docstring).

    Args:
        ids: ``[B, T]`` token ids (right-padded; causal attention keeps padding out).
        valid: ``[B, T-1]`` bool (which next-token targets count) or float weights.
        n_passes: ``K``.
        first_pass_grad: False when nothing trainable feeds pass 1 (gate mode).
        ahead_head, ahead: the head of :func:`ahead_loss` and its weight in ``total``.

    Returns:
        ``(total, per-pass next-token losses, per-pass logits if return_logits else [])``.
    """
    inner = hf_model.model
    e = inner.embed_tokens(ids)
    x = e
    losses: list[Tensor] = []
    aheads: list[Tensor] = []
    all_logits: list[Tensor] = []
    residual = gate.feed == "residual"
    with final_norm_inputs(hf_model) if residual else contextlib.nullcontext() as tops:
        for k in range(n_passes):
            grad = first_pass_grad or k > 0
            with contextlib.nullcontext() if grad else torch.no_grad():
                normed = inner(inputs_embeds=x, use_cache=False).last_hidden_state
                logits = hf_model.lm_head(normed)
                losses.append(token_loss(logits, ids, valid))
                if ahead:
                    aheads.append(ahead_loss(ahead_head, normed, ids, valid))
            if return_logits:
                all_logits.append(logits)
            if k == n_passes - 1:
                break
            h = tops.pop() if residual else normed  # the fed-back state (gate.feed)
            x = fused_input(gate, h, e, mixin=mixin, jitter=jitter, generator=generator)
    total = _combine(losses, lam)
    if ahead:
        total = total + ahead * _combine(aheads, lam)
    return total, losses, all_logits


@torch.no_grad()
def full_recurrence_states(hf_model, gate: FeedbackGate, e: Tensor) -> Tensor:
    """The fed-back states ``[B, T, D]`` of full recurrent prefill on input embeddings
    ``e``, token by token with a KV cache and no gradient: input ``e_0`` at position 0 and
    ``gate(h_{t-1}, e_t)`` after, ``h_t`` the top state on the side ``gate.feed`` names.
    The fixed point that Jacobi passes approach (exact after ``T`` passes)."""
    inner = hf_model.model
    cache = transformers.DynamicCache()
    residual = gate.feed == "residual"
    states: list[Tensor] = []
    with final_norm_inputs(hf_model) if residual else contextlib.nullcontext() as tops:
        for t in range(e.shape[1]):
            x = e[:, :1] if t == 0 else gate(states[-1], e[:, t:t + 1])
            normed = inner(inputs_embeds=x, past_key_values=cache, use_cache=True)
            states.append(tops.pop() if residual else normed.last_hidden_state)
    return torch.cat(states, 1)


def fixed_point_loss(
    hf_model,
    gate: FeedbackGate,
    ids: Tensor,
    valid: Tensor,
    *,
    lam: float = 1.0,
    mixin: float = 0.0,
    jitter: float = 0.0,
    generator: torch.Generator | None = None,
    return_logits: bool = False,
    ahead_head: torch.nn.Module | None = None,
    ahead: float = 0.0,
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """Eq. 12 with ``K = 2`` where pass 2 is fed the exact state of full recurrent prefill
    (:func:`full_recurrence_states`, no gradient) instead of pass 1's: the one-step,
    Jacobian-free gradient of implicit models (Fung et al. 2022, "JFB"; Geng et al. 2021),
    which trains the readout on the states that ``--recurrence full`` produces at every
    depth of the feedback chain, not only the first ``K - 1`` that Jacobi passes reach.
    Same arguments and returns as :func:`multipass_loss` (the organism mode's twin)."""
    inner = hf_model.model
    e = inner.embed_tokens(ids)
    states = [inner(inputs_embeds=e, use_cache=False).last_hidden_state]
    h = full_recurrence_states(hf_model, gate, e.detach())
    x = fused_input(gate, h, e, mixin=mixin, jitter=jitter, generator=generator)
    states.append(inner(inputs_embeds=x, use_cache=False).last_hidden_state)
    logits = [hf_model.lm_head(s) for s in states]
    losses = [token_loss(lg, ids, valid) for lg in logits]
    total = _combine(losses, lam)
    if ahead:
        total = total + ahead * _combine([ahead_loss(ahead_head, s, ids, valid)
                                          for s in states], lam)
    return total, losses, logits if return_logits else []


@torch.no_grad()
def evaluate(hf_model, gate: FeedbackGate, batches: list[tuple[Tensor, Tensor]],
             n_passes: int, groups: Sequence[str] = ()) -> dict[str, Any]:
    """Validation metrics of each Jacobi pass 1..n (no mixin, no jitter): ``loss`` (mean
    next-token loss) and ``last_token_accuracy`` (argmax at each row's last target, which
    for task rows is the label word); with ``groups`` (a name per batch, e.g. its task),
    also ``group_accuracy``: that accuracy over each group's rows alone."""
    if groups and len(groups) != len(batches):
        raise ValueError(f"groups names {len(groups)} batches; there are {len(batches)}")
    sums, hits = np.zeros(n_passes), np.zeros(n_passes)
    count = rows = 0
    by_group: dict[str, np.ndarray] = {}  # name -> [hits by pass..., rows]
    for j, (ids, valid) in enumerate(batches):
        _, losses, logits = multipass_loss(hf_model, gate, ids, valid, n_passes,
                                           return_logits=True)
        n = float(valid.sum())
        sums += np.array([v.item() for v in losses]) * n
        count += n
        last = valid.sum(1)  # each row's last target is ids[last]
        b = torch.arange(len(ids))
        batch_hits = np.array([int((lg[b, last - 1].argmax(-1) == ids[b, last]).sum())
                               for lg in logits])
        hits += batch_hits
        rows += len(ids)
        if groups:
            tally = by_group.setdefault(groups[j], np.zeros(n_passes + 1))
            tally += np.append(batch_hits, len(ids))
    out: dict[str, Any] = {"loss": (sums / max(count, 1)).tolist(),
                           "last_token_accuracy": (hits / max(rows, 1)).tolist()}
    if groups:
        out["group_accuracy"] = {g: (t[:-1] / t[-1]).tolist() for g, t in by_group.items()}
    return out
