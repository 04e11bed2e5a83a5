"""A Llama decoder block in plain torch: the engine's fast path when no hook is attached.

TransformerLens' bridge wraps every sub-module of a block in a Python component with
hook points (~40 per block). At batch 1 on a CPU that per-call Python costs a large
share of a decoding step (measured: ``benchmarks/bench_engine.py``). When no user hook
is attached anywhere on the bridge there is nothing to fire, so the backend runs this
function instead, on the SAME weight tensors (shared, not copied) the bridge wraps:

    x = x + o_proj(attention(rope(q_proj(rms1(x))), rope(k_proj(rms1(x))), v_proj(...)))
    x = x + down_proj(silu(gate_proj(rms2(x))) * up_proj(rms2(x)))

(HF ``LlamaDecoderLayer``/``LlamaAttention``/``LlamaMLP``/``LlamaRMSNorm``, eager maths
through ``scaled_dot_product_attention``). Tests pin it to the bridge's output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class LlamaBlockWeights:
    ln1: Tensor
    ln2: Tensor
    eps: float
    q: tuple[Tensor, Tensor | None]
    k: tuple[Tensor, Tensor | None]
    v: tuple[Tensor, Tensor | None]
    o: tuple[Tensor, Tensor | None]
    gate: tuple[Tensor, Tensor | None]
    up: tuple[Tensor, Tensor | None]
    down: tuple[Tensor, Tensor | None]
    n_heads: int
    n_kv_heads: int
    head_dim: int
    scaling: float


def _unwrap(module):
    """The Hugging Face module inside (possibly nested) bridge components."""
    while getattr(module, "original_component", None) is not None:
        module = module.original_component
    return module


def _linear(module) -> tuple[Tensor, Tensor | None]:
    m = _unwrap(module)
    return m.weight, m.bias


def block_weights(block, config) -> LlamaBlockWeights | None:
    """The weights of a bridged Llama block, or None if it is not a plain Llama block
    (then the backend keeps using the bridge)."""
    layer = _unwrap(block)
    attn, mlp = _unwrap(layer.self_attn), _unwrap(layer.mlp)
    if (type(layer).__name__ != "LlamaDecoderLayer" or config.hidden_act != "silu"
            or getattr(config, "rope_parameters", {}).get("llama_4_scaling_beta") is not None):
        return None
    return LlamaBlockWeights(
        ln1=_unwrap(layer.input_layernorm).weight,
        ln2=_unwrap(layer.post_attention_layernorm).weight,
        eps=config.rms_norm_eps,
        q=_linear(attn.q_proj), k=_linear(attn.k_proj), v=_linear(attn.v_proj),
        o=_linear(attn.o_proj),
        gate=_linear(mlp.gate_proj), up=_linear(mlp.up_proj), down=_linear(mlp.down_proj),
        n_heads=config.num_attention_heads,
        n_kv_heads=config.num_key_value_heads,
        head_dim=attn.head_dim,
        scaling=attn.scaling,
    )


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF ``LlamaRMSNorm``: normalise in float32, cast back, then scale."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def causal_mask(q_len: int, kv_len: int) -> Tensor | None:
    """``[q, kv]`` bool: query i (at absolute kv_len - q + i) sees keys 0 .. itself."""
    if q_len == 1:
        return None
    return torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)


def llama_block(x: Tensor, w: LlamaBlockWeights, cos: Tensor, sin: Tensor, cache, layer: int
                ) -> Tensor:
    """One block on ``x [batch, pos, d_model]``; appends keys/values to ``cache``."""
    b, q, _ = x.shape
    h = rms_norm(x, w.ln1, w.eps)
    query = F.linear(h, *w.q).view(b, q, w.n_heads, w.head_dim).transpose(1, 2)
    key = F.linear(h, *w.k).view(b, q, w.n_kv_heads, w.head_dim).transpose(1, 2)
    value = F.linear(h, *w.v).view(b, q, w.n_kv_heads, w.head_dim).transpose(1, 2)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    query = query * c + _rotate_half(query) * s
    key = key * c + _rotate_half(key) * s
    key, value = cache.update(key, value, layer)
    attn = F.scaled_dot_product_attention(
        query, key, value, attn_mask=causal_mask(q, key.shape[2]), scale=w.scaling,
        enable_gqa=w.n_heads != w.n_kv_heads,
    )
    x = x + F.linear(attn.transpose(1, 2).reshape(b, q, -1), *w.o)
    h = rms_norm(x, w.ln2, w.eps)
    return x + F.linear(F.silu(F.linear(h, *w.gate)) * F.linear(h, *w.up), *w.down)
