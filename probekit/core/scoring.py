"""Next-token log-probs of right-padded batches, and the chunking of a run.

SEMANTICS.md "Indexing": the prediction made **at** position ``t`` scores token
``x[t+1]``; a position whose successor is padding has no score (NaN), so a padded
number can never be mistaken for a result.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def target_log_probs(logits: Tensor, targets: Tensor, valid: Tensor, temperature: float = 1.0
                     ) -> Tensor:
    """``log_softmax(logits / temperature)`` at ``targets`` (``[batch, pos]``), NaN where not
    ``valid``."""
    lp = torch.log_softmax(logits.float() / temperature, dim=-1)
    got = lp.gather(-1, targets[..., None])[..., 0]
    return torch.where(valid, got, torch.full_like(got, float("nan")))


def score(logits: Tensor, ids: Tensor, lengths: Tensor, temperature: float = 1.0) -> Tensor:
    """``[batch, seq-1]`` ``log p(x[t+1] | logits at t)`` of whole sequences ``ids``
    (``logits`` ``[batch, seq, vocab]``), NaN where ``t+1`` is padding."""
    valid = torch.arange(1, ids.shape[1])[None, :] < lengths[:, None]
    return target_log_probs(logits[:, :-1], ids[:, 1:], valid, temperature)


def score_chunk(logits: Tensor, ids: Tensor, lengths: Tensor, c0: int, c1: int,
                temperature: float, out: Tensor) -> None:
    """Write ``log p(x[t+1] | t)`` into ``out[:, t]`` for the chunk's positions
    ``c0 <= t < c1`` that have a successor (``logits`` ``[batch, c1-c0, vocab]``)."""
    t1 = min(c1, ids.shape[1] - 1)
    if t1 <= c0:
        return
    valid = torch.arange(c0 + 1, t1 + 1)[None, :] < lengths[:, None]
    out[:, c0:t1] = target_log_probs(logits[:, : t1 - c0], ids[:, c0 + 1 : t1 + 1], valid,
                                     temperature)


def chunk_bounds(block_size: int | Sequence[int], start: int, seq: int) -> list[tuple[int, int]]:
    """``[(c0, c1), ...]`` chunks covering ``start .. seq-1``: ``block_size`` positions each
    (the last one may be shorter), or the consecutive sizes it lists."""
    if not 0 <= start < seq:
        raise ValueError(f"start must lie in [0, {seq}); got {start}")
    if isinstance(block_size, int):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1; got {block_size}")
        sizes = [block_size] * -(-(seq - start) // block_size)
    else:
        sizes = list(block_size)
        if any(k < 1 for k in sizes) or sum(sizes) != seq - start:
            raise ValueError(
                f"chunk sizes {sizes} must be >= 1 and sum to seq - start = {seq - start}"
            )
    bounds, c0 = [], start
    for k in sizes:
        bounds.append((c0, min(seq, c0 + k)))
        c0 += k
    return bounds
