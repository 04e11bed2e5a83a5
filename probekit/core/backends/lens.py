"""TransformerLens 4.x backend: blocks run through ``TransformerBridge`` hook points.

``TransformerBridge.boot_transformers(name, hf_model=..., tokenizer=...)`` wraps the
Hugging Face model *in place* (its submodules become bridge components and its
attention switches to eager), so after booting, the HF model and the bridge are the
same computation and every hook point fires whether the engine or HF drives it.

The bridge's attention appends to whatever object is passed as ``past_key_values``
through its ``update(k, v, layer_idx)`` method, and with ``attention_mask=None`` it
builds the rectangular causal mask ``query i -> keys 0 .. cached + i`` itself, which is
exactly what a right-padded chunk on a cache needs.

Fast path: when no hook is attached anywhere on the bridge (checked when a run
starts), blocks run :func:`probekit.core.backends.llama_block.llama_block` on the same weights,
which skips the bridge's per-hook-point Python; with any hook attached, every block
goes through the bridge so all hook points fire. ``fast=False`` disables it.

Trap (DESIGN.md): transformers 5.24 renamed the attention keyword
``past_key_values`` to ``cache`` and the TL 4.3 bridge then silently never fills the
cache; ``pyproject.toml`` pins ``transformers<5.24`` and
``tests/test_engine.py::test_cached_decoding_equals_full_forward`` guards it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from probekit.core.backends.base import Backend
from probekit.core.backends.llama_block import block_weights, llama_block
from probekit.core.kv_cache import KVCache


class LensBackend(Backend):
    name = "lens"

    def __init__(self, model, fast: bool = True) -> None:
        from transformer_lens.model_bridge import TransformerBridge

        # boot logs alias deprecations and config notes at WARNING; they are noise here.
        logging.getLogger("transformer_lens").setLevel(logging.ERROR)
        bridge = getattr(model.hf_model, "_probekit_bridge", None)
        if bridge is None:
            bridge = TransformerBridge.boot_transformers(
                model.name, hf_model=model.hf_model, tokenizer=model.tokenizer
            )
            bridge.eval()
            # One bridge per HF model: booting twice would wrap wrappers.
            object.__setattr__(model.hf_model, "_probekit_bridge", bridge)
        self.bridge = bridge
        cfg = model.hf_model.config
        self.n_blocks = cfg.num_hidden_layers
        self.d_model = cfg.hidden_size
        self.n_ctx = cfg.max_position_embeddings
        self.vocab_size = cfg.vocab_size
        self._blocks = list(bridge.blocks)
        self._rotary_cache: tuple[Tensor, Tensor] | None = None
        weights = [block_weights(b, cfg) for b in self._blocks] if fast else []
        self._fast_weights = weights if weights and all(w is not None for w in weights) else None
        self._use_fast = False

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.bridge.embed(input_ids)

    def prepare_positions(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = self._rotary()
        return cos[:, positions], sin[:, positions]

    def _rotary(self) -> tuple[Tensor, Tensor]:
        # cos/sin for every position up to the context length, computed once.
        if self._rotary_cache is None:
            p = self.bridge.ln_final.original_component.weight
            dummy = torch.zeros(1, 1, self.d_model, dtype=p.dtype, device=p.device)
            ids = torch.arange(self.n_ctx, device=p.device)[None]
            with torch.no_grad():
                cos, sin = self.bridge.rotary_emb(dummy, ids)
            self._rotary_cache = (cos, sin)
        return self._rotary_cache

    def run_block(self, block: int, resid: Tensor, pos: Any, cache: KVCache) -> Tensor:
        if self._use_fast:
            return llama_block(resid, self._fast_weights[block], *pos, cache, block)
        out = self._blocks[block](
            resid, attention_mask=None, past_key_values=cache, use_cache=True,
            position_embeddings=pos,
        )
        return out[0] if isinstance(out, tuple) else out

    def unembed(self, resid: Tensor) -> Tensor:
        return self.bridge.unembed(self.bridge.ln_final(resid))

    @contextmanager
    def hooks(self, fwd_hooks: Iterable[tuple[Any, Callable]]):
        with self.bridge.hooks(fwd_hooks=list(fwd_hooks)):
            self._use_fast = self._fast_weights is not None and not self._any_hook()
            try:
                yield
            finally:
                self._use_fast = False

    def _any_hook(self) -> bool:
        """True if any hook (the user's or one left attached by hand) is on the bridge."""
        return any(hp._forward_hooks or hp._forward_pre_hooks or hp._backward_hooks
                   or hp._backward_pre_hooks for hp in self.bridge.hook_dict.values())
