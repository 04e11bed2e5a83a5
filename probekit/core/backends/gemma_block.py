"""A Gemma 3 decoder block in plain torch: the engine's fast path when no hook is attached.

The same role as :mod:`probekit.core.backends.llama_block` (same weights, shared not
copied; tests pin it to the TransformerLens bridge and to Hugging Face). Gemma 3 is a
Peri-LN block: every sublayer is normalised both before and after, and the residual
stream itself is never normalised until the final norm::

    a = o_proj(attention(rope(q_norm(q_proj(n1(x)))), rope(k_norm(k_proj(n1(x)))), ...))
    x = x + n2(a)                                    # n1 input_layernorm, n2 post_attention
    x = x + n4(down_proj(gelu_tanh(gate_proj(n3(x))) * up_proj(n3(x))))
                                                     # n3 pre_feedforward, n4 post_feedforward

with every norm an RMSNorm in Gemma's ``(1 + weight)`` form computed in float32
(HF ``Gemma3RMSNorm``), q/k norms over each head's ``head_dim``, attention scaled by
``query_pre_attn_scalar ** -0.5``, optional attention-logit soft-capping (Gemma 2;
``None`` in Gemma 3), and, in sliding blocks, a window: the KV cache hands over only
the keys the chunk can see and supplies the band mask (:mod:`probekit.core.kv_cache`).
The rotary tables differ per block type (base 10,000 for sliding blocks, 1,000,000 for
global ones in Gemma 3 270M); the backend passes each block its own. The embedding's
``sqrt(d_model)`` scale and the final norm live outside the blocks (the backend's
``embed`` and ``unembed``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from probekit.core.backends.llama_block import (
    LlamaBlockWeights,
    _linear,
    _rotate_half,
    _unwrap,
    causal_mask,
)


@dataclass(frozen=True)
class GemmaBlockWeights:
    """A Llama block's projections and pre-norms (``core.ln1`` = ``input_layernorm``,
    ``core.ln2`` = ``pre_feedforward_layernorm``) plus what Gemma adds."""

    core: LlamaBlockWeights
    ln_attn_out: Tensor
    ln_mlp_out: Tensor
    q_norm: Tensor
    k_norm: Tensor
    softcap: float | None


def block_weights(block, config) -> GemmaBlockWeights | None:
    """The weights of a bridged Gemma 3 block, or None if it is not one (the backend
    then keeps using the bridge)."""
    layer = _unwrap(block)
    if (type(layer).__name__ != "Gemma3DecoderLayer"
            or getattr(config, "hidden_activation", None) != "gelu_pytorch_tanh"
            or getattr(config, "use_bidirectional_attention", False)):
        return None
    attn, mlp = _unwrap(layer.self_attn), _unwrap(layer.mlp)
    projections = {n: _linear(getattr(attn, f"{n}_proj")) for n in ("q", "k", "v", "o")}
    projections |= {n: _linear(getattr(mlp, f"{n}_proj")) for n in ("gate", "up", "down")}
    ln_in, ln_ff = _unwrap(layer.input_layernorm), _unwrap(layer.pre_feedforward_layernorm)
    core = LlamaBlockWeights(
        ln1=ln_in.weight, ln2=ln_ff.weight, eps=config.rms_norm_eps, **projections,
        n_heads=config.num_attention_heads, n_kv_heads=config.num_key_value_heads,
        head_dim=attn.head_dim, scaling=attn.scaling)
    return GemmaBlockWeights(
        core=core,
        ln_attn_out=_unwrap(layer.post_attention_layernorm).weight,
        ln_mlp_out=_unwrap(layer.post_feedforward_layernorm).weight,
        q_norm=_unwrap(attn.q_norm).weight,
        k_norm=_unwrap(attn.k_norm).weight,
        softcap=getattr(attn, "attn_logit_softcapping", None),
    )


def gemma_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF ``Gemma3RMSNorm``: normalise and scale by ``1 + weight`` in float32, cast back."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


def _attend(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
            w: GemmaBlockWeights) -> Tensor:
    c = w.core
    if w.softcap is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=c.scaling,
                                              enable_gqa=c.n_heads != c.n_kv_heads)
    # Soft-capped logits (Gemma 2): tanh between the scores and the softmax, so eager.
    group = c.n_heads // c.n_kv_heads
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scores = query @ key.transpose(-1, -2) * c.scaling
    scores = torch.tanh(scores / w.softcap) * w.softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype) @ value


def gemma_block(x: Tensor, w: GemmaBlockWeights, cos: Tensor, sin: Tensor, cache, layer: int
                ) -> Tensor:
    """One block on ``x [batch, pos, d_model]``; appends keys/values to ``cache``."""
    b, q, _ = x.shape
    c = w.core
    mask = cache.attention_mask(layer, q)  # the sliding band, if this chunk needs one
    h = gemma_rms_norm(x, c.ln1, c.eps)
    query = F.linear(h, *c.q).view(b, q, c.n_heads, c.head_dim).transpose(1, 2)
    key = F.linear(h, *c.k).view(b, q, c.n_kv_heads, c.head_dim).transpose(1, 2)
    value = F.linear(h, *c.v).view(b, q, c.n_kv_heads, c.head_dim).transpose(1, 2)
    query = gemma_rms_norm(query, w.q_norm, c.eps)
    key = gemma_rms_norm(key, w.k_norm, c.eps)
    cs, sn = cos.unsqueeze(1), sin.unsqueeze(1)
    query = query * cs + _rotate_half(query) * sn
    key = key * cs + _rotate_half(key) * sn
    key, value = cache.update(key, value, layer)
    if mask is None:
        mask = causal_mask(q, key.shape[2])
    attn = _attend(query, key, value, mask, w)
    x = x + gemma_rms_norm(F.linear(attn.transpose(1, 2).reshape(b, q, -1), *c.o),
                           w.ln_attn_out, c.eps)
    h = gemma_rms_norm(x, c.ln2, c.eps)
    h = F.gelu(F.linear(h, *c.gate), approximate="tanh") * F.linear(h, *c.up)
    return x + gemma_rms_norm(F.linear(h, *c.down), w.ln_mlp_out, c.eps)
