"""The small interface between the step engine and a model-execution library.

The engine never touches a model's modules; it asks a backend to embed tokens,
run a range of blocks for a chunk of positions on a KV cache, and read logits out.
Two backends implement it over the same Hugging Face model:

- ``lens`` (:mod:`probekit.core.backends.lens`): TransformerLens 4.x ``TransformerBridge``;
  every block call fires TransformerLens hook points (``blocks.{b}.hook_resid_post``,
  ``blocks.{b}.attn.hook_pattern``, ...), so user hooks see recurrent passes.
- ``nnsight`` (:mod:`probekit.core.backends.nnsight`): the same calls, each pass one nnsight
  trace of the model's own forward; users intervene the nnsight way (docs/nnsight.md).

Shapes: ``resid`` is ``[batch, pos, d_model]`` for the ``pos`` positions of the
current chunk; ``positions`` holds their absolute (zero-based) indices, shared by
every row of the batch (ragged batches are right-padded, see :mod:`probekit.core.engine`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any

from torch import Tensor

from probekit.core.kv_cache import KVCache

# An edit replaces a block's output residual (after the block ran, before the next
# block reads it). Recirculation with several paths mixes at each destination.
Edit = Callable[[Tensor], Tensor]


class Backend(ABC):
    """Executes one model block by block. Subclasses set the attributes below."""

    name: str
    n_blocks: int
    d_model: int
    n_ctx: int
    vocab_size: int

    @abstractmethod
    def embed(self, input_ids: Tensor) -> Tensor:
        """Token ids ``[batch, pos]`` -> residual depth 0 ``[batch, pos, d_model]``."""

    @abstractmethod
    def prepare_positions(self, positions: Tensor) -> Any:
        """Per-chunk position data (rotary cos/sin) reused by every block of every pass."""

    @abstractmethod
    def run_block(self, block: int, resid: Tensor, pos: Any, cache: KVCache) -> Tensor:
        """Run block ``block`` on ``resid``, appending its keys/values to ``cache``."""

    @abstractmethod
    def unembed(self, resid: Tensor) -> Tensor:
        """Top residual ``[batch, pos, d_model]`` -> logits ``[batch, pos, vocab]``."""

    @abstractmethod
    def hooks(self, fwd_hooks: Iterable[tuple[Any, Callable]]) -> AbstractContextManager:
        """Attach ``(hook_name_or_filter, fn)`` pairs for the duration of a run."""

    def run_blocks(
        self,
        start: int,
        stop: int,
        resid: Tensor,
        pos: Any,
        cache: KVCache,
        capture: Iterable[int] = (),
        edits: Mapping[int, Edit] | None = None,
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """Run blocks ``start .. stop-1``; return the last output and the outputs of the
        blocks in ``capture`` (as each block produced them, before any edit)."""
        capture = set(capture)
        captured: dict[int, Tensor] = {}
        for b in range(start, stop):
            resid = self.run_block(b, resid, pos, cache)
            if b in capture:
                captured[b] = resid
            if edits and b in edits:
                resid = edits[b](resid)
        return resid, captured
