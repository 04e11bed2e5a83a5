"""TransformerLens 4.x backend: blocks run through ``TransformerBridge`` hook points.

``TransformerBridge.boot_transformers(name, hf_model=..., tokenizer=...)`` wraps the
Hugging Face model *in place* (its submodules become bridge components and its
attention switches to eager), so after booting, the HF model and the bridge are the
same computation and every hook point fires whether the engine or HF drives it.

The bridge's attention appends to whatever object is passed as ``past_key_values``
through its ``update(k, v, layer_idx)`` method, and with ``attention_mask=None`` it
builds the rectangular causal mask ``query i -> keys 0 .. cached + i`` itself, which is
exactly what a right-padded chunk on a cache needs.

Position data is per block (``prepare_positions`` computes it once per chunk):
rotary ``(cos, sin)`` tables, one per layer type where the model has several (Gemma 3:
``sliding_attention`` and ``full_attention`` with different RoPE bases, which is why its
rotary module takes a ``layer_type``); a learned absolute position embedding (GPT-2's
``wpe``), added to the residual as block 0 starts so that ``embed`` stays a function of
the tokens alone (residual depth 0 is then the token embedding; Hugging Face's
``hidden_states[0]`` includes the position embedding). Sliding-window blocks get the
window from the cache (``KVCache.set_window``) and, for a chunk of several positions,
its band mask.

Any decoder-only architecture TransformerLens 4.3 bridges runs here (docs/models.md
lists the tested ones). Fast path: when no hook is attached anywhere on the bridge
(checked when a run starts), the families that have a plain-torch block run it on the
same weights (:mod:`.llama_block`, :mod:`.gemma_block`), which skips the bridge's
per-hook-point Python; with any hook attached, every block goes through the bridge so
all hook points fire. ``fast=False`` disables it.

Trap (DESIGN.md): transformers 5.24 renamed the attention keyword
``past_key_values`` to ``cache`` and the TL 4.3 bridge then silently never fills the
cache; ``pyproject.toml`` pins ``transformers<5.24`` and
``tests/test_engine.py::test_cached_decoding_equals_full_forward`` guards it.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from probekit.core import architecture
from probekit.core.backends import gemma_block as gemma
from probekit.core.backends import llama_block as llama
from probekit.core.backends.base import Backend
from probekit.core.backends.gemma_block import gemma_block
from probekit.core.backends.llama_block import llama_block
from probekit.core.kv_cache import KVCache


@dataclass(frozen=True)
class Positions:
    """One chunk's position data, shared by every block of every pass.

    Attributes:
        rotary: layer type (None for a single table) -> ``(cos, sin)``; empty if no RoPE.
        absolute: learned absolute position embedding ``[pos, d_model]`` or None.
    """

    rotary: dict[str | None, tuple[Tensor, Tensor]]
    absolute: Tensor | None


def _fast_block(block, config) -> tuple[str, Any] | None:
    """``(family, weights)`` of ``block``'s plain-torch version if its family has one."""
    family = type(llama._unwrap(block)).__name__
    if family == "LlamaDecoderLayer" and (w := llama.block_weights(block, config)):
        return "llama", w
    if (w := gemma.block_weights(block, config)) is not None:
        return "gemma", w
    return None


class LensBackend(Backend):
    name = "lens"

    def __init__(self, model, fast: bool = True) -> None:
        from transformer_lens.model_bridge import TransformerBridge

        # boot logs alias deprecations and config notes at WARNING; they are noise here.
        logging.getLogger("transformer_lens").setLevel(logging.ERROR)
        hf = model.hf_model
        bridge = getattr(hf, "_probekit_bridge", None)
        if bridge is None:
            try:
                bridge = TransformerBridge.boot_transformers(
                    model.name, hf_model=hf, tokenizer=model.tokenizer
                )
            except Exception as e:
                raise ValueError(
                    f"TransformerLens {_tl_version()} cannot bridge {type(hf).__name__} "
                    f"(model_type {getattr(hf.config, 'model_type', '?')!r}): "
                    f"{str(e).splitlines()[0][:200]}") from e
            bridge.eval()
            # One bridge per HF model: booting twice would wrap wrappers.
            object.__setattr__(hf, "_probekit_bridge", bridge)
        self.bridge = bridge
        cfg = hf.config
        self.config = cfg
        self.n_blocks = cfg.num_hidden_layers
        self.d_model = cfg.hidden_size
        self.n_ctx = cfg.max_position_embeddings
        self.vocab_size = cfg.vocab_size
        self._blocks = list(bridge.blocks)
        self._windows = architecture.sliding_windows(hf)
        self._types = architecture.layer_types(hf)
        self._softcap = getattr(cfg, "final_logit_softcapping", None)
        self._rotary_cache: dict[str | None, tuple[Tensor, Tensor]] = {}
        rotary = getattr(bridge, "rotary_emb", None)
        self._rotary_module = rotary
        per_type = rotary is not None and "layer_type" in inspect.signature(
            rotary.original_component.forward).parameters
        self._rotary_types: list[str | None] = (
            sorted({t for t in self._types if t is not None}) if per_type else [None])
        fast = [_fast_block(b, cfg) for b in self._blocks] if fast else []
        self._fast = fast if fast and all(f is not None for f in fast) else None
        self._use_fast = False

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.bridge.embed(input_ids)

    def prepare_positions(self, positions: Tensor) -> Positions:
        rotary = {}
        if self._rotary_module is not None:
            top = int(positions.max()) + 1
            for t in self._rotary_types:
                cos, sin = self._rotary(t, top)
                rotary[t] = (cos[:, positions], sin[:, positions])
        pos_embed = getattr(self.bridge, "pos_embed", None)
        absolute = pos_embed(positions[None])[0] if pos_embed is not None else None
        return Positions(rotary, absolute)

    def _rotary(self, layer_type: str | None, n: int) -> tuple[Tensor, Tensor]:
        """cos/sin for positions ``0 .. >= n-1`` (grown by doubling, capped at n_ctx).
        Each entry depends on its own position only, so the table's length does not
        change its values."""
        have = self._rotary_cache.get(layer_type)
        if have is None or have[0].shape[1] < n:
            size = min(max(n, 2 * (have[0].shape[1] if have else 256)), max(self.n_ctx, n))
            p = self.bridge.ln_final.original_component.weight
            dummy = torch.zeros(1, 1, self.d_model, dtype=p.dtype, device=p.device)
            ids = torch.arange(size, device=p.device)[None]
            extra = {} if layer_type is None else {"layer_type": layer_type}
            with torch.no_grad():
                self._rotary_cache[layer_type] = self._rotary_module(dummy, ids, **extra)
        return self._rotary_cache[layer_type]

    def _block_rotary(self, block: int, pos: Positions) -> tuple[Tensor, Tensor] | None:
        if not pos.rotary:
            return None
        return pos.rotary[self._types[block] if None not in pos.rotary else None]

    def run_block(self, block: int, resid: Tensor, pos: Positions, cache: KVCache) -> Tensor:
        if block == 0 and pos.absolute is not None:
            resid = resid + pos.absolute.to(resid.dtype)
        if cache.windows[block] != self._windows[block]:
            cache.set_window(block, self._windows[block])
        rotary = self._block_rotary(block, pos)
        if self._use_fast:
            family, weights = self._fast[block]
            run = llama_block if family == "llama" else gemma_block  # looked up per call
            return run(resid, weights, *rotary, cache, block)
        kwargs = {} if rotary is None else {"position_embeddings": rotary}
        band = cache.attention_mask(block, resid.shape[1])
        mask = None
        if band is not None:  # additive [1, 1, q, kv]: the bridge takes a 4-D mask as is
            mask = torch.zeros(band.shape, dtype=resid.dtype).masked_fill(
                ~band, torch.finfo(resid.dtype).min)[None, None]
        out = self._blocks[block](
            resid, attention_mask=mask, past_key_values=cache, use_cache=True, **kwargs,
        )
        return out[0] if isinstance(out, tuple) else out

    def unembed(self, resid: Tensor) -> Tensor:
        logits = self.bridge.unembed(self.bridge.ln_final(resid))
        if self._softcap:  # Gemma 2's final soft-capping (None in Gemma 3)
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    @contextmanager
    def hooks(self, fwd_hooks: Iterable[tuple[Any, Callable]]):
        fwd_hooks = list(fwd_hooks)
        for name, _ in fwd_hooks:
            if isinstance(name, str) and name not in self.bridge.hook_dict:
                raise ValueError(
                    f"unknown hook {name!r}: TransformerLens names look like "
                    f"blocks.{{b}}.hook_resid_post with b in 0..{self.n_blocks - 1}")
        with self.bridge.hooks(fwd_hooks=fwd_hooks):
            self._use_fast = self._fast is not None and not self._any_hook()
            try:
                yield
            finally:
                self._use_fast = False

    def _any_hook(self) -> bool:
        """True if any hook (the user's or one left attached by hand) is on the bridge."""
        return any(hp._forward_hooks or hp._forward_pre_hooks or hp._backward_hooks
                   or hp._backward_pre_hooks for hp in self.bridge.hook_dict.values())


def _tl_version() -> str:
    from importlib.metadata import version

    return version("transformer-lens")
