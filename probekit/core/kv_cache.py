"""A small preallocated key/value cache that the step engine owns.

Hugging Face's ``DynamicCache`` grows by ``torch.cat`` at every step, which copies
the whole cache once per token and per block; for token-by-token recurrent runs
over long windows that copy dominates. This cache allocates each block's
``[batch, kv_heads, max_len, head_dim]`` buffers once and writes in place.

It speaks the one method the attention modules call (``update``, the
``transformers.Cache`` protocol that TransformerLens' bridge and HF's Llama
attention both use) plus the one operation recurrences need: ``truncate`` a range
of blocks back to a length, so that a second pass over a position *replaces* that
position's keys/values instead of appending next to them (SEMANTICS.md,
Recirculation step 3).
"""

from __future__ import annotations

from torch import Tensor


class KVCache:
    """Per-block key/value buffers with an independent fill length per block.

    Args:
        n_blocks: number of transformer blocks (one buffer pair each).
        max_len: the longest sequence the run will reach; buffers are sized once.
    """

    is_compileable = False

    def __init__(self, n_blocks: int, max_len: int) -> None:
        self.n_blocks = n_blocks
        self.max_len = max_len
        self.keys: list[Tensor | None] = [None] * n_blocks
        self.values: list[Tensor | None] = [None] * n_blocks
        self.lengths = [0] * n_blocks

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args, **kwargs):
        """Append ``key``/``value`` ``[batch, kv_heads, q, head_dim]`` at the block's fill
        length and return every cached entry of that block, the new ones included."""
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
        self.keys[layer_idx][:, :, start:stop] = key
        self.values[layer_idx][:, :, start:stop] = value
        self.lengths[layer_idx] = stop
        return self.keys[layer_idx][:, :, :stop], self.values[layer_idx][:, :, :stop]

    def truncate(self, blocks: range, length: int) -> None:
        """Forget positions ``>= length`` in ``blocks`` (their next ``update`` overwrites)."""
        for b in blocks:
            if self.lengths[b] < length:
                raise RuntimeError(f"cannot truncate block {b} from {self.lengths[b]} to {length}")
            self.lengths[b] = length

    def copy(self, length: int | None = None, max_len: int | None = None) -> KVCache:
        """An independent cache holding this one's positions ``< length`` (default: all)."""
        new = KVCache(self.n_blocks, max_len or self.max_len)
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
