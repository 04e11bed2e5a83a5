"""A small preallocated key/value cache that the step engine owns.

Hugging Face's ``DynamicCache`` grows by ``torch.cat`` at every step, which copies
the whole cache once per token and per block; for token-by-token recurrent runs
over long windows that copy dominates. This cache allocates each block's
``[batch, kv_heads, max_len, head_dim]`` buffers once and writes in place.

It speaks the one method the attention modules call (``update``, the
``transformers.Cache`` protocol that TransformerLens' bridge and HF's Llama
attention both use) plus the two operations recurrences need:

- ``truncate`` a range of blocks back to a length, so that a second pass over a
  position *replaces* that position's keys/values instead of appending next to them
  (SEMANTICS.md, Recirculation step 3);
- ``keeping(start, keep)``: while a pass re-runs a chunk of positions, the
  ``(row, position)`` pairs marked in ``keep`` hold on to the entries they already
  have, and the pass's other positions attend to those. This is how positions that do
  not recirculate keep their first-pass keys/values in a chunk of ``K > 1`` positions
  (SEMANTICS.md: "Positions that do not recirculate keep first-pass KV everywhere").

Sliding-window blocks (Gemma 3: five local blocks of window 512 per global one): a
block with window ``w`` lets the query at position ``p`` see keys ``p-w+1 .. p`` only
(Hugging Face's ``sliding_window_overlay``). ``set_window(block, w)`` declares it;
``update`` then hands the attention only the keys some query of the chunk can see, and
:meth:`attention_mask` gives the band mask for a chunk of several positions (a single
position sees exactly the keys handed over, so it needs none). All positions stay
stored, so truncating back to an earlier position works as for global blocks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor


class KVCache:
    """Per-block key/value buffers with an independent fill length per block.

    Args:
        n_blocks: number of transformer blocks (one buffer pair each).
        max_len: the longest sequence the run will reach; buffers are sized once.
        windows: per block, its sliding window or None (global); default all global.
            Backends also declare windows with :meth:`set_window` before a block runs.
    """

    is_compileable = False

    def __init__(self, n_blocks: int, max_len: int,
                 windows: Sequence[int | None] | None = None) -> None:
        self.n_blocks = n_blocks
        self.max_len = max_len
        self.keys: list[Tensor | None] = [None] * n_blocks
        self.values: list[Tensor | None] = [None] * n_blocks
        self.lengths = [0] * n_blocks
        self.windows: list[int | None] = [None] * n_blocks
        for b, w in enumerate(windows or ()):
            self.set_window(b, w)
        self._keep: tuple[int, Tensor] | None = None

    def set_window(self, block: int, window: int | None) -> None:
        """Block ``block`` attends to the last ``window`` positions (None: all)."""
        if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                                   or window < 1):
            raise ValueError(f"a sliding window must be a positive int or None; got {window!r}")
        self.windows[block] = window

    def visible_from(self, block: int, start: int) -> int:
        """The first position the query at ``start`` can see in ``block``."""
        w = self.windows[block]
        return 0 if w is None else max(0, start - w + 1)

    def attention_mask(self, block: int, q_len: int) -> Tensor | None:
        """``[q_len, kv]`` bool mask for the next write of ``q_len`` positions to ``block``
        (query ``i`` at ``start + i`` against the keys ``update`` will return), or None
        when the plain rectangular causal mask (query ``i`` sees keys ``0 .. kv-q+i``)
        is already right: a global block, one position, or a chunk inside the window."""
        start, w = self.lengths[block], self.windows[block]
        lo = self.visible_from(block, start)
        if w is None or q_len == 1 or start + q_len <= w:
            return None
        query = torch.arange(start, start + q_len)[:, None]
        key = torch.arange(lo, start + q_len)[None, :]
        return (key <= query) & (key > query - w)

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args, **kwargs):
        """Append ``key``/``value`` ``[batch, kv_heads, q, head_dim]`` at the block's fill
        length and return the block's cached entries the chunk can see, the new ones
        included: all of them, or for a sliding block those from :meth:`visible_from`."""
        if self.keys[layer_idx] is None:
            b, h, _, d = key.shape
            self.keys[layer_idx] = key.new_empty(b, h, self.max_len, d)
            self.values[layer_idx] = value.new_empty(b, h, self.max_len, d)
        start = self.lengths[layer_idx]
        stop = start + key.shape[2]
        if stop > self.max_len:
            raise RuntimeError(
                f"KV cache overflow in block {layer_idx}: {stop} > max_len {self.max_len}"
            )
        if self._keep is not None:
            key, value = self._kept(layer_idx, start, key, value)
        self.keys[layer_idx][:, :, start:stop] = key
        self.values[layer_idx][:, :, start:stop] = value
        self.lengths[layer_idx] = stop
        lo = self.visible_from(layer_idx, start)
        return self.keys[layer_idx][:, :, lo:stop], self.values[layer_idx][:, :, lo:stop]

    @contextmanager
    def keeping(self, start: int, keep: Tensor) -> Iterator[None]:
        """While open, writes at positions ``start ..`` leave the entries of the pairs where
        ``keep`` (``[batch, pos]`` bool, its column ``j`` is position ``start + j``) is True
        as they are, and ``update`` hands those kept entries to the attention.

        Meant for a pass that re-runs a chunk after :meth:`truncate` to its start: the
        buffers past the fill length still hold the chunk's previous entries (truncate only
        moves the length), and those are what the kept pairs keep."""
        self._keep = (start, keep) if bool(keep.any()) else None
        try:
            yield
        finally:
            self._keep = None

    def _kept(self, layer: int, start: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        k0, keep = self._keep
        if start != k0 or key.shape[2] != keep.shape[1] or key.shape[0] != keep.shape[0]:
            raise RuntimeError(
                f"block {layer}: a write of {key.shape[2]} positions at {start} does not match "
                f"the kept chunk of {keep.shape[1]} positions at {k0}"
            )
        m = keep.to(key.device)[:, None, :, None]
        span = slice(start, start + key.shape[2])
        return (torch.where(m, self.keys[layer][:, :, span], key),
                torch.where(m, self.values[layer][:, :, span], value))

    def truncate(self, blocks: range, length: int) -> None:
        """Forget positions ``>= length`` in ``blocks`` (their next ``update`` overwrites)."""
        for b in blocks:
            if self.lengths[b] < length:
                raise RuntimeError(f"cannot truncate block {b} from {self.lengths[b]} to {length}")
            self.lengths[b] = length

    def copy(self, length: int | None = None, max_len: int | None = None) -> KVCache:
        """An independent cache holding this one's positions ``< length`` (default: all)."""
        new = KVCache(self.n_blocks, max_len or self.max_len, self.windows)
        for b in range(self.n_blocks):
            n = self.lengths[b] if length is None else length
            if n > self.lengths[b]:
                raise ValueError(f"block {b} holds {self.lengths[b]} positions, not {n}")
            if self.keys[b] is not None:
                k, v = self.keys[b], self.values[b]
                new.keys[b] = k.new_empty(k.shape[0], k.shape[1], new.max_len, k.shape[3])
                new.values[b] = v.new_empty(new.keys[b].shape)
                new.keys[b][:, :, :n] = k[:, :, :n]
                new.values[b][:, :, :n] = v[:, :, :n]
            new.lengths[b] = n
        return new

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.lengths[layer_idx]

    def block_kv(self, block: int) -> tuple[Tensor, Tensor]:
        """The filled keys and values of ``block``: ``[batch, kv_heads, len, head_dim]``."""
        n = self.lengths[block]
        return self.keys[block][:, :, :n], self.values[block][:, :, :n]
