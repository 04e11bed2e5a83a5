"""Tiny random models of several families, built locally in a fraction of a second.

``load_model("tiny")`` (alias ``"tiny-llama"``) is a 4-block Llama; ``"tiny-<family>"``
gives the same size in another family the engine runs, ``"tiny-<family>-<n_blocks>"``
another depth. They exist for tests and for trying a command end to end: their weights
are random (seeded), so their numbers mean nothing about real models.

Every family shares the residual width 64, 4 heads (2 KV heads where the family has
grouped-query attention), MLP width 128, a context of 512 and tied embeddings, and the
initialiser scale 0.1 (Hugging Face's 0.02 leaves the blocks' writes tiny next to the
embedding and the logits nearly flat; 0.1 gives every block a visible effect).
The Gemma 3 model keeps Gemma's structure at this size: Peri-LN blocks, q/k norms,
sliding-window blocks (window 4, so that sliding matters at short lengths) with every
third block global, and the two RoPE bases.
"""

from __future__ import annotations

import torch
import transformers

FAMILIES = ("llama", "gemma3", "qwen3", "gpt2", "phi3", "olmo2")

_SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)
_ALL = dict(tie_word_embeddings=True, initializer_range=0.1, attn_implementation="eager")
# family -> (config class, model class, config arguments); the depth is added per call.
_SPECS: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {**_SIZES, "rms_norm_eps": 1e-5}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               {**_SIZES, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 4}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**_SIZES, "head_dim": 16}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(n_embd=64, n_inner=128, n_head=4, n_positions=512)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {**_SIZES, "original_max_position_embeddings": 512}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(_SIZES)),
}


def _depth(family: str, n: int) -> dict:
    if family == "gpt2":
        return {"n_layer": n}
    if family == "gemma3":  # every third block global, the others sliding
        types = ["full_attention" if (b + 1) % 3 == 0 else "sliding_attention" for b in range(n)]
        return {"num_hidden_layers": n, "layer_types": types}
    return {"num_hidden_layers": n}


def build_tiny(family: str, n_blocks: int, vocab_size: int, eot: int, seed: int,
               dtype: torch.dtype) -> transformers.PreTrainedModel:
    """A random ``family`` model with ``n_blocks`` blocks; ``eot`` is BOS, EOS and pad."""
    config_name, model_name, arguments = _SPECS[family]
    config = getattr(transformers, config_name)(
        **arguments, **_depth(family, n_blocks), **_ALL, vocab_size=vocab_size,
        bos_token_id=eot, eos_token_id=eot, pad_token_id=eot)
    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
        torch.manual_seed(seed)
        model = getattr(transformers, model_name)(config)
    model.config.architectures = [type(model).__name__]
    return model.to(dtype)
