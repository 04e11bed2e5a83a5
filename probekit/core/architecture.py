"""Where a decoder-only Hugging Face model keeps its parts, whatever its family.

Llama, Gemma, Qwen, Phi-3 and OLMo keep their blocks in ``model.model.layers`` and
the final norm in ``model.model.norm``; GPT-2 keeps them in ``model.transformer.h`` and
``model.transformer.ln_f``. Everything in probekit that reaches into a Hugging Face
model (the slow references, latent feedback's final norm, the backends' per-block
facts) asks :func:`layout` instead of spelling a path, so a new family needs at most
one more name here.

:func:`check_supported` is what the engine really needs of a model: decoder-only, a
list of blocks that each take and return the residual stream, a final norm and an
output embedding. Whether TransformerLens can bridge the family is checked when the
``lens`` backend boots (it names the family it could not bridge).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

# Attribute names tried in order on the base model (``hf_model.base_model``).
_LAYERS = ("layers", "h", "blocks")
_FINAL_NORM = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "final_norm")
_ATTENTION = ("self_attn", "attn", "attention", "self_attention")


@dataclass(frozen=True)
class Layout:
    """The parts of a decoder-only causal LM that probekit touches.

    Attributes:
        base: the body without the LM head (``model.model``, ``model.transformer``).
        layers: the decoder blocks, in order.
        final_norm: the norm applied to the top residual before the unembedding.
        embed: the token embedding (``get_input_embeddings()``).
        unembed: the output projection (``get_output_embeddings()``).
    """

    base: nn.Module
    layers: nn.ModuleList
    final_norm: nn.Module
    embed: nn.Module
    unembed: nn.Module


def _first(module: nn.Module, names: tuple[str, ...], kind: type) -> nn.Module | None:
    for name in names:
        found = getattr(module, name, None)
        if isinstance(found, kind):
            return found
    return None


def find_layout(hf_model: nn.Module) -> Layout | None:
    """The model's :class:`Layout`, or None if a part is missing."""
    base = getattr(hf_model, "base_model", None)
    if not isinstance(base, nn.Module) or base is hf_model:
        return None
    layers = _first(base, _LAYERS, nn.ModuleList)
    norm = _first(base, _FINAL_NORM, nn.Module)
    embed = hf_model.get_input_embeddings() if hasattr(hf_model, "get_input_embeddings") else None
    unembed = (hf_model.get_output_embeddings()
               if hasattr(hf_model, "get_output_embeddings") else None)
    if layers is None or norm is None or embed is None or unembed is None:
        return None
    return Layout(base, layers, norm, embed, unembed)


def layout(hf_model: nn.Module) -> Layout:
    """The model's :class:`Layout`; ValueError naming the model if a part is missing."""
    found = find_layout(hf_model)
    if found is None:
        raise ValueError(_unsupported(hf_model))
    return found


def check_supported(hf_model: nn.Module) -> None:
    """Raise ValueError (one line) unless the engine can run ``hf_model``: a decoder-only
    causal LM with a list of blocks, a final norm and an output embedding."""
    config = hf_model.config
    if getattr(config, "is_encoder_decoder", False) or find_layout(hf_model) is None:
        raise ValueError(_unsupported(hf_model))


def _unsupported(hf_model: nn.Module) -> str:
    model_type = getattr(hf_model.config, "model_type", "?")
    return (f"probekit runs decoder-only causal LMs with a list of blocks, a final norm and an "
            f"output embedding (Llama, Gemma 3, Qwen3, GPT-2, Phi-3, OLMo-2, ...; "
            f"docs/models.md); found {type(hf_model).__name__} (model_type {model_type!r})")


def attention(layer: nn.Module) -> nn.Module | None:
    """A block's attention module (``self_attn`` in most families, ``attn`` in GPT-2)."""
    return _first(layer, _ATTENTION, nn.Module)


def sliding_windows(hf_model: nn.Module) -> list[int | None]:
    """Per block, the sliding attention window (a block attends to the last ``w``
    positions, itself included) or None for global attention.

    Read off each attention module's ``sliding_window`` attribute, which Hugging Face
    sets only on the blocks that slide (Gemma 3: five local blocks per global one)."""
    out: list[int | None] = []
    for layer in layout(hf_model).layers:
        attn = attention(layer)
        window = getattr(attn, "sliding_window", None) if attn is not None else None
        out.append(int(window) if isinstance(window, int) and window > 0 else None)
    return out


def layer_types(hf_model: nn.Module) -> list[str | None]:
    """Per block, its ``config.layer_types`` entry (``"sliding_attention"`` /
    ``"full_attention"``), or None where the config has no layer types."""
    n = hf_model.config.num_hidden_layers
    types = getattr(hf_model.config, "layer_types", None)
    return list(types[:n]) if types else [None] * n
