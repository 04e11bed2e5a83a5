"""The match hint (probekit.training.match_hint): which lookups it finds in a batch, the
attention it reads, its decay, its place in the trainer and its flags' errors."""

from __future__ import annotations

import math

import pytest
import torch

from probekit.training.config import OrganismConfig, TrainConfig
from probekit.training.match_hint import (
    EDGES,
    RegisterTokens,
    fits,
    hint_weight,
    match_hint_loss,
    match_targets,
)
from probekit.training.organism import build_organism, fit_tokenizer
from probekit.training.organism_cache import Recipe, train_organism

TOK = fit_tokenizer()
LOOKUPS = RegisterTokens.of(TOK)


def batch(*texts: str) -> torch.Tensor:
    from probekit.training.data import pad_batch

    return pad_batch(TOK(list(texts), add_special_tokens=False)["input_ids"],
                     TOK.pad_token_id)[0]


def test_match_targets_are_each_lookups_edges():
    ids = batch(
        # an overwrite, an intermediate read, a scratch line and the pad line
        "r1 = 1\nr0 = 0\nquery = r1\nValue: one\nr1 = 0\nscratch = 1\n# pad pad\n"
        "query = r1\nValue: zero",
        "required = 24\ncompleted = 99\nscratch = 1\nStatus: done",  # another task's row
        "r2 = 1\nquery = r3\nValue: one",  # a register never written: no lookup
    )
    assert LOOKUPS.names == frozenset(TOK.convert_tokens_to_ids([f"r{i}" for i in range(16)]))
    edges = match_targets(ids, LOOKUPS)
    words = TOK.convert_ids_to_tokens(ids[0].tolist())
    rows, colons, digits = edges["match"]
    assert rows.tolist() == [0, 0]
    assert [words[c - 1:c + 1] for c in colons.tolist()] == [["Value", ":"]] * 2
    assert digits.tolist() == [2, 18]  # the first r1 = 1, then the overwrite r1 = 0
    assert [words[d - 2:d + 1] for d in digits.tolist()] == [["r1", "=", "1"],
                                                             ["r1", "=", "0"]]
    rows, at, to = edges["query"]  # the same colons, on the name each query asks for
    assert (rows.tolist(), at.tolist()) == ([0, 0], colons.tolist())
    assert [words[n - 2:n + 1] for n in to.tolist()] == [["query", "=", "r1"]] * 2
    rows, at, to = edges["name"]  # every written digit, on its register's name
    assert rows.tolist() == [0, 0, 0, 2]
    assert (to + 2).tolist() == at.tolist() == [2, 6, 18, 2]
    assert TOK.convert_ids_to_tokens(ids[rows, to].tolist()) == ["r1", "r0", "r1", "r2"]


def test_match_hint_loss_is_minus_log_the_hinted_heads_attention_on_each_digit():
    model = build_organism(TOK, OrganismConfig(n_blocks=2, d_model=32, n_heads=2), seed=1)
    ids = batch("r1 = 1\nr0 = 0\nquery = r1\nValue: one", "r0 = 1\nquery = r0\nValue: one")
    targets = match_targets(ids, LOOKUPS)
    match, circuit = (match_hint_loss(model, ids, targets, parts)
                      for parts in ("match", "circuit"))
    assert model.config._attn_implementation == "sdpa"  # put back after the eager forward
    model.set_attn_implementation("eager")
    attentions = model(ids, output_attentions=True).attentions

    def edge_loss(edge: str) -> float:
        block, head = EDGES[edge]
        logs = [-math.log(attentions[block][r, head, a, t].item())
                for r, a, t in zip(*(v.tolist() for v in targets[edge]))]
        return sum(logs) / len(logs)

    assert (EDGES["match"], EDGES["query"], EDGES["name"]) == ((-1, 0), (0, 0), (0, 1))
    assert match.item() == pytest.approx(edge_loss("match"), rel=1e-5)
    assert circuit.item() == pytest.approx(
        sum(map(edge_loss, ("match", "query", "name"))) / 3, rel=1e-5)
    assert match.requires_grad and circuit.requires_grad
    none = match_targets(batch("required = 24\nStatus: done"), LOOKUPS)
    assert match_hint_loss(model, ids, none, "circuit").item() == 0.0


def test_fits_asks_for_the_distinct_blocks_and_heads_the_edges_name():
    assert fits("match", 1, 1) and fits("circuit", 2, 2)
    assert not fits("circuit", 1, 4) and not fits("circuit", 4, 1)


def test_hint_weight_decays_linearly_to_zero():
    assert [hint_weight(s, 2.0, 100) for s in (0, 50, 100, 150)] == [2.0, 1.0, 0.0, 0.0]


def tiny_recipe(**train) -> Recipe:
    return Recipe.default(0, tasks=("registers",),
                          shape=OrganismConfig(n_blocks=2, d_model=32, n_heads=2),
                          n_examples=400, steps=40, batch_size=16, warmup=5,
                          feedback_start=10, eval_every=0, **train)


def test_the_trainer_hints_the_first_steps_only_and_the_hint_trains_the_head(tmp_path):
    hinted = train_organism(tiny_recipe(match_hint=5.0, match_hint_steps=30),
                            tmp_path / "hinted", progress=False)["history"]
    plain = train_organism(tiny_recipe(), tmp_path / "plain", progress=False)["history"]
    steps = [h for h in hinted if "passes" in h]
    losses = [h.get("match_hint_loss") for h in steps]
    assert None not in losses[:30] and set(losses[30:]) == {None}
    assert sum(losses[25:30]) < 0.5 * sum(losses[:5])  # the head learns to look there
    # the hint draws nothing: the first step's batch, pass count and losses are the same
    first = next(h for h in plain if "passes" in h)
    assert (steps[0]["passes"], steps[0]["pass_losses"]) == (first["passes"],
                                                            first["pass_losses"])
    assert steps[0]["loss"] > first["loss"]  # the hint's loss is added to it


def test_match_hint_flags_refuse_what_they_cannot_do():
    with pytest.raises(ValueError, match=(r"^--match-hint trains the organism's register "
                                          r"lookups; it needs --mode organism$")):
        TrainConfig(mode="gate", match_hint=1.0)
    with pytest.raises(ValueError, match=(r"^--match-hint-steps sets how long the match hint "
                                          r"trains; it needs --mode organism and "
                                          r"--match-hint > 0$")):
        TrainConfig(mode="organism", match_hint_steps=100)
    with pytest.raises(ValueError, match=r"^--match-hint must be a finite number >= 0; "
                                         r"got -1.0$"):
        TrainConfig(mode="organism", match_hint=-1.0)
    with pytest.raises(ValueError, match=r"^--match-hint-steps must be a positive integer; "
                                         r"got 0$"):
        TrainConfig(mode="organism", match_hint=1.0, match_hint_steps=0)
    with pytest.raises(ValueError, match=(r"^--match-hint-parts circuit chooses the heads "
                                          r"the match hint trains; it needs --mode organism "
                                          r"and --match-hint > 0$")):
        TrainConfig(mode="organism", match_hint_parts="circuit")
    with pytest.raises(ValueError, match=(r"^--match-hint-parts circuit trains heads 0 and 1 "
                                          r"of block 0 and head 0 of the last block; it needs "
                                          r"--n-blocks and --n-heads >= 2$")):
        Recipe.default(0, tasks=("registers",), shape=OrganismConfig(n_blocks=1),
                       match_hint=1.0, match_hint_parts="circuit")
    with pytest.raises(ValueError, match=(r"^--match-hint trains register lookups; it needs "
                                          r"registers among --tasks \(got completion "
                                          r"memory\)$")):
        Recipe.default(0, match_hint=1.0)
    assert Recipe.default(0).key() == Recipe.default(0, match_hint=0.0).key()
    assert Recipe.default(0, tasks=("registers",), match_hint=1.0).key() != \
        Recipe.default(0, tasks=("registers",)).key()
