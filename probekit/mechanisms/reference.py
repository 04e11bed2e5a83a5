"""The slow, obviously-correct reference of recirculation that the engine is tested against.

Written from SEMANTICS.md "Recirculation" alone: it imports nothing from the code it
checks and reads a recirculation config only as data (its fields ``paths`` — each with
``source``, ``destination``, ``alpha``, ``beta`` — and ``norm``, ``ramp``,
``iterations``).

No KV cache and no engine. A position's keys and values in block ``b`` are a function
of the residual entering block ``b`` at that position alone. So instead of keeping
keys/values, the reference keeps, for every processed position and every block ``b``,
the residual that position carries at block ``b``'s output **from the pass whose
keys/values SEMANTICS.md keeps**:

- blocks ``0 .. d``: the first pass (at ``d`` itself the final mixed ``z'_d``, which is
  what the blocks above read);
- blocks above ``d``: the last recurrent pass if the position recirculates, the first
  pass if it does not ("positions that do not recirculate keep first-pass KV
  everywhere", also inside a chunk of ``K > 1`` positions).

Every pass of every chunk re-runs the whole prefix ``x[:c1]`` through the plain
Hugging Face forward, with forward hooks that overwrite each block's output at the
processed positions (``< c0``) with those stored residuals; every block then recomputes
exactly the kept keys/values of the processed positions, and the chunk attends to them.
Hugging Face's forward also supplies everything architecture-specific (sliding-window
masks, per-layer-type rotary tables, absolute position embeddings), so the reference
runs every family the engine does; the blocks are found with
:func:`probekit.core.architecture.layout`. Logits are computed for the chunk's
positions only (``logits_to_keep``) and read from the first pass only: a 262k-token
vocabulary (Gemma 3) makes a ``[seq, vocab]`` logit tensor per pass the largest cost
otherwise.

A Peri-LN block (Gemma 3) normalises inside its residual branches, so "the output of
block ``b``" is still simply what its decoder layer returns (SEMANTICS.md); the hooks
read and overwrite exactly that.

Choices SEMANTICS.md leaves to the implementation, as ``probekit.mechanisms.recirculation``
documents them: several paths run in one recurrent pass starting above the lowest
destination ``d0``; at every other destination the pass's own output there is mixed with
that path's source output of the previous pass; iteration ``j >= 2`` mixes into the
previous iteration's mixed state at ``d0``; a source's output is taken before any mix at
that block.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from probekit.core.architecture import layout

Force = Callable[[int, Tensor], Tensor]  # (block, chunk output [pos, D]) -> forced output


def _mix(z_s: Tensor, z_d: Tensor, alpha: float, beta: float, norm: str) -> Tensor:
    """``alpha * f(z_s) + beta * z_d`` for one position's vectors, in float64 (Eq. 1-2)."""
    z_s, z_d = z_s.double(), z_d.double()
    if norm == "ratio":
        n_s = float(z_s.norm())
        # ratio: rescale the source to the destination's norm; f(z_s) = 0 when ||z_s|| = 0.
        f = z_s * (float(z_d.norm()) / n_s) if n_s > 0 else torch.zeros_like(z_s)
    elif norm == "none":
        f = z_s
    else:
        raise ValueError(f"unknown norm {norm!r}")
    return alpha * f + beta * z_d


def _coefficients(path, t: int, ramp: int) -> tuple[float, float]:
    """``alpha_t = min(t / ramp, 1) * alpha`` (ramp 0: none); ``beta_t = 1 - alpha_t``
    unless the path fixes beta."""
    alpha = min(t / ramp, 1.0) * path.alpha if ramp else float(path.alpha)
    return alpha, 1.0 - alpha if path.beta is None else float(path.beta)


def _forward(hf, x: Tensor, c0: int, stored: list[Tensor], force: Force
             ) -> tuple[Tensor, list[Tensor]]:
    """Forward ``x`` (``[1, c1]``) with positions ``< c0`` forced to ``stored`` at every
    block output and chunk positions ``c0 ..`` to ``force(block, raw)``.

    Returns the chunk's logits ``[pos, vocab]`` and its raw (unforced) outputs per block."""
    raw: list[Tensor] = []
    handles = []
    for b, layer in enumerate(layout(hf).layers):
        def hook(module, args, out, b=b):
            h = out[0] if isinstance(out, tuple) else out
            raw.append(h[0, c0:].clone())
            h = h.clone()
            h[0, :c0] = stored[b][:c0].to(h.dtype)
            h[0, c0:] = force(b, h[0, c0:]).to(h.dtype)
            return (h, *out[1:]) if isinstance(out, tuple) else h
        handles.append(layer.register_forward_hook(hook))
    try:
        n = x.shape[1] - c0  # 0 for an empty chunk, where logits_to_keep=0 would mean all
        logits = hf(x, use_cache=False, logits_to_keep=max(n, 1)).logits[0]
        logits = logits[logits.shape[0] - n:]
    finally:
        for handle in handles:
            handle.remove()
    return logits, raw


@torch.no_grad()
def reference_recirculation(
    model,
    tokens: Sequence[int],
    recirculation=None,
    *,
    mask: Sequence[bool] | None = None,
    block_size: int | Sequence[int] = 1,
    temperature: float = 1.0,
) -> Tensor:
    """``[len-1]`` log-probs ``log p(x[t+1] | prediction at t)`` of one sequence.

    Args:
        model: a loaded model (``model.hf_model`` is the Hugging Face Llama-style model).
        recirculation: the config (fields read as data, module docstring); None is the
            plain model.
        mask: which positions recirculate (default all).
        block_size: positions per chunk (K; 1 is the exact method), or the chunk sizes.
    """
    hf = model.hf_model
    x = torch.tensor([list(tokens)])
    T, L = x.shape[1], hf.config.num_hidden_layers
    active = [True] * T if mask is None else [bool(m) for m in list(mask)[:T]]
    paths = sorted(recirculation.paths, key=lambda p: p.destination) if recirculation else []
    sizes = ([block_size] * math.ceil(T / block_size) if isinstance(block_size, int)
             else list(block_size))
    # stored[b][t]: the residual position t carries at block b's output (module docstring).
    stored = [torch.zeros(T, hf.config.hidden_size) for _ in range(L)]
    logits = torch.empty(T, hf.config.vocab_size)

    c0 = 0
    for size in sizes:
        c1 = min(T, c0 + size)
        chunk_logits, first = _forward(hf, x[:, :c1], c0, stored, lambda b, h: h)
        logits[c0:c1] = chunk_logits  # the readout: first pass only
        final = [h.clone() for h in first]  # per block, the residual each position keeps
        on = [t for t in range(c0, c1) if active[t]]
        if paths and on:
            d0 = paths[0].destination
            previous = first  # block outputs of the previous pass
            dest_state = {t: first[d0][t - c0] for t in on}

            for _ in range(recirculation.iterations):
                mixed: dict[tuple[int, int], Tensor] = {}  # (block, t) -> mixed state

                def force(b: int, h: Tensor, previous=previous, mixed=mixed) -> Tensor:
                    if b < d0:
                        return first[b]  # blocks below d0 do not run again
                    h = first[b].clone() if b == d0 else h.clone()
                    for p in paths:
                        if p.destination != b:
                            continue
                        for t in on:
                            alpha_t, beta_t = _coefficients(p, t, recirculation.ramp)
                            base = dest_state[t] if b == d0 else h[t - c0]
                            mixed[b, t] = _mix(previous[p.source][t - c0], base, alpha_t,
                                               beta_t, recirculation.norm).to(h.dtype)
                            h[t - c0] = mixed[b, t]
                    if b > d0:  # positions that do not recirculate keep their first pass
                        off = [t - c0 for t in range(c0, c1) if not active[t]]
                        h[off] = first[b][off]
                    return h

                _, previous = _forward(hf, x[:, :c1], c0, stored, force)
                dest_state = {t: mixed[d0, t] for t in on}
                for t in on:  # this pass is the last one so far: its residuals are kept
                    for b in range(d0, L):
                        final[b][t - c0] = (mixed[b, t] if (b, t) in mixed
                                            else previous[b][t - c0])
        for b in range(L):
            stored[b][c0:c1] = final[b]
        c0 = c1

    lp = torch.log_softmax(logits[:-1].float() / temperature, dim=-1)
    return lp.gather(-1, x[0, 1:, None])[:, 0]
