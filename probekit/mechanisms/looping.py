"""Looping baseline: run a range of blocks twice, training-free (paper Sec. 4.4.3, App. C.3).

    from probekit.mechanisms.looping import Looping
    result = Looping(4, 11).run(engine, token_ids)     # RunResult with .log_probs

For ``l1 < l2`` (block indices, zero-based, ``0 <= l1 < l2 <= L-1``), a copy of blocks
``l1+1 .. l2`` is inserted right after block ``l2`` (SEMANTICS.md "Looping baseline")::

    embed -> blocks 0 .. l2 -> blocks l1+1 .. l2 (again) -> blocks l2+1 .. L-1 -> unembed

so the output of block ``l2`` is fed back into block ``l1+1``: in the sweep heatmaps
``l2`` plays the source's role and ``l1`` the destination's (paper Fig. 8). Unlike
recirculation it is an ordinary (deeper) feed-forward stack, so it runs as ONE
parallel forward over all positions.

The duplicated blocks are new layers of the deeper stack and need their own keys and
values: the second application of block ``b`` attends to its own second-application
keys/values of earlier positions, not to the first application's. The engine's
:class:`~probekit.core.kv_cache.KVCache` is indexed by block, so the copy writes into a
second cache (one per copy) while blocks ``0 .. l2`` and ``l2+1 .. L-1`` use the first.

Hooks: TransformerLens hook names fire for both applications of a block; the copy runs
as pass 1 (``pass_index=1`` of :meth:`~probekit.core.engine.StepEngine.run_blocks`, what
the engine's hooks see), everything else as pass 0.

:func:`reference_looping` is the slow check: Hugging Face's own forward of the model
whose layer list is literally ``[0 .. l2, l1+1 .. l2, l2+1 .. L-1]``, one sequence at
a time, no cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from probekit.core.engine import RunResult, StepEngine, score
from probekit.core.kv_cache import KVCache
from probekit.mechanisms.recirculation import check_block_pair


@dataclass(frozen=True)
class Looping:
    """Insert a copy of blocks ``l1+1 .. l2`` after block ``l2``.

    Args:
        l1: the block after which the looped range starts (plays the destination role).
        l2: the last block of the looped range (plays the source role), ``l1 < l2``.
    """

    l1: int
    l2: int

    def __post_init__(self) -> None:
        check_block_pair("l1", self.l1, "l2", self.l2, error=TypeError)

    def check(self, n_blocks: int) -> None:
        if self.l2 > n_blocks - 1:
            raise ValueError(f"l2 = {self.l2} is out of range: this model has {n_blocks} blocks, "
                             f"numbered 0..{n_blocks - 1}")

    def block_order(self, n_blocks: int) -> list[int]:
        """The looped stack as original block indices, e.g. ``[0, 1, 2, 1, 2, 3]``."""
        self.check(n_blocks)
        return [*range(self.l2 + 1), *range(self.l1 + 1, self.l2 + 1),
                *range(self.l2 + 1, n_blocks)]

    @torch.no_grad()
    def run(
        self,
        engine: StepEngine,
        input_ids: Tensor | Sequence[Sequence[int]],
        *,
        temperature: float = 1.0,
        fwd_hooks: Iterable[tuple[Any, Callable]] = (),
    ) -> RunResult:
        """One parallel forward of the looped stack; ``log_probs`` as :meth:`StepEngine.run`."""
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0; got {temperature}")
        self.check(engine.n_blocks)
        ids, lengths = engine.batch(input_ids)
        L, seq = engine.n_blocks, ids.shape[1]
        positions = torch.arange(seq)
        first, second = KVCache(L, seq), KVCache(L, seq)
        with engine.hooks(fwd_hooks):
            x = engine.embed(ids)
            x, _ = engine.run_blocks(0, self.l2 + 1, x, positions, first)
            x, _ = engine.run_blocks(self.l1 + 1, self.l2 + 1, x, positions, second,
                                     pass_index=1)
            x, _ = engine.run_blocks(self.l2 + 1, L, x, positions, first)
            logits = engine.unembed(x)
        return RunResult(ids, lengths, score(logits, ids, lengths, temperature))


@torch.no_grad()
def reference_looping(model, tokens: Sequence[int], looping: Looping) -> Tensor:
    """``[len-1]`` log-probs of one sequence through Hugging Face's forward of the looped
    layer list (no cache; the original layer list is restored afterwards)."""
    hf = model.hf_model
    inner = hf.model
    order = looping.block_order(hf.config.num_hidden_layers)
    layers, n = inner.layers, hf.config.num_hidden_layers
    inner.layers = torch.nn.ModuleList([layers[b] for b in order])
    hf.config.num_hidden_layers = len(order)
    try:
        logits = hf(torch.tensor([list(tokens)]), use_cache=False).logits[0]
    finally:
        inner.layers, hf.config.num_hidden_layers = layers, n
    lp = torch.log_softmax(logits[:-1].float(), dim=-1)
    return lp.gather(-1, torch.tensor(list(tokens))[1:, None])[:, 0]
