"""Slow, obviously-correct reference implementations that fast paths are tested against.

No KV cache and no engine: every step re-runs the whole prefix through the plain
Hugging Face forward, one sequence at a time, and forces the residual of already
processed positions at each destination block to its stored recirculated value.

Why this equals SEMANTICS.md's cached definition: blocks ``0 .. d`` of every position
keep first-pass keys/values, and a full forward recomputes exactly those (nothing
below ``d`` is ever changed); above ``d``, a processed position's keys/values are the
ones its last recurrent pass computed from its final mixed ``z'_d``, which is what a
full forward from the stored ``z'_d`` recomputes, attending to earlier positions'
replaced states. So one forward per pass and chunk reproduces the cached run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from probekit.mechanisms.recirculation import Recirculation, mix


def _layers(hf_model):
    return hf_model.model.layers


@torch.no_grad()
def reference_recirculation(
    model,
    tokens: Sequence[int],
    recirculation: Recirculation | None,
    *,
    mask: Sequence[bool] | None = None,
    block_size: int = 1,
    temperature: float = 1.0,
) -> Tensor:
    """``[len-1]`` log-probs ``log p(x[t+1] | prediction at t)`` of one sequence."""
    hf = model.hf_model
    x = torch.tensor([list(tokens)])
    T = x.shape[1]
    active = torch.ones(T, dtype=torch.bool) if mask is None else torch.tensor(list(mask))[:T]
    logits_all = torch.empty(T, hf.config.vocab_size)
    paths = recirculation.paths if recirculation else ()
    dests = [p.destination for p in paths]
    sources = {p.source for p in paths}
    # stored[d][t]: the residual position t carries at block d's output from now on.
    stored = {d: torch.zeros(T, hf.config.hidden_size) for d in dests}
    is_stored = torch.zeros(T, dtype=torch.bool)

    def forward(c0: int, c1: int, chunk_edit: dict) -> dict[int, Tensor]:
        """Forward x[:c1]; processed positions (< c0) get their stored states; chunk
        positions at block b get ``chunk_edit[b](raw)``. Returns raw chunk outputs."""
        raw: dict[int, Tensor] = {}
        handles = []
        for b, layer in enumerate(_layers(hf)):
            def hook(mod, args, out, b=b):
                h = out[0] if isinstance(out, tuple) else out
                raw[b] = h[0, c0:c1].clone()
                if b in stored or b in chunk_edit:
                    h = h.clone()
                    if b in stored:
                        keep = is_stored[:c0]
                        h[0, :c0][keep] = stored[b][:c0][keep]
                    if b in chunk_edit:
                        h[0, c0:c1] = chunk_edit[b](h[0, c0:c1])
                return (h, *out[1:]) if isinstance(out, tuple) else h
            handles.append(layer.register_forward_hook(hook))
        try:
            logits = hf(x[:, :c1]).logits[0]
        finally:
            for hd in handles:
                hd.remove()
        raw["logits"] = logits[c0:c1]
        return raw

    for c0 in range(0, T, block_size):
        c1 = min(T, c0 + block_size)
        first = forward(c0, c1, {})
        logits_all[c0:c1] = first["logits"]
        act = active[c0:c1, None]
        if not paths or not bool(act.any()):
            continue
        pos = torch.arange(c0, c1)
        previous, dest_state = first, first[paths[0].destination]
        final: dict[int, Tensor] = {}
        for _ in range(recirculation.iterations):
            edits = {}
            for i, p in enumerate(paths):
                alpha, beta = recirculation.coefficients(p, pos)
                z_s = previous[p.source]

                def edit(z_d, z_s=z_s, alpha=alpha[0], beta=beta[0], d=p.destination, low=i == 0):
                    base = dest_state if low else z_d
                    out = torch.where(act, mix(z_s, base, alpha, beta, recirculation.norm), base)
                    final[d] = out
                    return out
                edits[p.destination] = edit
            previous = forward(c0, c1, edits)
            previous = {b: previous[b] for b in sources}
            dest_state = final[paths[0].destination]
        for d in dests:
            stored[d][c0:c1] = torch.where(act, final[d], stored[d][c0:c1])
        # Inactive positions of a chunk keep whatever blocks above d compute for them.
        is_stored[c0:c1] |= active[c0:c1]

    lp = torch.log_softmax(logits_all[:-1].float() / temperature, dim=-1)
    return lp.gather(-1, x[0, 1:, None])[:, 0]
