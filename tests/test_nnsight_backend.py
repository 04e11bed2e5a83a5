"""The nnsight backend (probekit.core.backends.nnsight) against the lens backend.

Parity: per-token log-probs equal the lens backend's for the plain model, three
recirculation configs, latent feedback and a user intervention written both ways
(a TransformerLens hook on the lens backend, an nnsight intervention here). Tiny random
Llamas in seconds; the same cases on SmolLM2-135M in a ``slow`` test.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import nnsight
import pytest
import torch

from probekit.analysis.capture import capture_final
from probekit.core.backends.lens import LensBackend
from probekit.core.backends.nnsight import TraceStep, intervention, nnsight_model, session
from probekit.core.engine import StepEngine
from probekit.core.kv_cache import KVCache
from probekit.core.models import load_model
from probekit.mechanisms.latent_feedback import FeedbackGate, prefill
from probekit.mechanisms.prefill import RecirculationMechanism
from probekit.mechanisms.recirculation import Recirculation, RecirculationPath, default_pair
from probekit.mechanisms.regimes import Regime

torch.set_num_threads(1)
TOL = 1e-5  # the parity bound on per-token log-probs


def random_ids(batch, seq, vocab, seed=0):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def nn_engine():
    # Its own copy of tiny-5 (seed 0, the same weights as conftest's tiny_model): the lens
    # backend wraps the shared one in place.
    return StepEngine(load_model("tiny-5", seed=0), backend="nnsight")


def scale_hook(engine, factor):
    """TransformerLens way: scale a block's output on the second pass only."""
    def hook(act, hook=None):
        if engine.state.pass_index == 1:
            return act * factor
    return hook


def scale_intervention(block, factor):
    """nnsight way: the same edit, on the envoy of the block, in the second-pass trace."""
    def fn(model, step: TraceStep):
        if step.pass_index == 1 and block in step.blocks:
            layer = model.model.layers[block]
            layer.output = layer.output * factor
    return fn


def cases(model, ids, *, nnsight_way):
    """name -> fn(engine) -> [batch, seq-1] log-probs; the same calls on both backends,
    except the intervention, written the backend's way when ``nnsight_way``."""
    L = model.n_blocks
    s, d = default_pair(L)
    mask = torch.ones(ids.shape, dtype=torch.bool)
    mask[0, ::3] = False
    two = [RecirculationPath(L - 1, 1, 0.2), RecirculationPath(s, 0, 0.3)]
    gate = FeedbackGate.for_model(model)

    def hooked(engine):  # zero-ablate block 1's output in the recurrent pass (d = 0)
        if nnsight_way:
            hooks = [intervention(scale_intervention(1, 0.0))]
        else:
            hooks = [("blocks.1.hook_resid_post", scale_hook(engine, 0.0))]
        return engine.run(ids, Recirculation(s, 0, 0.3), fwd_hooks=hooks).log_probs

    return {
        "plain": lambda e: e.run(ids).log_probs,
        "recirculation default pair": lambda e: e.run(ids, Recirculation(s, d, 0.1)).log_probs,
        "recirculation ramp/no norm, masked, K=3": lambda e: e.run(
            ids, Recirculation(s, d, 0.4, ramp=4, norm="none"), mask=mask,
            block_size=3).log_probs,
        "recirculation two paths, 2 iterations": lambda e: e.run(
            ids, Recirculation(paths=two, iterations=2)).log_probs,
        "latent feedback, full": lambda e: prefill(e, ids, gate, "full").log_probs,
        "intervention on pass 1": hooked,
    }


def max_deltas(lens_engine, nn_engine, ids):
    ref = cases(lens_engine.model, ids, nnsight_way=False)
    got = cases(nn_engine.model, ids, nnsight_way=True)
    return {name: float((ref[name](lens_engine) - got[name](nn_engine)).abs().nan_to_num()
                        .max()) for name in ref}


def test_log_probs_equal_the_lens_backend(tiny_engine, nn_engine):
    ids = random_ids(2, 12, 256, seed=1)
    deltas = max_deltas(tiny_engine, nn_engine, ids)
    assert all(v <= TOL for v in deltas.values()), deltas
    # ... and the intervention changed something (else its parity would prove nothing)
    plain = nn_engine.run(ids, Recirculation(default_pair(5)[0], 0, 0.3)).log_probs
    hooked = cases(nn_engine.model, ids, nnsight_way=True)["intervention on pass 1"](nn_engine)
    assert (plain - hooked).abs().nan_to_num().max() > 1e-3


def test_transformerlens_residual_hooks_work_on_nnsight(tiny_engine, nn_engine):
    ids = random_ids(2, 9, 256, seed=2)
    rec = Recirculation(3, 1, 0.3)
    lens, nn = (engine.run(ids, rec, fwd_hooks=[
        ("blocks.2.hook_resid_post", scale_hook(engine, 0.5)),
        (lambda name: name == "blocks.3.hook_resid_pre", scale_hook(engine, 2.0)),
    ]).log_probs for engine in (tiny_engine, nn_engine))
    assert (lens - nn).abs().max() <= TOL
    # capture (state tracking) fires hook_resid_pre/post on the pass it is asked for
    mech = RecirculationMechanism(3, 1, alpha=0.5)
    caps = [capture_final(e, mech, ids, Regime("full"), pass_index=1).resid
            for e in (tiny_engine, nn_engine)]
    assert (caps[0] - caps[1]).abs().max() <= TOL


def test_intervention_reads_any_pass_and_sees_the_pass_index(tiny_engine, nn_engine):
    """``.save()`` a block's input on pass 2 (the recirculated state of iteration 2) and
    compare it with the lens backend's hook_resid_pre on that pass."""
    ids = random_ids(1, 7, 256, seed=3)
    rec = Recirculation(4, 1, 0.5, iterations=2)
    saved, steps = [], []

    def read(model, step):
        steps.append((step.pass_index, nn_engine.state.pass_index, step.blocks.start))
        if step.pass_index == 2:
            saved.append(model.model.layers[2].input.save())

    nn_engine.run(ids, rec, fwd_hooks=[intervention(read)])
    lens_seen = []

    def hook(act, hook=None):
        if tiny_engine.state.pass_index == 2:
            lens_seen.append(act.clone())

    tiny_engine.run(ids, rec, fwd_hooks=[("blocks.2.hook_resid_pre", hook)])
    assert steps == [(0, 0, 0), (1, 1, 2), (2, 2, 2)] * 7
    assert len(saved) == len(lens_seen) == 7
    assert max((a - b).abs().max() for a, b in zip(saved, lens_seen)) <= TOL


def test_removing_the_recirculated_signal_recovers_the_plain_model(tiny_engine, nn_engine):
    """Both ways: on pass 1, give block d+1 the first-pass z_d instead of the mixed z'_d.
    Every recurrent pass then recomputes its first pass, so the run is the plain model."""
    ids = random_ids(2, 9, 256, seed=8)
    s, d = 4, 1
    rec = Recirculation(s, d, 0.5)
    first_nn, first_lens = {}, {}

    def remove(model, step):  # the nnsight way
        t = int(step.positions[0])
        if step.pass_index == 0:
            first_nn[t] = model.model.layers[d].output.save()
        elif step.pass_index == 1:
            model.model.layers[d + 1].input = first_nn[t]

    def keep(act, hook=None):  # the TransformerLens way: two hooks
        if tiny_engine.state.pass_index == 0:
            first_lens[int(tiny_engine.state.positions[0])] = act

    def swap(act, hook=None):
        if tiny_engine.state.pass_index == 1:
            return first_lens[int(tiny_engine.state.positions[0])]

    nn = nn_engine.run(ids, rec, fwd_hooks=[intervention(remove)]).log_probs
    lens = tiny_engine.run(ids, rec, fwd_hooks=[(f"blocks.{d}.hook_resid_post", keep),
                                                (f"blocks.{d + 1}.hook_resid_pre", swap)])
    plain = nn_engine.run(ids).log_probs
    assert torch.equal(nn, plain)
    assert (lens.log_probs - nn).abs().max() <= TOL
    assert (nn_engine.run(ids, rec).log_probs - plain).abs().max() > 1e-3


def test_session_form_equals_the_step_by_step_form(nn_engine):
    ids = random_ids(2, 8, 256, seed=4)
    rec = Recirculation(3, 1, 0.3)
    hooks = [intervention(scale_intervention(2, 0.5))]
    step_by_step = nn_engine.run(ids, rec, fwd_hooks=hooks).log_probs
    with session(nn_engine):
        one = nnsight.save(nn_engine.run(ids, rec, fwd_hooks=hooks))
    assert torch.equal(one.log_probs, step_by_step)
    # nnsight's remote path, simulated here: the session is serialized (probekit by
    # value, the model's modules by reference: no weights travel) and run from the copy
    import cloudpickle

    import probekit

    try:
        with session(nn_engine, remote="local"):
            sent = nnsight.save(nn_engine.run(ids, rec, fwd_hooks=hooks))
    finally:
        cloudpickle.unregister_pickle_by_value(probekit)
    assert torch.equal(sent.log_probs, step_by_step)


def test_bad_hooks_and_models_fail_clearly(tiny_model, tiny_engine, nn_engine):
    ids = random_ids(1, 4, 256)
    with pytest.raises(ValueError, match=r"takes the hooks blocks.\{b\}.hook_resid_pre/post"):
        nn_engine.run(ids, fwd_hooks=[("blocks.0.attn.hook_pattern", lambda a, hook: a)])
    with pytest.raises(ValueError, match=r"b < 5.*'blocks.7.hook_resid_post'"):
        nn_engine.run(ids, fwd_hooks=[("blocks.7.hook_resid_post", lambda a, hook: a)])
    with pytest.raises(ValueError, match="must be \\(name, fn\\) pairs"):
        nn_engine.run(ids, fwd_hooks=[lambda model, step: None])

    def out_of_range(model, step):
        model.model.layers[4].output[:] = 0

    with pytest.raises(RuntimeError, match=r"never reached .* runs blocks 0..1 \(step.blocks\)"):
        with nn_engine.hooks([intervention(out_of_range)]):
            nn_engine.run_blocks(0, 2, nn_engine.embed(ids), torch.arange(4), KVCache(5, 4))
    with pytest.raises(ValueError, match="booted by the lens backend"):
        StepEngine(tiny_model, backend="nnsight")  # tiny_engine (lens) wrapped it
    with pytest.raises(ValueError, match="runs the 'lens' backend"):
        nnsight_model(tiny_engine)


def test_public_operations_match(tiny_model, tiny_engine, nn_engine):
    """embed, unembed (any leading shape), run_blocks and rerun_position."""
    ids = random_ids(2, 6, 256, seed=5)
    assert torch.equal(nn_engine.embed(ids), tiny_engine.embed(ids))
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(0))
    assert (nn_engine.unembed(x) - tiny_engine.unembed(x)).abs().max() <= TOL
    assert nn_engine.unembed(x[0]).shape == (3, 257)
    bridge = StepEngine(tiny_model, LensBackend(tiny_model, fast=False))
    out = []
    for engine in (bridge, nn_engine):
        cache = KVCache(5, 6)
        top, cap = engine.run_blocks(0, 5, engine.embed(ids), torch.arange(6), cache,
                                     capture=(1, 3))
        again, _ = engine.rerun_position(cache.copy(5), 5, cap[1][:, 5], start=2)
        out.append((top, cap[3], again, cache.block_kv(4)[0]))
    for a, b in zip(*out):
        assert torch.equal(a, b)  # the same eager computation as TransformerLens' bridge


@pytest.mark.slow
def test_smollm2_log_probs_equal_the_lens_backend(default_model):
    """SmolLM2-135M, against the lens backend computing through TransformerLens'
    bridge (``fast=False``; what it does whenever a hook is attached). Its no-hook fast
    path (plain-torch SDPA blocks) rounds differently from the bridge, and so from this
    backend, by what docs/nnsight.md records."""
    ids = random_ids(2, 24, default_model.tokenizer.vocab_size, seed=6)
    nn = StepEngine(load_model("smollm2-135m"), backend="nnsight")
    bridge = StepEngine(default_model, LensBackend(default_model, fast=False))
    deltas = max_deltas(bridge, nn, ids)
    assert all(v <= TOL for v in deltas.values()), deltas


@pytest.mark.parametrize("family", ["gemma3", "gpt2"])
def test_other_families_equal_their_own_forward(tiny_model, family):
    """The backend finds the blocks by module, not by a Llama path: a tiny random Gemma 3
    (sliding-window blocks, window 3 < 10 tokens) and GPT-2 (absolute positions added by
    the forward), token by token and in chunks, against Hugging Face's full forward."""
    from types import SimpleNamespace

    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, GPT2Config, GPT2LMHeadModel

    from probekit.core.scoring import score

    torch.manual_seed(0)
    if family == "gemma3":
        hf = Gemma3ForCausalLM(Gemma3TextConfig(
            vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=3,
            max_position_embeddings=64, attn_implementation="eager",
            layer_types=["sliding_attention"] * 2 + ["full_attention", "sliding_attention"]))
    else:
        hf = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=257,
                                        n_positions=64, bos_token_id=256, eos_token_id=256,
                                        attn_implementation="eager"))
    model = SimpleNamespace(hf_model=hf.eval(), tokenizer=tiny_model.tokenizer)
    engine = StepEngine(model, backend="nnsight")
    ids = random_ids(2, 10, 256, seed=7)
    with torch.no_grad():
        ref = score(hf(ids).logits, ids, torch.tensor([10, 10]))
    for block_size in (1, 4):
        assert (engine.run(ids, block_size=block_size).log_probs - ref).abs().max() <= TOL


def test_commands_take_backend_nnsight(tmp_path, capsys):
    """``--backend nnsight`` reaches the engine: perplexity's per-token log-probs match lens."""
    import numpy as np

    from probekit.commands.main import main

    args = ["perplexity", "--model", "tiny-5", "--source", "3", "--destination", "1",
            "--alpha", "0.3", "--windows", "2", "--window-tokens", "12", "--bootstrap", "20",
            "--threads", "1", "--no-progress"]
    lp = {}
    for backend in ("lens", "nnsight"):
        run_dir = tmp_path / backend
        assert main(args + ["--backend", backend, "--run-dir", str(run_dir)]) == 0
        lp[backend] = np.load(run_dir / "token_log_probs.npz")
    for key in ("base", "rec"):
        assert np.abs(lp["lens"][key] - lp["nnsight"][key]).max() <= TOL
    assert main(args + ["--backend", "tl"]) == 2
    assert "nnsight" in capsys.readouterr().err  # the choices are named
