"""The engine on every family it claims (docs/models.md): tiny random models built locally.

For each family (``load_model("tiny-<family>")``): the plain engine equals Hugging Face's
parallel forward (token by token, in chunks, in one chunk), recirculation equals the slow
reference on ragged batches with masks (fast path and, with a hook attached, the bridge
path), and the per-architecture module paths resolve.
"""

import pytest
import torch
import transformers
from engine_helpers import random_ids

from probekit.core import architecture
from probekit.core.backends.lens import LensBackend
from probekit.core.engine import StepEngine
from probekit.core.models import load_model
from probekit.core.tiny import FAMILIES
from probekit.mechanisms.latent_feedback import final_norm
from probekit.mechanisms.recirculation import Recirculation, RecirculationPath
from probekit.mechanisms.reference import reference_recirculation

ATOL = 2e-5
FAST = {"llama", "gemma3"}  # families with a plain-torch block (docs/models.md)
LENGTHS = [9, 5, 7]
CASES = [
    dict(source=3, destination=1, alpha=0.4),
    dict(paths=[RecirculationPath(3, 2, 0.3, 1.0), RecirculationPath(2, 0, 0.2)],
         iterations=2, ramp=3, norm="none"),
]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    model = load_model(f"tiny-{request.param}", seed=1)
    return request.param, model, StepEngine(model)


def test_family_is_what_it_says(family):
    name, model, _ = family
    expected = {"llama": "Llama", "gemma3": "Gemma3", "qwen3": "Qwen3", "gpt2": "GPT2",
                "phi3": "Phi3", "olmo2": "Olmo2"}[name]
    assert type(model.hf_model).__name__.startswith(expected)
    assert model.n_blocks == 4 and model.d_model == 64


def test_layout_and_final_norm(family):
    _, model, _ = family
    parts = architecture.layout(model.hf_model)
    assert len(parts.layers) == model.n_blocks
    assert final_norm(model) is parts.final_norm
    with torch.no_grad():  # the final norm + unembedding of the top residual is HF's logits
        ids = random_ids(1, 5)
        out = model.hf_model(ids, output_hidden_states=True)
        top = out.hidden_states[-1]  # HF applies the final norm to the last entry
        assert torch.allclose(parts.unembed(top), out.logits, atol=ATOL)


@pytest.mark.parametrize("block_size", [1, 3, None])
def test_plain_engine_equals_hf_parallel_forward(family, block_size):
    _, model, engine = family
    ids = random_ids(2, 11, seed=2)
    with torch.no_grad():
        logits = model.hf_model(ids).logits
    out = engine.run(ids, block_size=block_size or ids.shape[1], return_logits=True)
    assert torch.allclose(out.logits, logits, atol=ATOL)


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("block_size", [1, 3])
def test_recirculation_equals_slow_reference(family, case, block_size):
    _, model, engine = family
    rec = Recirculation(**CASES[case])
    ids = random_ids(3, max(LENGTHS), seed=3 + case)
    rows = [ids[i, :n].tolist() for i, n in enumerate(LENGTHS)]
    mask = torch.rand(3, max(LENGTHS), generator=torch.Generator().manual_seed(case)) > 0.3
    fast = engine.run(rows, rec, mask=mask, block_size=block_size)
    hooked = engine.run(rows, rec, mask=mask, block_size=block_size,
                        fwd_hooks=[("blocks.1.hook_out", lambda x, hook=None: x)])
    for i, n in enumerate(LENGTHS):
        ref = reference_recirculation(model, rows[i], rec, mask=mask[i, :n].tolist(),
                                      block_size=block_size)
        assert torch.allclose(fast.sequence_log_probs(i), ref, atol=ATOL), i
        assert torch.allclose(hooked.sequence_log_probs(i), ref, atol=ATOL), i


def test_fast_path_exactly_where_documented(family):
    name, model, _ = family
    backend = LensBackend(model)  # the bridge is already booted: this only reads weights
    assert (backend._fast is not None) == (name in FAST)


def test_encoder_decoder_is_rejected():
    cfg = transformers.T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8,
                                vocab_size=257, decoder_start_token_id=0)
    with pytest.raises(ValueError, match="decoder-only causal LMs.*T5ForConditionalGeneration"):
        architecture.check_supported(transformers.T5ForConditionalGeneration(cfg))


def test_unknown_layout_is_rejected_on_load(tmp_path):
    """BART's causal LM keeps its blocks in model.decoder.layers: no layout, one line."""
    from probekit.core import models

    cfg = transformers.BartConfig(d_model=16, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=2, decoder_attention_heads=2,
                                  encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=257)
    transformers.BartForCausalLM(cfg).save_pretrained(tmp_path)
    models._byte_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="decoder-only causal LMs.*found BartForCausalLM"):
        load_model(str(tmp_path))


def test_unknown_tiny_family_is_an_unknown_name():
    with pytest.raises(ValueError, match="unknown model 'tiny-mamba'.*gemma3"):
        load_model("tiny-mamba")
