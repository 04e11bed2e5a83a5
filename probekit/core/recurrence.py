"""The interface between the step engine and a recurrence strategy.

A recurrence (recirculation, latent feedback, ...) is a small object the engine calls at
fixed points of every chunk of positions (:mod:`probekit.core.engine` draws the step):
``form_input`` gives the chunk's input at depth 0, and ``after_first_pass`` may run the
upper blocks again through ``rerun``. Strategies own their maths only; the engine owns
the cache, positions, batching and readout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor


@dataclass
class Step:
    """What a recurrence sees of the current chunk.

    Attributes:
        start: absolute position of the chunk's first token.
        positions: ``[pos]`` absolute positions of the chunk.
        active: ``[batch, pos]`` bool, which (row, position) pairs the recurrence acts
            on (the user's mask and-ed with "is a real token").
        input_ids: ``[batch, pos]`` the chunk's tokens.
    """

    start: int
    positions: Tensor
    active: Tensor
    input_ids: Tensor


class Recurrence:
    """Base class of recurrence strategies; by itself, the plain model.

    The engine calls, in order: ``check`` (before any state), ``begin`` (once per run),
    then per chunk ``form_input`` and ``after_first_pass``.
    """

    name = "none"
    #: blocks whose first-pass output ``after_first_pass`` needs.
    capture_first: frozenset[int] = frozenset()

    def check(self, n_blocks: int) -> None:
        """Raise ValueError if this recurrence cannot run on a model of ``n_blocks``."""

    def begin(self, batch_size: int, seq_len: int) -> None:
        """Reset per-run state."""

    def form_input(self, step: Step, embeds: Tensor) -> Tensor:
        """The chunk's residual at depth 0 (default: the token embeddings)."""
        return embeds

    def after_first_pass(
        self, step: Step, captured: dict[int, Tensor], top: Tensor, rerun: Rerun
    ) -> None:
        """Called after the first pass; may re-run upper blocks through ``rerun``."""


# rerun(start_block, resid, capture=(), edits=None, replace=None) -> captured outputs of that
# pass; ``replace`` (``[batch, pos]`` bool, default all) picks the (row, position) pairs
# whose keys/values the pass replaces in blocks start..L-1; the others keep theirs.
Rerun = Callable[..., dict[int, Tensor]]
