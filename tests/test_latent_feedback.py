"""Latent feedback against SEMANTICS.md "Latent feedback" (probekit.mechanisms.latent_feedback,
probekit.mechanisms.generation, probekit.training). Tiny random Llamas; seconds in all."""

import dataclasses
import math
import os
from functools import partial

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import pytest
import torch

from probekit.core.engine import StepEngine
from probekit.core.models import load_model
from probekit.mechanisms.generation import generate, sample_next
from probekit.mechanisms.latent_feedback import (
    FeedbackGate,
    LatentFeedback,
    prefill,
    reference_latent_feedback,
)
from probekit.mechanisms.regimes import Regime, parse_regimes, plan
from probekit.training.checkpoint import load_checkpoint, save_checkpoint
from probekit.training.config import OrganismConfig, TrainConfig
from probekit.training.data import TrainData, pad_batch
from probekit.training.history import solved_at
from probekit.training.objective import (
    ahead_loss,
    answer_weights,
    evaluate,
    fixed_point_loss,
    full_recurrence_states,
    multipass_loss,
    token_loss,
)
from probekit.training.organism import new_organism
from probekit.training.train import ahead_head, train

torch.set_num_threads(1)
ATOL = 3e-5  # float32: cached, parallel and uncached paths sum in different orders


def random_ids(batch, seq, seed=0):
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def gate(tiny_model):
    # random init: W_U = W_G = I would make some checks weaker (more symmetric)
    return FeedbackGate.for_model(tiny_model, init="random", seed=1)


# ------------------------------------------------------------------------- gate
def test_gate_shapes_dtypes_and_init(tiny_model):
    g = FeedbackGate.for_model(tiny_model)
    D = tiny_model.d_model
    assert torch.equal(g.W_U.weight, torch.eye(D)) and torch.equal(g.W_G.weight, torch.eye(D))
    emb = tiny_model.hf_model.get_input_embeddings().weight
    assert torch.allclose(g.norm_u.weight, emb.pow(2).mean(0).sqrt())
    rng = torch.Generator().manual_seed(11)
    h, e = torch.randn(3, 7, D, generator=rng), torch.randn(3, 7, D, generator=rng)
    out = g(h, e)
    assert out.shape == (3, 7, D) and out.dtype == torch.float32
    # the output's RMS per position is the embedding's typical scale, whatever h's scale
    assert torch.allclose(g(100 * h, e), out, atol=1e-4)
    assert g(h[:, 0], e[:, 0]).shape == (3, D)  # [batch, D] works too
    assert g(h[:1], e).shape == (3, 7, D)  # broadcasting
    # computed in the gate's dtype, returned in the embeddings' dtype
    assert g(h, e.to(torch.bfloat16)).dtype == torch.bfloat16
    g16 = FeedbackGate(D).to(torch.bfloat16)
    assert g16(h, e).dtype == torch.float32 and g16.W_U.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="gate of d_model 64 got states of width 32"):
        g(torch.zeros(2, 32), torch.zeros(2, D))
    with pytest.raises(ValueError, match="init must be one of"):
        FeedbackGate(D, init="zeros")
    with pytest.raises(ValueError, match=r"output_scale must have shape \(64,\)"):
        FeedbackGate(D, output_scale=torch.ones(3))


def test_gate_formula(tiny_model):
    """Eq. 4 with App. C's norms, written out."""
    g = FeedbackGate.for_model(tiny_model, init="random", seed=3)
    rng = torch.Generator().manual_seed(12)
    h, e = torch.randn(5, 64, generator=rng), torch.randn(5, 64, generator=rng)

    def rms(x, w):
        return x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * w

    u = (h @ g.W_U.weight.T) * torch.sigmoid(rms(e, g.norm_e.weight) @ g.W_G.weight.T)
    assert torch.allclose(g(h, e), rms(u, g.norm_u.weight), atol=1e-5)


# --------------------------------------------------------------------- regimes
def test_full_equals_the_slow_reference(tiny_model, tiny_engine, gate):
    lengths = [11, 6, 9]
    ids = random_ids(3, 11, seed=1)
    rows = [ids[i, :n].tolist() for i, n in enumerate(lengths)]
    out = prefill(tiny_engine, rows, gate, "full", return_logits=True)
    for i, n in enumerate(lengths):
        ref = reference_latent_feedback(tiny_model, gate, rows[i])
        assert torch.allclose(out.logits[i, :n], ref, atol=ATOL), i
        assert torch.isnan(out.log_probs[i, n - 1:]).all()


def test_passes_T_equals_full_exactly(tiny_engine, gate):
    T = 10
    ids = random_ids(2, T, seed=2)
    full = prefill(tiny_engine, ids, gate, "full", return_logits=True)
    for n in (1, 2, 4, T - 1, T, T + 5):
        jac = prefill(tiny_engine, ids, gate, f"passes={n}", return_logits=True)
        # pass n is exact at positions 0 .. n-1 (Eqs. 9-11) ...
        exact = min(n, T)
        assert torch.allclose(jac.logits[:, :exact], full.logits[:, :exact], atol=ATOL), n
        # ... and not beyond (the random gate changes every later position)
        if n < T:
            assert (jac.logits[:, n:] - full.logits[:, n:]).abs().max() > 1e-3, n
        assert jac.extras["pass_index"] == exact - 1
    assert torch.allclose(jac.log_probs, full.log_probs, atol=ATOL)


def test_none_equals_the_plain_model(tiny_model, tiny_engine, gate):
    ids = random_ids(2, 12, seed=3)
    with torch.no_grad():
        ref = tiny_model.hf_model(ids).logits
    for g in (None, gate):
        out = prefill(tiny_engine, ids, g, "none", return_logits=True)
        assert torch.allclose(out.logits, ref, atol=ATOL)
    # passes=1 and feedback switched off everywhere are the plain model too
    assert torch.allclose(prefill(tiny_engine, ids, gate, "passes=1", return_logits=True).logits,
                          ref, atol=ATOL)
    off = tiny_engine.run(ids, LatentFeedback(gate, tiny_model), mask=torch.zeros(12, dtype=bool),
                          return_logits=True)
    assert torch.allclose(off.logits, ref, atol=ATOL)


def test_last_k_fuses_each_rows_own_suffix(tiny_model, tiny_engine, gate):
    lengths = [12, 7, 10]
    ids = random_ids(3, 12, seed=4)
    rows = [ids[i, :n].tolist() for i, n in enumerate(lengths)]
    for k in (1, 3):
        out = prefill(tiny_engine, rows, gate, f"last-{k}", return_logits=True)
        for i, n in enumerate(lengths):
            active = [t >= n - k for t in range(n)]
            ref = reference_latent_feedback(tiny_model, gate, rows[i], active=active)
            assert torch.allclose(out.logits[i, :n], ref, atol=ATOL), (k, i)
    # last-k with k >= T - 1 is full
    full = prefill(tiny_engine, ids[:1, :6], gate, "full", return_logits=True).logits
    assert torch.allclose(prefill(tiny_engine, ids[:1, :6], gate, "last-5",
                                  return_logits=True).logits, full, atol=ATOL)


def test_plan_of_last_k_costs_one_parallel_chunk_plus_k_steps(tiny_model, gate):
    p = plan(Regime.parse("last-2"), torch.tensor([9, 12]))
    assert p.block_size == [7] + [1] * 5  # shortest row 9: parallel 0..6, then one by one
    assert p.mask[0].tolist() == [False] * 7 + [True] * 2 + [False] * 3
    assert p.mask[1].tolist() == [False] * 10 + [True] * 2


def test_continuing_from_a_cache_with_the_carried_state(tiny_engine, tiny_model, gate):
    ids = random_ids(2, 12, seed=5)
    full = prefill(tiny_engine, ids, gate, "full", return_logits=True)
    head = LatentFeedback(gate, tiny_model)
    first = tiny_engine.run(ids[:, :7], head, return_cache=True)
    cache = first.cache.copy(max_len=12)
    tail = LatentFeedback(gate, tiny_model, initial_state=head.state)
    rest = tiny_engine.run(ids, tail, start=7, cache=cache, return_logits=True)
    assert torch.allclose(rest.logits[:, 7:], full.logits[:, 7:], atol=ATOL)
    with pytest.raises(ValueError, match="needs the state of position 6: pass initial_state="):
        tiny_engine.run(ids, LatentFeedback(gate, tiny_model), start=7,
                        cache=first.cache.copy(max_len=12))


def test_regime_parsing_and_errors(tiny_model, gate):
    assert Regime.parse("passes=4") == Regime("passes", passes=4)
    assert Regime.parse("last-3") == Regime("last-k", k=3)
    assert parse_regimes(["last-k"], ks=[2]) == [Regime("last-k", k=2)]
    assert str(Regime.parse(" FULL ")) == "full"
    with pytest.raises(ValueError, match=r"regime must be none, last-<k> \(e.g. last-2\), full "
                                         r"or passes=<n>"):
        Regime.parse("jacobi")
    with pytest.raises(ValueError, match="needs n >= 1"):
        Regime.parse("passes=0")
    with pytest.raises(ValueError, match=r"needs k >= 1 \(e.g. last-2\)"):
        Regime("last-k")
    with pytest.raises(ValueError, match="needs a feedback gate"):
        prefill(StepEngine(tiny_model), [[1, 2, 3, 4, 5]], None, Regime("full"))
    with pytest.raises(ValueError, match="passes must be an integer >= 1"):
        LatentFeedback(gate, tiny_model, passes=0)


def test_gate_for_another_width_is_rejected(tiny_model):
    with pytest.raises(ValueError, match="feedback gate has d_model 32 but model 'tiny-5' has "
                                         "d_model 64; use a gate trained for this model"):
        LatentFeedback(FeedbackGate(32), tiny_model)


def test_hooks_see_the_fused_input_at_depth_0(tiny_engine, tiny_model, gate):
    ids = random_ids(1, 6, seed=6)
    seen = {}

    def hook(act, hook=None):
        seen[(tiny_engine.state.pass_index, int(tiny_engine.state.positions[0]))] = act.clone()
        return act

    names = [("blocks.0.hook_resid_pre", hook)]
    prefill(tiny_engine, ids, gate, "full", fwd_hooks=names)
    e = tiny_model.hf_model.get_input_embeddings()(ids)
    assert torch.allclose(seen[(0, 0)][0, 0], e[0, 0])  # position 0: the plain embedding
    h = {}
    with torch.no_grad():
        out = tiny_model.hf_model.model(inputs_embeds=torch.cat(
            [seen[(0, t)] for t in range(6)], 1)).last_hidden_state
        for t in range(1, 6):
            h[t] = gate(out[:, t - 1], e[:, t])
    for t in range(1, 6):
        assert torch.allclose(seen[(0, t)][:, 0], h[t], atol=ATOL)


# ------------------------------------------------------------------ generation
def test_generation_regimes_match_references(tiny_model, tiny_engine, gate):
    hf = tiny_model.hf_model
    prompt = random_ids(2, 5, seed=7)
    n = 6
    std = generate(tiny_engine, prompt, regime="standard", max_new_tokens=n, eos=-1)
    soft = generate(tiny_engine, prompt, gate=gate, regime="soft", max_new_tokens=n, eos=-1)
    fused = generate(tiny_engine, prompt, gate=gate, regime="fused", max_new_tokens=n, eos=-1)
    for i in range(2):
        p = prompt[i].tolist()
        seq = p + std.tokens[i]
        with torch.no_grad():
            greedy = hf(torch.tensor([seq])).logits[0, 4:-1].argmax(-1).tolist()
        assert greedy == std.tokens[i]
        seq = p + soft.tokens[i]
        ref = reference_latent_feedback(tiny_model, gate, seq, active=[t >= 5 for t in range(11)])
        assert ref[4:-1].argmax(-1).tolist() == soft.tokens[i]
        assert _fused_reference(tiny_model, gate, p, n) == fused.tokens[i]
    assert soft.tokens != std.tokens  # the random gate does change what is generated


@torch.no_grad()
def _fused_reference(model, gate, prompt, n):
    """Prompt inputs from one fused Jacobi pass (Eq. 10), then soft decoding; no cache."""
    hf = model.hf_model
    ids = torch.tensor([prompt])
    e = hf.get_input_embeddings()(ids)
    h1 = hf.model(inputs_embeds=e).last_hidden_state
    inputs = [e[:, 0]] + [gate(h1[:, t - 1], e[:, t]) for t in range(1, len(prompt))]
    out = []
    for _ in range(n):
        h = hf.model(inputs_embeds=torch.stack(inputs, 1)).last_hidden_state[:, -1]
        tok = int(hf.lm_head(h).argmax(-1))
        out.append(tok)
        inputs.append(gate(h, hf.get_input_embeddings()(torch.tensor([tok]))))
    return out


def test_generation_stops_at_eos_and_samples_reproducibly(tiny_engine, gate):
    prompt = random_ids(1, 5, seed=8)
    first = generate(tiny_engine, prompt, max_new_tokens=4, eos=-1).tokens[0]
    stopped = generate(tiny_engine, prompt, max_new_tokens=4, eos=first[0])
    assert stopped.tokens == [[first[0]]] and stopped.finished == [True]
    a = generate(tiny_engine, prompt, gate=gate, regime="soft", max_new_tokens=5,
                 temperature=1.0, seed=4, eos=-1)
    b = generate(tiny_engine, prompt, gate=gate, regime="soft", max_new_tokens=5,
                 temperature=1.0, seed=4, eos=-1)
    assert a.tokens == b.tokens and a.finished == [False]
    with pytest.raises(ValueError, match="decoding regime 'soft' needs a feedback gate"):
        generate(tiny_engine, prompt, regime="soft")
    with pytest.raises(ValueError, match="prompts must all have the same length"):
        generate(tiny_engine, [[1, 2, 3], [4, 5]])
    with pytest.raises(ValueError, match=r"top_p must lie in \(0, 1\]"):
        generate(tiny_engine, prompt, top_p=0)


def test_nucleus_sampling_keeps_the_smallest_set():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    draws = {int(sample_next(logits, 1.0, 0.7, g)) for _ in range(200)}
    assert draws == {0, 1}  # 0.5 < 0.7 needs the second token; never a third
    assert {int(sample_next(logits, 1.0, 0.4, g)) for _ in range(50)} == {0}
    assert int(sample_next(logits, 0.0, 1.0)) == 0


# -------------------------------------------------------------------- training
def test_training_passes_equal_the_engine_jacobi_regime(tiny_model, tiny_engine, gate):
    ids = random_ids(2, 9, seed=9)
    valid = torch.ones(2, 8, dtype=torch.bool)
    with torch.no_grad():
        _, losses, logits = multipass_loss(tiny_model.hf_model, gate, ids, valid, 4,
                                           return_logits=True)
    for k in range(1, 5):
        eng = prefill(tiny_engine, ids, gate, f"passes={k}", return_logits=True)
        assert torch.allclose(logits[k - 1], eng.logits, atol=ATOL), k
        assert abs(losses[k - 1].item() + eng.log_probs.mean().item()) < 1e-4


def test_multipass_objective_is_eq_12_with_undetached_gradients(tiny_model, gate):
    ids = random_ids(2, 8, seed=10)
    valid = torch.ones(2, 7, dtype=torch.bool)
    total, losses, _ = multipass_loss(tiny_model.hf_model, gate, ids, valid, 3, lam=0.5)
    assert torch.allclose(total, losses[0] + 0.5 / 2 * (losses[1] + losses[2]))
    # pass 3's loss reaches W_U through pass 2's states too: the gradient from pass 3 alone
    # differs from the one with pass-2 states detached
    g_full = torch.autograd.grad(losses[2], gate.W_U.weight, retain_graph=True)[0]
    hf = tiny_model.hf_model
    e = hf.get_input_embeddings()(ids)
    x = e
    for _ in range(2):
        h = hf.model(inputs_embeds=x).last_hidden_state.detach()
        prev = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], 1)
        x = torch.cat([e[:, :1], gate(prev, e)[:, 1:]], 1)
    detached = token_loss(hf.lm_head(hf.model(inputs_embeds=x).last_hidden_state), ids, valid)
    assert torch.allclose(detached, losses[2], atol=1e-5)  # same value ...
    g_det = torch.autograd.grad(detached, gate.W_U.weight)[0]
    assert (g_full - g_det).abs().max() > 1e-6  # ... different gradient


def test_fixed_point_pass_reads_the_full_prefill_state(tiny_model, tiny_engine, gate):
    """The fixed-point objective's fed pass is the engine's ``full`` regime, its first the
    plain model, and its total Eq. 12 with K = 2."""
    ids = random_ids(2, 9, seed=11)
    valid = torch.ones(2, 8, dtype=torch.bool)
    total, losses, logits = fixed_point_loss(tiny_model.hf_model, gate, ids, valid, lam=0.5,
                                             return_logits=True)
    full = prefill(tiny_engine, ids, gate, "full", return_logits=True)
    none = prefill(tiny_engine, ids, gate, "none", return_logits=True)
    assert torch.allclose(logits[1], full.logits, atol=ATOL)
    assert torch.allclose(logits[0], none.logits, atol=ATOL)
    assert abs(losses[1].item() + full.log_probs.mean().item()) < 1e-4
    assert torch.allclose(total, losses[0] + 0.5 * losses[1])
    # Jacobi passes reach the same state only after T of them; two are not there yet
    with torch.no_grad():
        _, _, jac = multipass_loss(tiny_model.hf_model, gate, ids, valid, 2,
                                   return_logits=True)
    assert (jac[1] - full.logits).abs().max() > 1e-3


def test_fixed_point_gradient_is_one_step(tiny_model, gate):
    """No gradient flows through the full-recurrence state (Jacobian-free): the loss's
    gradient equals that of one pass fed the state as a constant."""
    hf = tiny_model.hf_model
    ids = random_ids(2, 8, seed=12)
    valid = torch.ones(2, 7, dtype=torch.bool)
    _, losses, _ = fixed_point_loss(hf, gate, ids, valid)
    g = torch.autograd.grad(losses[1], gate.W_U.weight)[0]
    e = hf.get_input_embeddings()(ids)
    h = full_recurrence_states(hf, gate, e)
    assert not h.requires_grad
    prev = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], 1)
    x = torch.cat([e[:, :1], gate(prev, e)[:, 1:]], 1)
    by_hand = token_loss(hf.lm_head(hf.model(inputs_embeds=x).last_hidden_state), ids, valid)
    assert torch.allclose(by_hand, losses[1], atol=1e-5)
    assert torch.allclose(torch.autograd.grad(by_hand, gate.W_U.weight)[0], g, atol=1e-6)
    assert g.abs().max() > 0


def test_answer_weights_weight_each_rows_last_target():
    valid = torch.tensor([[True, True, True], [True, False, False]])
    w = answer_weights(valid, 5.0)
    assert w.tolist() == [[1, 1, 5], [5, 0, 0]]
    assert torch.equal(answer_weights(valid, 1.0), valid.float())


def test_ahead_loss_predicts_two_tokens_ahead_with_their_weights(tiny_model):
    """The --ahead-loss head reads position t's normed top state and predicts the token at
    t + 2, weighted as that token is as a next-token target (a loop-by-hand reference)."""
    hf = tiny_model.hf_model
    ids = random_ids(2, 9, seed=13)
    valid = torch.rand(2, 8, generator=torch.Generator().manual_seed(1))
    valid[1, 5:] = 0  # padding: its targets weigh nothing
    head = torch.nn.Linear(tiny_model.d_model, hf.config.vocab_size, bias=False)
    normed = torch.randn(2, 9, tiny_model.d_model)
    num = den = 0.0
    for b in range(2):
        for t in range(7):  # position t predicts ids[t + 2], whose weight is valid[t + 1]
            logp = torch.log_softmax(head(normed[b, t]), -1)[ids[b, t + 2]]
            num, den = num - valid[b, t + 1] * logp, den + valid[b, t + 1]
    assert torch.allclose(ahead_loss(head, normed, ids, valid), num / den, atol=1e-6)


@pytest.mark.parametrize("objective", ["jacobi", "fixed-point"])
def test_ahead_loss_adds_to_eq_12_and_leaves_the_pass_losses(tiny_model, gate, objective,
                                                             monkeypatch):
    """total = Eq. 12 of the next-token losses + W x Eq. 12 of the ahead losses of each
    pass's normed top state; the per-pass losses returned (and logged) stay the
    next-token ones."""
    import probekit.training.objective as objective_module

    hf = tiny_model.hf_model
    ids = random_ids(2, 8, seed=14)
    valid = torch.ones(2, 7, dtype=torch.bool)
    head = ahead_head(hf, seed=0)
    run = (partial(multipass_loss, hf, gate, ids, valid, 3) if objective == "jacobi"
           else partial(fixed_point_loss, hf, gate, ids, valid))
    states, aheads = [], []

    def spy(head_, normed, ids_, valid_):
        states.append(normed)
        aheads.append(ahead_loss(head_, normed, ids_, valid_))
        return aheads[-1]

    monkeypatch.setattr(objective_module, "ahead_loss", spy)
    with torch.no_grad():
        plain_total, plain_losses, logits = run(lam=0.5, return_logits=True)
        assert not states  # no head, no ahead loss
        total, losses, _ = run(lam=0.5, ahead_head=head, ahead=2.0)
    assert all(torch.equal(a, b) for a, b in zip(losses, plain_losses, strict=True))
    assert len(states) == len(logits)  # one per pass, each that pass's normed top state
    for state, lg in zip(states, logits, strict=True):
        assert torch.allclose(hf.lm_head(state), lg, atol=1e-6)
    want = aheads[0] + 0.5 / (len(aheads) - 1) * sum(aheads[1:])
    assert torch.allclose(total - plain_total, 2.0 * want, atol=1e-5)


def test_ahead_loss_trains_resumes_exactly_and_saves_its_head(tmp_path):
    """An organism trained with --ahead-loss resumes to the same weights (the head's too,
    kept in model.safetensors beside the gate), and the head's loss falls."""
    from safetensors.torch import load_file

    kw = dict(mode="organism", batch_size=8, lr=1e-2, warmup=2, eval_every=0, save_every=3,
              answer_weight=1.0, feedback_start=2, fixed_point=0.3, ahead_loss=1.0)
    model, gate, data = _tiny_organism_and_data()
    train(model, gate, data, TrainConfig(steps=6, **kw), tmp_path / "a", progress=False)
    model_b, gate_b, _ = _tiny_organism_and_data()
    train(model_b, gate_b, data, TrainConfig(steps=3, **kw), tmp_path / "b", progress=False)
    model_c, gate_c, _ = _tiny_organism_and_data()  # fresh weights: resuming restores all
    train(model_c, gate_c, data, TrainConfig(steps=6, **kw), tmp_path / "b", progress=False)
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in "ab")
    assert set(a) == set(b) and "ahead.weight" in a
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    for x, y in zip(model.hf_model.parameters(), model_c.hf_model.parameters(), strict=True):
        assert torch.allclose(x, y, atol=1e-6)
    # the head learns: on these rows the label is two tokens after "state:"
    head = ahead_head(model.hf_model, seed=0)
    head.load_state_dict({"weight": a["ahead.weight"]})
    ids, valid = data.val[0]
    with torch.no_grad():
        normed = model.hf_model.model(input_ids=ids).last_hidden_state
        fresh = ahead_loss(ahead_head(model.hf_model, seed=0), normed, ids, valid)
        assert ahead_loss(head, normed, ids, valid) < fresh - 0.5


def test_resuming_with_ahead_loss_needs_the_head_in_the_checkpoint(tmp_path):
    """A checkpoint trained without --ahead-loss holds no head: resuming it with the loss
    is refused with one line naming the file, not a state-dict traceback."""
    kw = dict(mode="organism", batch_size=8, lr=1e-2, warmup=2, eval_every=0, save_every=2,
              answer_weight=1.0, feedback_start=2)
    model, gate, data = _tiny_organism_and_data()
    train(model, gate, data, TrainConfig(steps=2, **kw), tmp_path / "ck", progress=False)
    with pytest.raises(ValueError) as err:
        train(model, gate, data, TrainConfig(steps=4, ahead_loss=1.0, **kw), tmp_path / "ck",
              progress=False)
    assert str(err.value).startswith(
        f"{tmp_path / 'ck' / 'model.safetensors'} does not hold the --ahead-loss head "
        f"(Error(s) in loading state_dict for Linear:")
    assert str(err.value).endswith("; the checkpoint is damaged: restore it or train it again")
    assert "\n" not in str(err.value)


def _ema_kw(**kw):
    return {**dict(mode="organism", batch_size=8, lr=1e-2, warmup=2, lr_floor=1.0,
                   eval_every=0, save_every=5, answer_weight=1.0, feedback_start=4, fixed_point=0.3,
                   ahead_loss=1.0), **kw}


def test_ema_saves_the_average_of_the_weights_from_feedback_start_and_resumes_exactly(
        tmp_path, monkeypatch):
    """--ema D: the checkpoint's organism, gate and head are the exponential moving
    average of the weights after each step from --feedback-start on (the first such step
    starts it; then avg <- D avg + (1 - D) w), computed here from a plain run's weights
    step by step; the raw weights, kept in training.safetensors, are the plain run's
    (the average never feeds back into training); resuming restores both exactly."""
    from safetensors.torch import load_file

    import probekit.training.train as trainer

    seen = []  # the plain run's weights after every step (save_every=1)
    real_save = trainer.save_checkpoint

    def recording_save(folder, **kw):
        named = {f"gate.{k}": v for k, v in kw["gate"].state_dict().items()}
        named |= {f"model.{k}": v for k, v in kw["model"].hf_model.named_parameters()}
        named |= {f"ahead.{k}": v for k, v in kw["ahead"].state_dict().items()}
        seen.append((kw["step"], {k: v.detach().clone() for k, v in named.items()}))
        return real_save(folder, **kw)

    model, gate, data = _tiny_organism_and_data()
    monkeypatch.setattr(trainer, "save_checkpoint", recording_save)
    train(model, gate, data, TrainConfig(steps=10, **_ema_kw(save_every=1)),
          tmp_path / "plain", progress=False)
    monkeypatch.setattr(trainer, "save_checkpoint", real_save)
    weights = dict(seen)  # step -> weights after it
    want = dict(weights[5])  # step 5 is the first at or after --feedback-start (index 4)
    for step in range(6, 11):
        want = {k: 0.75 * v + 0.25 * weights[step][k] for k, v in want.items()}

    model_a, gate_a, _ = _tiny_organism_and_data()
    train(model_a, gate_a, data, TrainConfig(steps=10, **_ema_kw(ema=0.75)), tmp_path / "a",
          progress=False)
    model_b, gate_b, _ = _tiny_organism_and_data()  # stopped at step 5, resumed fresh
    train(model_b, gate_b, data, TrainConfig(steps=5, **_ema_kw(ema=0.75)), tmp_path / "b",
          progress=False)
    model_b, gate_b, _ = _tiny_organism_and_data()
    train(model_b, gate_b, data, TrainConfig(steps=10, **_ema_kw(ema=0.75)), tmp_path / "b",
          progress=False)
    for run in "ab":
        folder = tmp_path / run
        saved = {k: v for k, v in load_file(str(folder / "model.safetensors")).items()}
        saved |= {f"model.{k}": v for k, v in
                  load_file(str(folder / "organism" / "model.safetensors")).items()}
        raw = load_file(str(folder / "training.safetensors"))
        assert set(raw) == set(weights[10]) and set(want) <= set(saved)
        for k in want:
            assert torch.allclose(saved[k], want[k], atol=1e-6), (run, k)
            assert torch.allclose(raw[k], weights[10][k], atol=1e-6), (run, k)
        assert not torch.allclose(saved["gate.W_G.weight"], raw["gate.W_G.weight"], atol=1e-4)
    # the modules end with the average in them: what the checkpoint loads
    loaded = load_checkpoint(tmp_path / "a")
    for x, y in zip(loaded.model.hf_model.parameters(), model_a.hf_model.parameters(),
                    strict=True):
        assert torch.allclose(x, y, atol=1e-6)
    assert loaded.model.content_hash == model_a.content_hash


def test_ema_validates_the_average_and_starts_at_feedback_start(tmp_path):
    """Validation measures the weights the checkpoint saves: before --feedback-start the
    raw ones (no average yet, no training.safetensors), at the end the average."""
    model, gate, data = _tiny_organism_and_data()
    history = train(model, gate, data, TrainConfig(steps=3, **_ema_kw(ema=0.75)),
                    tmp_path / "early", progress=False)
    assert not (tmp_path / "early" / "training.safetensors").exists()
    plain = train(*_tiny_organism_and_data(), TrainConfig(steps=3, **_ema_kw()),
                  tmp_path / "plain", progress=False)
    assert history[-1]["val_pass_losses"] == plain[-1]["val_pass_losses"]
    model, gate, data = _tiny_organism_and_data()
    history = train(model, gate, data, TrainConfig(steps=10, **_ema_kw(ema=0.75)),
                    tmp_path / "ck", progress=False)
    loaded = load_checkpoint(tmp_path / "ck")
    again = evaluate(loaded.model.hf_model, loaded.gate, data.val, 3)["loss"]
    assert history[-1]["val_pass_losses"] == pytest.approx(again, abs=1e-6)


def test_resuming_with_another_ema_is_refused_before_training(tmp_path):
    """A checkpoint saves the average with --ema and the last weights without: resuming
    it with another --ema would mix the two, so it is refused in one line naming both."""
    model, gate, data = _tiny_organism_and_data()
    train(model, gate, data, TrainConfig(steps=5, **_ema_kw(ema=0.75)), tmp_path / "ck",
          progress=False)
    before = (tmp_path / "ck" / "config.json").read_text()
    for other in (0.0, 0.5):
        with pytest.raises(ValueError, match=(
                rf"^{tmp_path / 'ck'} was trained with --ema 0.75, not {other}: resume it "
                rf"with --ema 0.75, or train into another folder$")):
            train(model, gate, data, TrainConfig(steps=10, **_ema_kw(ema=other)),
                  tmp_path / "ck", progress=False)
    assert (tmp_path / "ck" / "config.json").read_text() == before


def _byte_data(seq=24, n=64, seed=0):
    """Text the tiny byte-level model can learn quickly: a repeated phrase."""
    text = ("the cat sat on the mat. " * 40).encode()
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(text) - seq, (n,), generator=g).tolist()
    rows = [list(text[s: s + seq]) for s in starts]
    return TrainData(rows[8:], [pad_batch(rows[:8], 0)], pad_id=0)


def test_training_the_gate_lowers_the_fused_loss(tiny_model, tmp_path):
    model = load_model("tiny-5", seed=0)  # a private copy: training must not touch the fixture
    gate = FeedbackGate.for_model(model)
    data = _byte_data()
    config = TrainConfig(mode="gate", steps=30, batch_size=8, lr=1e-2, warmup=0,
                         schedule=(0.0, 1.0), eval_every=30, save_every=30)
    before = evaluate(model.hf_model, gate, data.val, 2)["loss"]
    history = train(model, gate, data, config, tmp_path / "ck", progress=False)
    after = history[-1]["val_pass_losses"]
    assert after[0] == pytest.approx(before[0], abs=1e-6)  # frozen model: pass 1 unchanged
    assert after[1] < before[1] - 0.3, (before, after)
    assert all(not p.requires_grad for p in model.hf_model.parameters())


def _tiny_organism_and_data():
    """A 2-block organism, its gate and rows whose last word is a carried bit."""
    model = new_organism(OrganismConfig(n_blocks=2, d_model=32, n_heads=2, d_mlp=64), seed=0)
    tok = model.tokenizer
    texts = [f"state = {b}\nscratch = {s}\n# final state: {['zero', 'one'][b]}"
             for b in (0, 1) for s in range(10)]
    rows = tok(texts, add_special_tokens=False)["input_ids"]
    data = TrainData(rows, [pad_batch(rows, tok.pad_token_id)], tok.pad_token_id)
    return model, FeedbackGate.for_model(model), data


def test_training_an_organism_lowers_its_loss(tmp_path):
    model, gate, data = _tiny_organism_and_data()
    config = TrainConfig(mode="organism", steps=40, batch_size=8, lr=1e-2, warmup=5,
                         eval_every=40, save_every=40, answer_weight=1.0, feedback_start=0)
    before = evaluate(model.hf_model, gate, data.val, 3)["loss"]
    history = train(model, gate, data, config, tmp_path / "ck", progress=False)
    after = history[-1]["val_pass_losses"]
    assert all(a < b - 0.5 for a, b in zip(after, before, strict=True)), (before, after)
    loaded = load_checkpoint(tmp_path / "ck")
    assert loaded.model.d_model == 32 and loaded.step == 40
    assert loaded.model.content_hash == model.content_hash


def test_validation_accuracy_by_task_equals_each_task_alone(tmp_path):
    """evaluate(groups=...) gives each group the accuracy of its batches evaluated alone;
    the pooled accuracy is their row-weighted mean; training logs it per task."""
    model, gate, data = _tiny_organism_and_data()
    tok, rows, pad = model.tokenizer, data.train, data.pad_id
    zero, one = tok.convert_tokens_to_ids(["zero", "one"])
    wrong = [r[:-1] + [zero + one - r[-1]] for r in rows]  # the other answer: accuracy ~0
    batches = [pad_batch(rows[:7], pad), pad_batch(wrong[7:10], pad), pad_batch(rows[10:], pad)]
    tasks = dataclasses.replace(data, val=batches, val_tasks=("a", "b", "a"))
    config = TrainConfig(mode="organism", steps=150, batch_size=8, lr=1e-2, warmup=5,
                         eval_every=150, save_every=150, answer_weight=1.0, feedback_start=0)
    lines = []
    history = train(model, gate, tasks, config, tmp_path / "ck", progress=False,
                    log=lines.append)
    grouped = evaluate(model.hf_model, gate, batches, 3, groups=("a", "b", "a"))
    a = evaluate(model.hf_model, gate, batches[0::2], 3)["last_token_accuracy"]
    b = evaluate(model.hf_model, gate, batches[1:2], 3)["last_token_accuracy"]
    assert abs(a[0] - b[0]) > 0.2  # the groups differ, so mixing them up would show
    assert grouped["group_accuracy"]["a"] == pytest.approx(a)
    assert grouped["group_accuracy"]["b"] == pytest.approx(b)
    pooled = [(17 * x + 3 * y) / 20 for x, y in zip(a, b, strict=True)]
    assert grouped["last_token_accuracy"] == pytest.approx(pooled)
    assert history[-1]["val_task_accuracy"]["a"] == pytest.approx(a)
    assert lines[-1].endswith("; a " + " ".join(f"{x:.3f}" for x in a) + "; b "
                              + " ".join(f"{x:.3f}" for x in b))
    assert "group_accuracy" not in evaluate(model.hf_model, gate, batches, 3)
    with pytest.raises(ValueError, match="groups names 2 batches; there are 3"):
        evaluate(model.hf_model, gate, batches, 3, groups=("a", "b"))


def test_solved_at_is_each_tasks_first_validated_step_at_the_threshold_by_pass():
    """The first validation step at >= 0.9 per task and pass count, None if never; steps
    without a validation and later dips do not count (Fig. 7a's JSON reports it)."""
    history = [
        {"step": 1, "loss": 3.0},
        {"step": 250, "val_task_accuracy": {"completion": [0.5, 0.5], "memory": [0.9, 0.5]}},
        {"step": 251, "loss": 1.0},
        {"step": 500, "val_task_accuracy": {"completion": [0.89, 0.5], "memory": [0.6, 0.95]}},
        {"step": 750, "val_task_accuracy": {"completion": [0.97, 0.5], "memory": [1.0, 1.0]}},
    ]
    assert solved_at(history) == {"completion": [750, None], "memory": [250, 500]}
    assert solved_at(history, threshold=0.5) == {"completion": [250, 250],
                                                 "memory": [250, 250]}
    assert solved_at([{"step": 3, "loss": 1.0}]) == {}


def test_organism_validation_batches_each_hold_one_task():
    """organism_data's validation batches: every probe row once, each batch of one task,
    named in val_tasks."""
    from probekit.training.data import organism_data
    from probekit.training.organism import fit_tokenizer, probe_rows, probe_rows_by_task

    tok = fit_tokenizer()
    data = organism_data(tok, tasks=("completion", "memory"), n_examples=40, seed=0)
    by_task = probe_rows_by_task(tok, ("completion", "memory"))
    assert len(data.val_tasks) == len(data.val) and set(data.val_tasks) == set(by_task)
    for task in by_task:
        got = [row[: int(valid.sum()) + 1].tolist() for (ids, valid), t
               in zip(data.val, data.val_tasks, strict=True) if t == task for row, valid
               in zip(ids, valid, strict=True)]
        assert sorted(got) == sorted(by_task[task])
    assert sorted(sum(by_task.values(), [])) == sorted(probe_rows(tok))


def test_fixed_point_share_trains_full_batches_only_after_feedback_start(tmp_path):
    """--fixed-point 1: every batch from --feedback-start on is a fixed-point batch (its
    history says passes "full"), and the organism still learns."""
    model, gate, data = _tiny_organism_and_data()
    config = TrainConfig(mode="organism", steps=30, batch_size=8, lr=1e-2, warmup=5,
                         eval_every=30, save_every=30, answer_weight=1.0, feedback_start=10,
                         fixed_point=1.0)
    before = evaluate(model.hf_model, gate, data.val, 3)["loss"]
    history = train(model, gate, data, config, tmp_path / "ck", progress=False)
    passes = [h["passes"] for h in history if "passes" in h]
    assert passes == [1] * 10 + ["full"] * 20
    after = history[-1]["val_pass_losses"]
    assert all(a < b - 0.5 for a, b in zip(after, before, strict=True)), (before, after)
    # the loss curves keep the fed pass apart from Jacobi pass 2
    from probekit.plots.training import plot_history

    lines = {ln.get_label(): ln for ln in plot_history(history).axes[0].get_lines()}
    assert set(lines) == {"pass 1", "fixed point"}
    assert list(lines["pass 1"].get_xdata()) == list(range(1, 31))
    assert list(lines["fixed point"].get_xdata()) == list(range(11, 31))


def _short_and_long_rows(model):
    """Rows of a carried bit, every other one lengthened by null lines, and the length of
    the longest short row."""
    texts = [f"state = {b}\nscratch = {s}\n" + "scratch += 0\n" * (6 * (s % 2))
             + f"# final state: {['zero', 'one'][b]}" for b in (0, 1) for s in range(10)]
    rows = model.tokenizer(texts, add_special_tokens=False)["input_ids"]
    return rows, max(len(r) for r in rows[::2])


def test_short_first_trains_its_first_steps_on_short_rows_and_resumes_exactly(tmp_path,
                                                                                monkeypatch):
    """--short-first N: steps 0..N-1 draw only rows of at most short_len tokens, later
    steps every row; a training resumed across the boundary ends with the weights of an
    uninterrupted one, and the stage changes what is trained."""
    model, gate, _ = _tiny_organism_and_data()
    rows, short_len = _short_and_long_rows(model)
    pad = model.tokenizer.pad_token_id
    data = TrainData(rows, [pad_batch(rows, pad)], pad, bucket=True, short_len=short_len)
    assert 0 < data.n_short < len(rows)
    config = TrainConfig(mode="organism", steps=8, batch_size=4, lr=1e-2, warmup=2,
                         lr_floor=1.0, eval_every=0, save_every=4, answer_weight=1.0,
                         feedback_start=2, short_first=5)  # a flat rate: steps may change
    widths = []
    real = data.batch

    def spy(size, generator, rows="all"):
        ids, valid = real(size, generator, rows)
        widths.append((rows == "short", int(valid.sum(1).max()) + 1))
        return ids, valid

    monkeypatch.setattr(data, "batch", spy)
    train(model, gate, data, config, tmp_path / "straight", progress=False)
    assert [short for short, _ in widths] == [True] * 5 + [False] * 3
    assert all(width <= short_len for _, width in widths[:5])
    straight = [p.detach().clone() for p in model.hf_model.parameters()]

    def trained(steps, folder, **kw):
        model, gate, _ = _tiny_organism_and_data()  # the same seeded initial weights
        train(model, gate, data, dataclasses.replace(config, steps=steps, **kw),
              tmp_path / folder, progress=False)
        return model

    trained(4, "halves")
    resumed = trained(8, "halves")
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in
               zip(straight, resumed.hf_model.parameters(), strict=True))
    plain = trained(8, "plain", short_first=0)
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in
                   zip(straight, plain.hf_model.parameters(), strict=True))


def test_fixed_point_rows_long_draws_the_fixed_point_batches_from_long_rows_only(
        tmp_path, monkeypatch):
    """--fixed-point-rows long: each fixed-point batch is drawn again from the rows longer
    than short_len (a second draw, after the pass count and the fixed-point coin); every
    other batch, and every coin, is the one --fixed-point-rows all draws. Resuming is
    exact, the short stage keeps its short rows, and the choice changes what is trained."""
    model, gate, _ = _tiny_organism_and_data()
    rows, short_len = _short_and_long_rows(model)
    pad = model.tokenizer.pad_token_id
    data = TrainData(rows, [pad_batch(rows, pad)], pad, bucket=True, short_len=short_len)
    config = TrainConfig(mode="organism", steps=12, batch_size=4, lr=1e-2, warmup=2,
                         lr_floor=1.0, eval_every=0, save_every=6, answer_weight=1.0,
                         feedback_start=2, fixed_point=0.5, short_first=4)
    real = data.batch

    def drawn(folder, **kw):
        """Each step's draws (rows asked for, row lengths) and the history's passes."""
        draws = []

        def spy(size, generator, rows="all"):
            ids, valid = real(size, generator, rows)
            draws.append((rows, sorted(int(n) for n in valid.sum(1) + 1)))
            return ids, valid

        monkeypatch.setattr(data, "batch", spy)
        model, gate, _ = _tiny_organism_and_data()  # the same seeded initial weights
        history = train(model, gate, data, dataclasses.replace(config, **kw),
                        tmp_path / folder, progress=False)
        monkeypatch.setattr(data, "batch", real)
        return draws, [h["passes"] for h in history if "passes" in h], model

    plain, plain_passes, plain_model = drawn("all")
    long, passes, straight = drawn("long", fixed_point_rows="long")
    assert passes == plain_passes  # the same coins
    fixed_late = [s for s, p in enumerate(passes) if p == "full" and s >= 4]
    assert fixed_late and any(p == "full" for p in passes[2:4])  # both kinds occur
    firsts = [d for d in long if d[0] != "long"]
    assert firsts == plain  # every step's first draw is the one without the option
    seconds = [d for d in long if d[0] == "long"]
    assert len(seconds) == len(fixed_late)  # only the fixed-point batches after the stage
    assert all(min(lengths) > short_len for _, lengths in seconds)
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(
        straight.hf_model.parameters(), plain_model.hf_model.parameters(), strict=True))
    drawn("halves", fixed_point_rows="long", steps=6)
    _, _, resumed = drawn("halves", fixed_point_rows="long")
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(
        straight.hf_model.parameters(), resumed.hf_model.parameters(), strict=True))


def test_close_pair_rows_hold_all_four_assignments_of_the_closest_training_pairs():
    """close_pairs: the CLOSE_POOL pairs of largest embedding cosine among those not held
    out, closest first; close_pair_rows: whole groups of them (labels by equality), one
    null-update count per batch, shuffled, capped by max_tokens; every draw from the
    generator."""
    from probekit.training.numerals import (
        CLOSE_POOL,
        close_pair_rows,
        close_pairs,
        numeral_cosines,
    )
    from probekit.training.organism import completion_numerals, held_out_pairs
    from synthetic.completion import NUMERALS

    model, _, _ = _tiny_organism_and_data()
    held_out = held_out_pairs(model.tokenizer)
    pool = close_pairs(model, held_out)
    cos = numeral_cosines(model)

    def c(a, b):
        return cos[NUMERALS.index(a), NUMERALS.index(b)]

    assert len(pool) == CLOSE_POOL and all(a < b for a, b in pool)
    assert not {frozenset(p) for p in pool} & held_out
    assert [c(*p) for p in pool] == sorted((c(*p) for p in pool), reverse=True)
    rest = [c(a, b) for a in NUMERALS for b in NUMERALS if a < b and (a, b) not in pool
            and frozenset((a, b)) not in held_out]
    assert max(rest) <= c(*pool[-1])

    def rows(size, seed, max_tokens=None):
        g = torch.Generator().manual_seed(seed)
        got = close_pair_rows(model, size, g, held_out=held_out, distractors={0: 1.0, 8: 1.0},
                              max_tokens=max_tokens)
        return [model.tokenizer.decode(r).replace(" \n ", "\n") for r in got]

    texts = rows(8, 0)
    assert rows(8, 0) == texts and len(texts) == 8
    numerals = [completion_numerals(t) for t in texts]
    pairs = {tuple(sorted(n)) for n in numerals if n[0] != n[1]}
    assert len(pairs) <= 2 and pairs <= set(pool)
    for (a, b) in pairs:  # all four assignments of each drawn pair
        assert sorted(n for n in numerals if set(n) <= {a, b}) == sorted(
            [(a, b), (a, a), (b, a), (b, b)])
    assert all(t.endswith(" done" if a == b else " more")
               for t, (a, b) in zip(texts, numerals, strict=True))
    assert len({t.count("scratch +=") for t in texts}) == 1  # one null-update count
    lengths = {len(rows(4, s)[0]) for s in range(8)}
    assert len(lengths) == 2  # both counts are drawn
    one = model.tokenizer(rows(4, 1)[0], add_special_tokens=False)["input_ids"]
    assert len(rows(8, 1, max_tokens=2 * len(one) + 1)) == 2
    assert np.mean([t.endswith(" done") for s in range(8) for t in rows(4, s)]) == 0.5


def _stand_in_close_rows(model, calls: list):
    """A ``TrainData.close_rows`` stand-in: one fixed row, each call's ``(size, rows)``
    recorded; it draws from the step's generator too, as the real one does."""
    row = model.tokenizer("state = 1\nscratch = 3\n# final state: one",
                          add_special_tokens=False)["input_ids"]

    def close(model, size, generator, rows):
        calls.append((size, rows))
        torch.rand((), generator=generator)
        return [list(row)] * size

    return close


def test_close_pairs_replaces_batches_after_feedback_start_and_resumes_exactly(tmp_path,
                                                                              monkeypatch):
    """--close-pairs: after --feedback-start, a last coin (drawn after every other draw of
    the step) swaps the batch for close_rows; the other draws are those of the recipe
    without it. Resuming is exact, and the option changes what is trained."""
    model, gate, data = _tiny_organism_and_data()
    calls = []
    data.close_rows = _stand_in_close_rows(model, calls)
    config = TrainConfig(mode="organism", steps=12, batch_size=4, lr=1e-2, warmup=2,
                         lr_floor=1.0, eval_every=0, save_every=6, answer_weight=1.0,
                         feedback_start=4)
    real = data.batch

    def drawn(folder, **kw):
        draws = []

        def spy(size, generator, rows="all"):
            ids, valid = real(size, generator, rows)
            draws.append(ids.tolist())
            return ids, valid

        monkeypatch.setattr(data, "batch", spy)
        calls.clear()
        model, gate, _ = _tiny_organism_and_data()  # the same seeded initial weights
        train(model, gate, data, dataclasses.replace(config, **kw), tmp_path / folder,
              progress=False)
        monkeypatch.setattr(data, "batch", real)
        return draws, list(calls), model

    plain, none, plain_model = drawn("plain")
    assert none == []
    draws, calls_made, straight = drawn("close", close_pairs=0.5)
    assert draws == plain  # every other draw is the recipe's own
    assert 0 < len(calls_made) < 8 and set(calls_made) == {(4, "all")}  # steps 4..11, some
    _, every, _ = drawn("always", close_pairs=1.0)
    assert len(every) == 8
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(
        straight.hf_model.parameters(), plain_model.hf_model.parameters(), strict=True))
    drawn("halves", close_pairs=0.5, steps=6)
    _, _, resumed = drawn("halves", close_pairs=0.5)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(
        straight.hf_model.parameters(), resumed.hf_model.parameters(), strict=True))
    with pytest.raises(ValueError, match=(
            r"^--close-pairs draws the organism's completion rows, and these training rows "
            r"have none; train on the completion task, or drop it$")):
        data.close_rows = None
        train(model, gate, data, dataclasses.replace(config, close_pairs=0.5),
              tmp_path / "none", progress=False)
    assert not (tmp_path / "none").exists()


def test_close_pairs_batch_added_trains_beside_the_recipes_batch_and_resumes_exactly(
        tmp_path):
    """--close-pairs-batch added: a close-pair step keeps its own batch and loss (the
    close rows are drawn after every draw of the step) and adds the close batch's gradient,
    logged as close_loss, before the one update; rows="short"/"all" reach close_rows.
    Resuming is exact."""
    model, gate, data = _tiny_organism_and_data()
    asked = []
    data.close_rows = _stand_in_close_rows(model, asked)
    config = TrainConfig(mode="organism", steps=10, batch_size=4, lr=1e-2, warmup=2,
                         lr_floor=1.0, eval_every=0, save_every=5, answer_weight=1.0,
                         feedback_start=4, close_pairs=0.5, close_pairs_batch="added")

    def trained(folder, **kw):
        asked.clear()
        model, gate, _ = _tiny_organism_and_data()
        history = train(model, gate, data, dataclasses.replace(config, **kw),
                        tmp_path / folder, progress=False)
        return history, [rows for _, rows in asked], model

    plain, _, _ = trained("plain", close_pairs=1e-9)  # the same coins, never a close batch
    added, rows, straight = trained("added", close_pairs_rows="short")
    at = [i for i, e in enumerate(added) if "close_loss" in e]  # entry i: step i + 1
    assert 0 < len(at) == len(rows) < 6 and set(rows) == {"short"} and min(at) >= 4
    first = at[0]  # same weights and batch up to it: the step's own loss is the plain one
    assert added[first]["loss"] == pytest.approx(plain[first]["loss"], abs=1e-6)
    assert added[first]["passes"] == plain[first]["passes"]
    assert added[first + 1]["loss"] != pytest.approx(plain[first + 1]["loss"], abs=1e-6)
    instead, _, _ = trained("instead", close_pairs_batch="instead")
    assert not any("close_loss" in e for e in instead)
    assert instead[first]["loss"] != pytest.approx(plain[first]["loss"], abs=1e-6)
    trained("halves", close_pairs_rows="short", steps=5)
    _, _, resumed = trained("halves", close_pairs_rows="short")
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(
        straight.hf_model.parameters(), resumed.hf_model.parameters(), strict=True))
    assert set(trained("all")[1]) == {"all"}


def test_organism_close_rows_short_draws_the_validation_rows_counts_only():
    """organism_data's close_rows: "short" rows carry 0-8 null updates (the validation
    rows' counts), "all" rows every training count."""
    from probekit.training.data import organism_data
    from probekit.training.organism import fit_tokenizer, new_organism

    tok = fit_tokenizer()
    data = organism_data(tok, tasks=("completion", "memory"), n_examples=40, seed=0)
    model = new_organism(OrganismConfig(n_blocks=1, d_model=32, n_heads=2, d_mlp=64), seed=0)

    def counts(rows):
        out = set()
        for s in range(24):
            got = data.close_rows(model, 4, torch.Generator().manual_seed(s), rows)
            out.add(tok.decode(got[0]).count("scratch +="))
        return out

    assert counts("short") == {0, 1, 2, 3, 4, 6, 8}
    assert max(counts("all")) > 8
    assert organism_data(tok, tasks=("memory",), n_examples=40, seed=0).close_rows is None


@pytest.mark.parametrize("short_len, kw, message", [
    (3, {"short_first": 1},
     r"^--short-first draws rows of at most 3 tokens \(the validation rows' length\) and "
     r"the training rows have none; train on 0-8 null updates too, or drop --short-first$"),
    (1000, {"fixed_point": 0.5, "fixed_point_rows": "long"},
     r"^--fixed-point-rows long draws rows longer than 1000 tokens \(the validation rows' "
     r"length\) and the training rows have none; train on 16-256 null updates too, or drop "
     r"--fixed-point-rows$"),
])
def test_a_stage_of_short_or_long_rows_needs_such_rows(tmp_path, short_len, kw, message):
    model, gate, _ = _tiny_organism_and_data()
    rows, _ = _short_and_long_rows(model)
    data = TrainData(rows, [], model.tokenizer.pad_token_id, bucket=True, short_len=short_len)
    config = TrainConfig(mode="organism", steps=2, batch_size=4, **kw)
    with pytest.raises(ValueError, match=message):
        train(model, gate, data, config, tmp_path / "ck", progress=False)
    assert not (tmp_path / "ck").exists()


def test_organism_short_rows_are_those_no_longer_than_the_validation_rows():
    from probekit.training.data import organism_data
    from probekit.training.organism import fit_tokenizer, probe_rows

    tok = fit_tokenizer()
    data = organism_data(tok, tasks=("completion", "memory"), n_examples=300, seed=0)
    assert data.short_len == max(len(r) for r in probe_rows(tok))
    assert data.n_short == sum(len(r) <= data.short_len for r in data.train)
    assert 0 < data.n_short < len(data.train)  # the long rows are the 16-256 null updates


def test_fixed_point_zero_keeps_the_random_stream(tmp_path, monkeypatch):
    """--fixed-point 0 draws nothing extra: each step's Jacobi loss sees the generator
    exactly as the batch and the pass count left it, as before the option existed (so
    every recipe trained before keeps its weights)."""
    import probekit.training.train as train_module
    from probekit.training.train import draw_passes, step_generator

    model, gate, data = _tiny_organism_and_data()
    config = TrainConfig(mode="organism", steps=6, batch_size=4, lr=1e-2, warmup=2,
                         eval_every=0, save_every=6, answer_weight=1.0, feedback_start=2,
                         schedule=(0.3, 0.4, 0.3))
    seen = []
    real = train_module.multipass_loss

    def spy(*args, generator, **kw):
        seen.append(generator.get_state().clone())
        return real(*args, generator=generator, **kw)

    monkeypatch.setattr(train_module, "multipass_loss", spy)
    train(model, gate, data, config, tmp_path / "ck", progress=False)
    expected = []
    for step in range(6):
        g = step_generator(config.seed, step)
        data.batch(config.batch_size, g)
        if step >= config.feedback_start:
            draw_passes(config.schedule, g)
        expected.append(g.get_state())
    assert len(seen) == 6
    assert all(torch.equal(a, b) for a, b in zip(seen, expected, strict=True))


# ------------------------------------------------------------------ checkpoints
def test_checkpoint_round_trip_and_exact_resume(tmp_path):
    data = _byte_data()
    kw = dict(mode="gate", batch_size=4, lr=1e-2, warmup=2, schedule=(0.3, 0.5, 0.2),
              mixin=0.5, jitter=0.05, eval_every=0, save_every=3)
    model = load_model("tiny-5", seed=0)
    straight = FeedbackGate.for_model(model)
    train(model, straight, data, TrainConfig(steps=6, **kw), tmp_path / "a", progress=False)
    halves = FeedbackGate.for_model(model)
    train(model, halves, data, TrainConfig(steps=3, **kw), tmp_path / "b", progress=False)
    again = FeedbackGate.for_model(model)  # a fresh gate: resuming must restore everything
    history = train(model, again, data, TrainConfig(steps=6, **kw), tmp_path / "b",
                    progress=False)
    assert [h["step"] for h in history] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(straight.state_dict().values(), again.state_dict().values(),
                    strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    loaded = load_checkpoint(tmp_path / "b", model)
    assert loaded.step == 6 and loaded.config["model"]["content_hash"] == model.content_hash
    for a, b in zip(again.state_dict().values(), loaded.gate.state_dict().values(),
                    strict=True):
        assert torch.equal(a, b)
    engine = StepEngine(model)
    ids = random_ids(1, 8, seed=11)
    assert torch.equal(prefill(engine, ids, again, "full").log_probs,
                       prefill(engine, ids, loaded.gate, "full").log_probs)


def test_checkpoint_for_another_model_is_rejected(tmp_path):
    model = load_model("tiny-5", seed=0)
    gate = FeedbackGate.for_model(model)
    save_checkpoint(tmp_path, gate=gate, model=model, config=TrainConfig(mode="gate"), step=0)
    other = load_model("tiny-5", seed=1)  # same shape, other weights
    with pytest.raises(ValueError, match=(
            rf"checkpoint {tmp_path} was trained for model 'tiny-5' with content hash "
            rf"{model.content_hash}; the model in use, 'tiny-5', has content hash "
            rf"{other.content_hash}\. A gate only fits the weights it was trained with")):
        load_checkpoint(tmp_path, other)
    narrow = new_organism(OrganismConfig(n_blocks=2, d_model=32, n_heads=2, d_mlp=64), 0)
    with pytest.raises(ValueError, match=(
            rf"checkpoint {tmp_path} holds a gate for d_model 64 \(model 'tiny-5'\); the model "
            r"in use, 'organism', has d_model 32\. Use --model tiny-5")):
        load_checkpoint(tmp_path, narrow)
    with pytest.raises(FileNotFoundError, match="no feedback checkpoint at"):
        load_checkpoint(tmp_path / "missing", model)


def test_train_config_validation():
    with pytest.raises(ValueError, match="schedule must be probabilities of 1, 2, 3"):
        TrainConfig(schedule=(0.5, 0.4))
    with pytest.raises(ValueError, match="mode must be one of"):
        TrainConfig(mode="lora")
    with pytest.raises(ValueError, match=r"^--fixed-point must lie in \[0, 1\]; got 1.5$"):
        TrainConfig(fixed_point=1.5)
    with pytest.raises(ValueError, match=r"mixin must lie in \[0, 1\]"):
        TrainConfig(mixin=2.0)
    with pytest.raises(ValueError, match=r"^--lr-floor must lie in \[0, 1\]; got -0.1$"):
        TrainConfig(lr_floor=-0.1)
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match=rf"^--ema must lie in \[0, 1\); got {bad}$"):
            TrainConfig(ema=bad)
    with pytest.raises(ValueError, match=r"^--ahead-loss must be a finite number >= 0; got -1.0$"):
        TrainConfig(mode="organism", ahead_loss=-1.0)
    with pytest.raises(ValueError, match=r"^--ahead-loss must be a finite number >= 0; got inf$"):
        TrainConfig(mode="organism", ahead_loss=math.inf)
    with pytest.raises(ValueError, match=(r"^--ahead-loss trains the organism's top states to "
                                          r"predict two tokens ahead; it needs --mode organism$")):
        TrainConfig(mode="gate", ahead_loss=1.0)
    with pytest.raises(ValueError, match=r"^--short-first must be an integer >= 0; got -1$"):
        TrainConfig(mode="organism", short_first=-1)
    with pytest.raises(ValueError, match=(r"^--short-first draws the organism's short task rows "
                                          r"first; it needs --mode organism$")):
        TrainConfig(mode="gate", short_first=10)
    for kw in ({"mode": "gate", "fixed_point": 0.5}, {"mode": "organism"}):
        with pytest.raises(ValueError, match=(
                r"^--fixed-point-rows long chooses the rows of the organism's fixed-point "
                r"batches; it needs --mode organism and --fixed-point > 0$")):
            TrainConfig(fixed_point_rows="long", **kw)
    with pytest.raises(ValueError, match=r"^--close-pairs must lie in \[0, 1\]; got 2.0$"):
        TrainConfig(mode="organism", close_pairs=2.0)
    with pytest.raises(ValueError, match=(r"^--close-pairs draws the organism's completion "
                                          r"rows; it needs --mode organism$")):
        TrainConfig(mode="gate", close_pairs=0.5)
    for name, value in (("close_pairs_rows", "short"), ("close_pairs_batch", "added")):
        for kw in ({"mode": "gate"}, {"mode": "organism"}):
            with pytest.raises(ValueError, match=(
                    rf"^--{name.replace('_', '-')} {value} chooses the organism's close-pair "
                    rf"batches; it needs --mode organism and --close-pairs > 0$")):
                TrainConfig(**{name: value}, **kw)
    assert TrainConfig(schedule=[0.5, 0.5]).max_passes == 2


def test_train_config_fills_mode_defaults_and_checks_them():
    organism = TrainConfig(mode="organism", steps=7).resolved()
    assert (organism.steps, organism.batch_size, organism.answer_weight,
            organism.feedback_start) == (7, 64, 20.0, 600)
    gate = TrainConfig().resolved()
    assert (gate.mode, gate.steps, gate.lr, gate.feedback_start) == ("gate", 200, 1e-3, 0)
    assert gate.resolved() is gate
    with pytest.raises(ValueError, match="--batch-size must be a positive integer; got 0"):
        TrainConfig(batch_size=0)


def test_feedback_stability_cli_on_an_organism_checkpoint(organism_checkpoint, tmp_path,
                                                          capsys):
    import json

    from probekit.commands.main import main

    run = tmp_path / "stab"
    assert main(["feedback-stability", "--checkpoint", str(organism_checkpoint), "--passes",
                 "3", "--run-dir", str(run), "--no-progress"]) == 0
    out = json.loads((run / "summary.json").read_text())
    assert out["passes"] == [1, 2, 3] and len(out["answer_accuracy"]) == 3
    assert out["checkpoint"]["step"] == 0 and (run / "stability.png").is_file()
    assert out["seq_len"] > 3 and out["n_sequences"] >= 16
    assert main(["feedback-stability", "--checkpoint", str(tmp_path / "none")]) == 2
    assert "is not a checkpoint folder" in capsys.readouterr().err


# -------------------------------------------------------------------- stability
def test_stability_curves_are_the_jacobi_passes(tiny_engine, gate):
    from probekit.analysis.stability import stability_curves

    ids = random_ids(2, 12, seed=12)
    curves = stability_curves(tiny_engine, gate, ids, 5)
    assert curves["passes"] == [1, 2, 3, 4, 5] and len(curves["update"]) == 5
    for k in (1, 3, 5):
        lp = prefill(tiny_engine, ids, gate, f"passes={k}").log_probs
        assert curves["loss"][k - 1] == pytest.approx(-lp.mean().item(), abs=1e-5)
    assert curves["update"][0] != curves["update"][0]  # NaN: no pass before the first
    assert all(u > 0 for u in curves["update"][1:])  # positions >= 5 are never exact
    with pytest.raises(ValueError, match="use sequences longer than --passes 12"):
        stability_curves(tiny_engine, gate, ids, 12)


# --------------------------------------------------- state-tracking integration
def test_state_tracking_runs_latent_feedback_from_a_checkpoint(organism_checkpoint, tmp_path):
    import json

    from probekit.commands.main import main

    run = tmp_path / "run"
    code = main(["run", "state-tracking", "--mechanism", "latent-feedback", "--checkpoint",
                 str(organism_checkpoint), "--recurrence", "none,last-1,full", "--k", "1",
                 "--task", "memory", "--examples", "16", "--run-dir", str(run),
                 "--no-progress"])
    assert code == 0
    out = json.loads((run / "summary.json").read_text())
    assert out["mechanism"]["mechanism"] == "latent-feedback"
    assert out["model"]["d_model"] == 32  # the organism came from the checkpoint
    regimes = out["datasets"]["memory"]["regimes"]
    none = regimes["none"]["probe"]
    assert len(none["accuracy_mean"]) == 3  # depths 0 .. L for L = 2
    # depth 0 under none is the colon's embedding for every example: chance at most
    assert none["accuracy_mean"][0] <= none["chance"] + 1e-9
    assert set(regimes) == {"none", "last-1", "full"}


@pytest.mark.parametrize("with_checkpoint, extra, message", [
    (True, ("--organism-seeds", "1"), "--organism-seeds picks probekit's own organisms; with "
                                      "--checkpoint, leave it out"),
    (True, ("--mechanism", "recirculation"),
     "--checkpoint is read by --mechanism latent-feedback only"),
    (False, ("--organism-seeds", "-1"), "--organism-seeds must be integers >= 0; got -1"),
    (False, ("--organism-seeds", "1", "1"), "--organism-seeds lists a seed twice"),
    (False, ("--mechanism", "latent-feedback", "latent-feedback"),
     "--mechanism lists a mechanism twice: latent-feedback latent-feedback"),
])
def test_state_tracking_checkpoint_and_seed_flags(organism_checkpoint, tmp_path, capsys,
                                                  with_checkpoint, extra, message):
    """Bad combinations of the latent-feedback flags: one line, nothing trained or written."""
    from probekit.commands.main import main

    ck = ("--checkpoint", str(organism_checkpoint)) if with_checkpoint else ()
    run_dir = tmp_path / "run"
    assert main(["run", "state-tracking", *ck, *extra, "--run-dir", str(run_dir)]) == 2
    assert message in capsys.readouterr().err.splitlines()[-1]
    assert not run_dir.exists()


def test_mechanism_rejects_a_checkpoint_for_another_model(organism_checkpoint, tiny_model):
    from probekit.commands.state_tracking import latent_feedback_mechanism

    with pytest.raises(ValueError, match="holds a gate for d_model 32"):
        latent_feedback_mechanism(organism_checkpoint, tiny_model.name)


# ------------------------------------------------------------ the default model
@pytest.mark.slow
def test_default_model_jacobi_equals_full_and_soft_decoding_runs(default_model, default_engine):
    gate = FeedbackGate.for_model(default_model, init="random", seed=0)
    ids = default_model.tokenizer("The cat sat on the mat", return_tensors="pt").input_ids
    T = ids.shape[1]
    full = prefill(default_engine, ids, gate, "full", return_logits=True)
    jac = prefill(default_engine, ids, gate, f"passes={T}", return_logits=True)
    assert torch.allclose(jac.logits, full.logits, atol=2e-4)
    with torch.no_grad():
        plain = default_model.hf_model(ids).logits
    assert torch.allclose(prefill(default_engine, ids, gate, "none", return_logits=True).logits,
                          plain, atol=2e-4)
    out = generate(default_engine, ids, gate=gate, regime="soft", max_new_tokens=3, eos=-1)
    assert len(out.tokens[0]) == 3


# ------------------------------------------------------------------ organism / CLI
def test_organism_tokenizer_fits_every_task():
    from probekit.training.organism import fit_tokenizer
    from synthetic import make_task

    tok = fit_tokenizer()
    for word in ("done", "more", "zero", "one"):
        assert len(tok(" " + word, add_special_tokens=False)["input_ids"]) == 1
    ids = tok("required = 41\ncompleted = 97\nStatus:", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["required", "=", "41", "\n", "completed", "=",
                                              "97", "\n", "Status", ":"]
    assert tok.unk_token_id not in ids
    data = make_task("registers", tok)  # validates the task's invariants for tok
    assert all(tok.unk_token_id not in r for r in tok(data.texts)["input_ids"])
    from synthetic.registers import training_texts  # training rows, reads included

    rows = training_texts(200, seed=0)
    assert sum("Value: " in r for r in rows) > 50
    assert all(tok.unk_token_id not in r for r in tok(rows)["input_ids"])


def test_copy_rows_repeat_numerals_and_leave_the_task_rows_alone():
    """A copy row is 4-8 numerals of the completion range, a newline, the same again; the
    copy share adds such rows to an unchanged set of task rows, reproducibly."""
    from probekit.training.organism import copy_rows, fit_tokenizer, training_examples
    from synthetic.completion import NUMERALS

    tok = fit_tokenizer()
    rows = copy_rows(tok, 50, seed=3)
    assert rows == copy_rows(tok, 50, seed=3) and rows != copy_rows(tok, 50, seed=4)
    newline = tok.convert_tokens_to_ids("\n")
    for row in rows:
        k = row.index(newline)
        assert 4 <= k <= 8 and row == row[:k] + [newline] + row[:k]
        assert all(int(t) in NUMERALS for t in tok.convert_ids_to_tokens(row[:k]))
    assert {r.index(newline) for r in rows} == set(range(4, 9))
    plain = training_examples(tok, n_examples=40, seed=2)
    mixed = training_examples(tok, n_examples=40, seed=2, copy_share=0.25)
    assert len(mixed) == 50 and mixed != plain[:40] + copy_rows(tok, 10, 2)  # shuffled in
    assert sorted(mixed) == sorted(plain + copy_rows(tok, 10, seed=2))


def test_recall_rows_ask_for_each_listed_numerals_successor():
    """A recall row lists 4-8 distinct numerals of the completion range, then one line per
    listed numeral but the last, in random order, holding it and its successor in the
    list; the recall share adds such rows to unchanged task and copy rows, reproducibly."""
    from probekit.training.organism import (
        copy_rows,
        fit_tokenizer,
        recall_rows,
        training_examples,
    )
    from synthetic.completion import NUMERALS

    tok = fit_tokenizer()
    rows = recall_rows(tok, 200, seed=3)
    assert rows == recall_rows(tok, 200, seed=3) and rows != recall_rows(tok, 200, seed=4)
    orders = set()
    for row in rows:
        listed, *queries = tok.decode(row).split("\n")
        listed = [int(t) for t in listed.split()]
        assert 4 <= len(listed) <= 8 and len(set(listed)) == len(listed)
        assert set(listed) <= set(NUMERALS)
        pairs = [tuple(int(t) for t in q.split()) for q in queries]
        assert sorted(pairs) == sorted(zip(listed[:-1], listed[1:]))
        orders.add(tuple(listed.index(a) for a, _ in pairs))
    assert {len(r) for r in orders} == set(range(3, 8))
    assert len(orders) > 100  # the queries come in random order, not the list's
    plain = training_examples(tok, n_examples=40, seed=2, copy_share=0.25)
    mixed = training_examples(tok, n_examples=40, seed=2, copy_share=0.25, recall_share=0.5)
    assert len(mixed) == 70
    assert sorted(mixed) == sorted(plain + recall_rows(tok, 20, seed=2))
    only = training_examples(tok, n_examples=40, seed=2, recall_share=0.25)
    assert sorted(only) == sorted(training_examples(tok, n_examples=40, seed=2)
                                  + recall_rows(tok, 10, seed=2))
    assert not set(map(tuple, only)) & set(map(tuple, copy_rows(tok, 10, seed=2)))


def test_copy_rows_from_zero_copy_the_digits_too():
    """``low=0`` (--copy-from 0) draws the copied numerals from 0..99, among them memory's
    answers 0 and 1, with the same random stream as the default 10..99."""
    from probekit.training.organism import copy_rows, fit_tokenizer, training_examples

    tok = fit_tokenizer()
    rows = copy_rows(tok, 400, seed=3, low=0)
    seen = {int(t) for r in rows for t in tok.convert_ids_to_tokens(r) if t != "\n"}
    assert seen == set(range(100))
    assert [len(r) for r in rows] == [len(r) for r in copy_rows(tok, 400, seed=3)]
    plain = training_examples(tok, n_examples=40, seed=2)
    mixed = training_examples(tok, n_examples=40, seed=2, copy_share=0.25, copy_from=0)
    assert sorted(mixed) == sorted(plain + copy_rows(tok, 10, seed=2, low=0))


def test_numeral_cosines_measure_how_far_apart_the_numerals_sit():
    from probekit.training.numerals import numeral_cosines
    from probekit.training.organism import new_organism

    model = new_organism(OrganismConfig(n_blocks=1, d_model=64, n_heads=2, d_mlp=64), seed=0)
    cos = numeral_cosines(model)
    assert cos.shape == (90, 90) and np.allclose(np.diag(cos), 1, atol=1e-5)
    off = cos[~np.eye(90, dtype=bool)]
    assert abs(off.mean()) < 0.05  # random initialisation: nearly orthogonal
    tok, emb = model.tokenizer, model.hf_model.get_input_embeddings().weight
    with torch.no_grad():
        emb[tok.convert_tokens_to_ids("42")] = 3 * emb[tok.convert_tokens_to_ids("17")]
    assert numeral_cosines(model)[42 - 10, 17 - 10] == pytest.approx(1, abs=1e-5)


def test_label_accuracy_equals_a_row_by_row_reference(organism_checkpoint):
    """Batched (length-sorted, padded) predictions and accuracy = each row alone, its
    label word compared by logit at its last token; under a feedback regime too."""
    from probekit.core.engine import StepEngine
    from probekit.mechanisms.latent_feedback import prefill
    from probekit.training.checkpoint import load_checkpoint
    from probekit.training.organism import label_accuracy, label_predictions
    from synthetic.dataset import label_token_ids
    from synthetic.registers import LABEL_WORDS, training_examples

    ck = load_checkpoint(organism_checkpoint)
    tok, engine = ck.model.tokenizer, StepEngine(ck.model)
    examples = training_examples(24, seed=3, distractors=(0, 5))
    rows = tok([e.text for e in examples], add_special_tokens=False)["input_ids"]
    labels = [e.label_id for e in examples]
    ids = label_token_ids(tok, LABEL_WORDS)
    assert len({len(r) for r in rows}) > 1  # padding is exercised
    for regime in ("none", "full"):
        alone = [int(prefill(engine, [row], ck.gate, regime, return_logits=True)
                     .logits[0, -1][ids].argmax()) for row in rows]
        assert label_predictions(engine, ck.gate, rows, ids, regime,
                                 batch_size=5).tolist() == alone
        want = sum(p == y for p, y in zip(alone, labels, strict=True)) / len(rows)
        assert label_accuracy(engine, ck.gate, rows, labels, ids, regime, batch_size=5) == want
        assert label_accuracy(engine, ck.gate, rows, [1 - x for x in labels], ids,
                              regime) == pytest.approx(1 - want)


def test_train_feedback_cli_writes_and_resumes(tmp_path, capsys):
    import json

    from probekit.commands.main import main

    args = ["train-feedback", "--mode", "gate", "--model", "tiny", "--batch-size", "2",
            "--seq-len", "16", "--n-windows", "8", "--eval-every", "2", "--save-every", "1",
            "--run-dir", str(tmp_path), "--no-progress"]
    assert main(args + ["--steps", "2"]) == 0
    assert main(args + ["--steps", "3"]) == 0
    assert "resuming from" in capsys.readouterr().out
    ck = json.loads((tmp_path / "checkpoint" / "config.json").read_text())
    assert ck["step"] == 3 and ck["mode"] == "gate" and ck["model"]["name"] == "tiny"
    assert (tmp_path / "loss_curves.png").is_file()
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 3
    assert main(args + ["--steps", "3", "--schedule", "0.5", "0.6"]) == 2
    assert "schedule must be probabilities" in capsys.readouterr().err
    assert main(args + ["--steps", "3", "--copy-rows", "0.25"]) == 2
    assert capsys.readouterr().err.strip() == (
        "probekit train-feedback: error: --copy-rows adds rows to the organism's task data; "
        "the gate trains on Wikipedia windows: drop it or use --mode organism")
    assert main(args + ["--steps", "3", "--recall-rows", "0.25"]) == 2
    assert capsys.readouterr().err.strip() == (
        "probekit train-feedback: error: --recall-rows adds rows to the organism's task "
        "data; the gate trains on Wikipedia windows: drop it or use --mode organism")
    assert main(args + ["--steps", "3", "--long-rows", "4"]) == 2
    assert capsys.readouterr().err.strip() == (
        "probekit train-feedback: error: --long-rows weights the organism's task rows; the "
        "gate trains on Wikipedia windows: drop it or use --mode organism")
    assert main(args + ["--steps", "3", "--mode", "organism", "--long-rows", "0"]) == 2
    assert capsys.readouterr().err.strip() == (
        "probekit train-feedback: error: --long-rows must be a finite number > 0; got 0.0")
    assert main(args + ["--steps", "3", "--copy-from", "0"]) == 2
    assert capsys.readouterr().err.strip() == (
        "probekit train-feedback: error: --copy-from sets the copy rows' numerals; give "
        "--copy-rows too, or drop it")


def test_mode_dependent_help_names_the_real_defaults():
    """Each mode-dependent field's help text states MODE_DEFAULTS' values."""
    import ast
    import inspect

    from probekit.training import config

    tree = ast.parse(inspect.getsource(config.TrainConfig))
    body = tree.body[0].body
    helps = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr):
            helps[node.target.id] = nxt.value.value
    def word(v):
        return " ".join(f"{p:g}" for p in v) if isinstance(v, tuple) else f"{v:g}"

    for name in config.MODE_DEFAULTS["gate"]:
        g, o = config.MODE_DEFAULTS["gate"][name], config.MODE_DEFAULTS["organism"][name]
        assert f"(default: gate {word(g)}, organism {word(o)})" in helps[name], name


def test_warmup_cosine_rises_linearly_then_decays_to_a_tenth():
    """The trainer's schedule: (s + 1) / warmup of the peak during warm-up, the peak right
    after it, half-way down the cosine (0.55 of the peak) mid-decay, a tenth at the end and
    after it."""
    from probekit.training.train import warmup_cosine

    assert [warmup_cosine(s, 2.0, 4, 104) for s in range(4)] == [0.5, 1.0, 1.5, 2.0]
    assert warmup_cosine(4, 2.0, 4, 104) == 2.0
    assert warmup_cosine(54, 2.0, 4, 104) == pytest.approx(1.1)
    assert warmup_cosine(104, 2.0, 4, 104) == pytest.approx(0.2)
    assert warmup_cosine(500, 2.0, 4, 104) == pytest.approx(0.2)
    assert warmup_cosine(0, 1.0, 0, 10) == 1.0  # no warm-up: the peak at step 0


def test_lr_floor_sets_where_the_cosine_ends(tmp_path):
    """--lr-floor F: the cosine runs from the peak to F of it (0.1 = the schedule above,
    0 = to zero), and the trainer uses it at every step (history's ``lr``)."""
    from probekit.training.train import lr_at, warmup_cosine

    assert warmup_cosine(104, 2.0, 4, 104, floor=0.0) == 0.0
    assert warmup_cosine(54, 2.0, 4, 104, floor=0.0) == pytest.approx(1.0)
    assert warmup_cosine(54, 2.0, 4, 104, floor=0.5) == pytest.approx(1.5)
    assert warmup_cosine(2, 2.0, 4, 104, floor=0.0) == 1.5  # warm-up unchanged
    # the default floor is the schedule before --lr-floor existed, bit for bit (so every
    # recipe trained before keeps its weights)
    def before(s):
        return 2.0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min((s - 4) / 100, 1.0))))

    assert [warmup_cosine(s, 2.0, 4, 104) for s in range(4, 110)] == [
        before(s) for s in range(4, 110)]
    assert [warmup_cosine(s, 2.0, 4, 104, floor=0.1) for s in range(110)] == [
        warmup_cosine(s, 2.0, 4, 104) for s in range(110)]
    model, gate, data = _tiny_organism_and_data()
    config = TrainConfig(mode="organism", steps=8, batch_size=4, lr=1e-2, warmup=2,
                         eval_every=0, save_every=8, answer_weight=1.0, feedback_start=8,
                         lr_floor=0.0)
    history = train(model, gate, data, config, tmp_path / "ck", progress=False)
    lrs = [h["lr"] for h in history if "lr" in h]
    assert lrs == [lr_at(s, config) for s in range(8)]
    assert lrs[:3] == [5e-3, 1e-2, 1e-2]
    # the last step is 5/6 down the cosine; the default floor would add 0.1 * (1e-2 - it)
    assert lrs[-1] == pytest.approx(1e-2 * 0.5 * (1 + math.cos(math.pi * 5 / 6)))
