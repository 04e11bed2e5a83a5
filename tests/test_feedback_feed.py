"""Which top state latent feedback feeds back (``FeedbackGate(feed=...)``): after the final
norm (``"normed"``, the default) or before it (``"residual"``). Every path that feeds back
(engine strategy, slow reference, training objective, stability curves, checkpoints, the
trainer's ``--feed``) must follow the gate. Tiny random Llamas; seconds in all."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json

import pytest
import torch
from engine_helpers import random_ids

from probekit.core.engine import StepEngine
from probekit.core.models import content_hash, load_model
from probekit.mechanisms.latent_feedback import (
    FEEDS,
    FeedbackGate,
    LatentFeedback,
    final_norm,
    prefill,
    reference_latent_feedback,
)
from probekit.training.checkpoint import load_checkpoint, restore_training, save_checkpoint
from probekit.training.config import TrainConfig
from probekit.training.objective import fixed_point_loss, multipass_loss
from probekit.training.train import make_optimizer

torch.set_num_threads(1)
ATOL = 3e-5  # float32: cached, parallel and uncached paths sum in different orders


@pytest.fixture(scope="module")
def model():
    """A private tiny Llama whose final norm has a non-uniform weight. With the default
    all-ones weight the two feeds differ only through the gate's epsilon (RMSNorm_u
    removes the per-position scale), so a feed mixed up for the other would go unseen."""
    m = load_model("tiny-5", seed=0)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        final_norm(m).weight.copy_(0.2 + 2 * torch.rand(m.d_model, generator=g))
    m.content_hash = content_hash(m.hf_model)
    return m


@pytest.fixture(scope="module")
def engine(model):
    return StepEngine(model)


def make_gate(model, feed):
    # random init: the same weights for both feeds (same seed), only `feed` differs
    return FeedbackGate.for_model(model, init="random", seed=1, feed=feed)


def hf_passes(model, gate, ids, n, *, jitter=0.0, generator=None):
    """Jacobi passes by hand on the plain Hugging Face forward: ``(logits, fed states)``
    per pass. The normed state is the model's output, the residual the final norm's input
    (a hook of this test's own)."""
    hf = model.hf_model
    e = hf.get_input_embeddings()(ids)
    x, logits, fed = e, [], []
    for _ in range(n):
        seen = []
        handle = final_norm(model).register_forward_hook(
            lambda mod, args, out: seen.append(args[0]))
        try:
            normed = hf.model(inputs_embeds=x).last_hidden_state
        finally:
            handle.remove()
        h = normed if gate.feed == "normed" else seen[0]
        logits.append(hf.lm_head(normed))
        fed.append(h)
        if jitter:
            h = h + jitter * (torch.rand(h.shape, generator=generator, dtype=h.dtype) * 2 - 1)
        prev = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], 1)
        x = torch.cat([e[:, :1], gate(prev, e)[:, 1:]], 1)
    return logits, fed


# ------------------------------------------------------------------ engine and reference
@pytest.mark.parametrize("feed", FEEDS)
def test_full_equals_the_slow_reference(model, engine, feed):
    gate = make_gate(model, feed)
    rows = [random_ids(1, 9, seed=1)[0].tolist(), random_ids(1, 6, seed=2)[0].tolist()]
    out = prefill(engine, rows, gate, "full", return_logits=True)
    for i, row in enumerate(rows):
        ref = reference_latent_feedback(model, gate, row)
        assert torch.allclose(out.logits[i, : len(row)], ref, atol=ATOL), (feed, i)
    # last-k follows the feed too (the reference with a suffix mask)
    row = rows[0]
    active = [t >= len(row) - 3 for t in range(len(row))]
    last = prefill(engine, [row], gate, "last-3", return_logits=True).logits[0]
    assert torch.allclose(last, reference_latent_feedback(model, gate, row, active=active),
                          atol=ATOL), feed


@pytest.mark.parametrize("feed", FEEDS)
def test_passes_T_equals_full(model, engine, feed):
    gate = make_gate(model, feed)
    ids = random_ids(2, 8, seed=3)
    full = prefill(engine, ids, gate, "full", return_logits=True)
    jac = prefill(engine, ids, gate, "passes=8", return_logits=True)
    assert torch.allclose(jac.logits, full.logits, atol=ATOL), feed
    assert torch.allclose(jac.extras["state"], full.extras["state"], atol=ATOL), feed


@pytest.mark.parametrize("feed", FEEDS)
def test_objective_passes_equal_the_engine_passes(model, engine, feed):
    """The training objective's K-pass logits are the engine's ``passes=K`` logits."""
    gate = make_gate(model, feed)
    ids = random_ids(2, 9, seed=4)
    valid = torch.ones(2, 8, dtype=torch.bool)
    with torch.no_grad():
        _, losses, logits = multipass_loss(model.hf_model, gate, ids, valid, 4,
                                           return_logits=True)
        by_hand, _ = hf_passes(model, gate, ids, 4)
    for k in range(1, 5):
        eng = prefill(engine, ids, gate, f"passes={k}", return_logits=True)
        assert torch.allclose(logits[k - 1], eng.logits, atol=ATOL), (feed, k)
        assert torch.allclose(by_hand[k - 1], eng.logits, atol=ATOL), (feed, k)
        assert abs(losses[k - 1].item() + eng.log_probs.mean().item()) < 1e-4


def test_the_residual_feed_is_not_ignored(model, engine):
    """Same weights, other feed: other logits wherever a fused input is read."""
    normed, residual = make_gate(model, "normed"), make_gate(model, "residual")
    ids = random_ids(2, 8, seed=5)
    for regime in ("full", "passes=2", "last-2"):
        a = prefill(engine, ids, normed, regime, return_logits=True).logits
        b = prefill(engine, ids, residual, regime, return_logits=True).logits
        assert (a - b).abs().max() > 1e-2, regime
    # the first pass reads no fused input: identical
    a = prefill(engine, ids, normed, "none", return_logits=True).logits
    b = prefill(engine, ids, residual, "none", return_logits=True).logits
    assert torch.equal(a, b)


def test_on_pass_and_state_carry_the_fed_back_vector(model, engine):
    """``on_pass`` and ``.state`` see the residual (before the final norm) for a residual
    gate; ``normed`` maps it to what the unembedding reads."""
    ids = random_ids(1, 6, seed=6)
    with torch.no_grad():
        plain = model.hf_model.model(ids).last_hidden_state  # after the final norm
    seen = {}
    for feed in FEEDS:
        rec = LatentFeedback(make_gate(model, feed), model, passes=1,
                             on_pass=lambda j, step, h, f=feed: seen.setdefault(f, h))
        engine.run(ids, rec, block_size=6)  # one chunk, one pass: the plain model
        assert torch.equal(rec.state, seen[feed][:, -1])
        assert torch.allclose(rec.normed(seen[feed]), plain, atol=ATOL), feed
    assert torch.allclose(seen["normed"], plain, atol=ATOL)
    assert not torch.allclose(seen["residual"], plain, atol=1e-2)
    with torch.no_grad():
        assert torch.allclose(final_norm(model)(seen["residual"]), plain, atol=ATOL)


def test_soft_decoding_carries_the_residual(model, engine):
    """Soft decoding continues with ``.state``, the fed-back vector: greedy tokens equal
    the slow reference with feedback on from the first generated token."""
    from probekit.mechanisms.generation import generate

    gate = make_gate(model, "residual")
    prompt = random_ids(2, 5, seed=11)
    soft = generate(engine, prompt, gate=gate, regime="soft", max_new_tokens=5, eos=-1)
    for i in range(2):
        seq = prompt[i].tolist() + soft.tokens[i]
        ref = reference_latent_feedback(model, gate, seq, active=[t >= 5 for t in range(10)])
        assert ref[4:-1].argmax(-1).tolist() == soft.tokens[i]


# ------------------------------------------------------------------------ training
def test_jitter_is_added_to_the_fed_back_state(model):
    gate = make_gate(model, "residual")
    ids = random_ids(2, 7, seed=7)
    valid = torch.ones(2, 6, dtype=torch.bool)
    with torch.no_grad():
        _, _, logits = multipass_loss(model.hf_model, gate, ids, valid, 2, jitter=0.5,
                                      generator=torch.Generator().manual_seed(3),
                                      return_logits=True)
        by_hand, _ = hf_passes(model, gate, ids, 2, jitter=0.5,
                               generator=torch.Generator().manual_seed(3))
        plain, _ = hf_passes(model, gate, ids, 2)
    assert torch.allclose(logits[1], by_hand[1], atol=ATOL)
    assert (logits[1] - plain[1]).abs().max() > 1e-3  # the jitter did something


def test_residual_feed_trains_through_the_fed_back_residual(model):
    """Gradients reach the gate through the captured residual (no detach)."""
    gate = make_gate(model, "residual")
    ids = random_ids(2, 7, seed=8)
    valid = torch.ones(2, 6, dtype=torch.bool)
    _, losses, _ = multipass_loss(model.hf_model, gate, ids, valid, 3)
    g3 = torch.autograd.grad(losses[2], gate.W_U.weight)[0]
    assert g3.abs().max() > 0


def test_fixed_point_pass_feeds_the_full_prefill_state_of_either_feed(model, engine):
    """The fixed-point objective's fed pass equals ``full`` prefill for both feeds: the
    token-by-token states are taken on the side of the final norm the gate names."""
    ids = random_ids(2, 8, seed=11)
    valid = torch.ones(2, 7, dtype=torch.bool)
    for feed in FEEDS:
        gate = make_gate(model, feed)
        with torch.no_grad():
            _, _, logits = fixed_point_loss(model.hf_model, gate, ids, valid,
                                            return_logits=True)
        full = prefill(engine, ids, gate, "full", return_logits=True)
        assert torch.allclose(logits[1], full.logits, atol=ATOL), feed


# ------------------------------------------------------------------------ stability
def test_stability_update_is_of_the_fed_back_state(model, engine):
    from probekit.analysis.stability import stability_curves

    n = 4
    ids = random_ids(2, 9, seed=9)
    for feed in FEEDS:
        gate = make_gate(model, feed)
        curves = stability_curves(engine, gate, ids, n)
        with torch.no_grad():
            _, fed = hf_passes(model, gate, ids, n)
        for k in range(2, n + 1):
            want = (fed[k - 1][:, n:] - fed[k - 2][:, n:]).norm(dim=-1).mean().item()
            assert curves["update"][k - 1] == pytest.approx(want, rel=1e-4), (feed, k)
            lp = prefill(engine, ids, gate, f"passes={k}").log_probs
            assert curves["loss"][k - 1] == pytest.approx(-lp.mean().item(), abs=1e-5)


# ----------------------------------------------------------------------- checkpoints
def test_checkpoint_round_trip_keeps_the_feed(model, engine, tmp_path):
    gate = make_gate(model, "residual")
    config = TrainConfig(mode="gate", feed="residual")
    save_checkpoint(tmp_path, gate=gate, model=model, config=config, step=0)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["gate"] == {"d_model": model.d_model, "feed": "residual"}
    assert cfg["train"]["feed"] == "residual"
    loaded = load_checkpoint(tmp_path, model)
    assert loaded.gate.feed == "residual"
    ids = random_ids(1, 7, seed=10)
    assert torch.equal(prefill(engine, ids, gate, "full").log_probs,
                       prefill(engine, ids, loaded.gate, "full").log_probs)
    # resuming with a gate of the other feed is refused, before anything is loaded
    other = make_gate(model, "normed")
    opt = make_optimizer(list(other.named_parameters()), TrainConfig().resolved())
    with pytest.raises(ValueError, match="holds a gate that feeds back the residual state, "
                                         "not normed; use --feed residual"):
        restore_training(tmp_path, gate=other, model=model, config=TrainConfig(), optimizer=opt)


def test_a_checkpoint_without_feed_loads_as_normed(model, tmp_path):
    save_checkpoint(tmp_path, gate=make_gate(model, "normed"), model=model,
                    config=TrainConfig(mode="gate"), step=0)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["gate"]["feed"], cfg["train"]["feed"]  # as written before the option existed
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_checkpoint(tmp_path, model).gate.feed == "normed"


def test_bad_feed_values_are_refused(model, tmp_path):
    with pytest.raises(ValueError, match=r"^feed must be one of normed, residual; got 'pre'$"):
        FeedbackGate(model.d_model, feed="pre")
    with pytest.raises(ValueError, match="feed must be one of normed, residual; got 'post'"):
        FeedbackGate.for_model(model, feed="post")
    with pytest.raises(ValueError, match="--feed must be one of normed, residual; got 'pre'"):
        TrainConfig(feed="pre")
    # a gate and a config that disagree are not saved as one checkpoint
    with pytest.raises(ValueError, match="the gate feeds back the residual state but the "
                                         "config says --feed normed"):
        save_checkpoint(tmp_path / "a", gate=make_gate(model, "residual"), model=model,
                        config=TrainConfig(), step=0)
    assert not (tmp_path / "a").exists()
    save_checkpoint(tmp_path / "b", gate=make_gate(model, "normed"), model=model,
                    config=TrainConfig(), step=0)
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    cfg["gate"]["feed"] = "pre"
    (tmp_path / "b" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config.json has gate.feed 'pre', not one of "
                                         r"normed, residual; the checkpoint is damaged"):
        load_checkpoint(tmp_path / "b", model)


# ------------------------------------------------------------------------------ CLI
def test_train_feedback_cli_feed_flag(tmp_path, capsys):
    from probekit.commands.main import main

    args = ["train-feedback", "--mode", "gate", "--model", "tiny", "--batch-size", "2",
            "--seq-len", "12", "--n-windows", "4", "--steps", "1", "--eval-every", "0",
            "--save-every", "1", "--no-progress"]
    assert main(args + ["--feed", "pre", "--run-dir", str(tmp_path / "bad")]) == 2
    assert "--feed" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
    assert main(args + ["--feed", "residual", "--run-dir", str(tmp_path / "r")]) == 0
    ck = json.loads((tmp_path / "r" / "checkpoint" / "config.json").read_text())
    assert ck["gate"]["feed"] == "residual" and ck["train"]["feed"] == "residual"
    assert load_checkpoint(tmp_path / "r" / "checkpoint").gate.feed == "residual"
