"""The match hint: a loss that teaches register lookups by pulling attention heads onto
what a lookup reads (docs/latent-feedback.md, "Multi-register state").

A register row asks ``query = r5`` / ``Value:`` for the digit of the latest ``r5 = 1``
before it. Organisms trained on these rows learn, in part, the two inputs of that lookup
(the name of its register at each digit, the queried name at the colon) but, from
scratch, not the match of the two: they stay at the shortcut "the latest write, whatever
the register" for thousands of steps (experiments/register_parts.py). Intervening on
attention ends such plateaus (Gopalani and Hu 2025, "What happens during the loss
plateau?"), so with ``--match-hint W`` the trainer adds, for the first
``--match-hint-steps`` steps, ``W`` (decayed linearly to zero) times
:func:`match_hint_loss`, the mean ``-log`` attention along the edges of the lookup
circuit (:data:`EDGES`):

- ``match`` (head 0 of the last block): each ``Value:`` colon on the digit it asks for;
- with ``--match-hint-parts circuit`` also ``query`` (head 0 of block 0): each colon on the
  queried name (``query = r5``), and ``name`` (head 1 of block 0): each written digit on
  its register's name (``r5 = 1``).

The hint only shapes where the heads look; what they read there and how the answer is
written stay the next-token loss's to learn, and after the hint's last step the organism
trains as any other.
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import Tensor

#: The circuit's edges: name -> (block, head); block -1 is the last.
EDGES = {"match": (-1, 0), "query": (0, 0), "name": (0, 1)}
#: The edges each ``--match-hint-parts`` trains.
PARTS = {"match": ("match",), "circuit": ("match", "query", "name")}


def fits(parts: str, n_blocks: int, n_heads: int) -> bool:
    """Whether a model of ``n_blocks`` blocks of ``n_heads`` heads has every head the edges
    of ``parts`` name as distinct heads (the last block and block 0 must differ)."""
    edges = [EDGES[edge] for edge in PARTS[parts]]
    blocks = {block % n_blocks for block, _ in edges}
    return (len(blocks) == len({block for block, _ in edges})
            and max(head for _, head in edges) < n_heads)


@dataclasses.dataclass(frozen=True)
class RegisterTokens:
    """Token ids of the register rows' words that locate a lookup."""

    names: frozenset[int]
    equals: int
    query: int
    value: int
    colon: int

    @classmethod
    def of(cls, tokenizer) -> RegisterTokens:
        """The ids in ``tokenizer``: every word ``r<digits>`` of its vocabulary is a name
        (the organism's r0..r15)."""
        ids = tokenizer.convert_tokens_to_ids
        names = frozenset(i for word, i in tokenizer.get_vocab().items()
                          if re.fullmatch(r"r\d+", word))
        return cls(names, ids("="), ids("query"), ids("Value"), ids(":"))


#: One edge's targets: (row, attending position, attended position), each ``[N]``.
Targets = tuple[Tensor, Tensor, Tensor]


def match_targets(ids: Tensor, tokens: RegisterTokens) -> dict[str, Targets]:
    """Every edge of every lookup in a batch ``ids`` ``[B, T]``: ``match`` from each
    ``Value:`` colon to the digit after the latest ``rX =`` before the ``query = rX`` it
    answers, ``query`` from that colon to the ``rX`` of the query, ``name`` from each
    written digit to its register's name. Rows of other tasks, and questions about a
    register never written, give none."""
    found: dict[str, list[tuple[int, int, int]]] = {edge: [] for edge in EDGES}
    for b, row in enumerate(ids.tolist()):
        latest: dict[int, int] = {}
        asked = None  # the position of the queried name
        for t in range(len(row) - 2):
            word, after = row[t], row[t + 1]
            if word in tokens.names and after == tokens.equals:
                latest[word] = t + 2
                found["name"].append((b, t + 2, t))
            elif word == tokens.query and after == tokens.equals:
                asked = t + 2
            elif (word == tokens.value and after == tokens.colon and asked is not None
                  and row[asked] in latest):
                found["match"].append((b, t + 1, latest[row[asked]]))
                found["query"].append((b, t + 1, asked))
                asked = None
    return {edge: tuple(torch.tensor([e[i] for e in hits], dtype=torch.long)
                        for i in range(3)) for edge, hits in found.items()}


def attention_loss(attentions: tuple[Tensor, ...], targets: dict[str, Targets],
                   parts: str = "match") -> Tensor:
    """Mean over the edges of ``parts`` (:data:`PARTS`) that have targets of the mean
    ``-log`` attention of the edge's head on its targets; ``attentions`` per block
    ``[B, heads, T, T]`` (an HF model's ``output_attentions``). 0 when no edge has any."""
    losses = []
    for edge in PARTS[parts]:
        rows, at, to = targets[edge]
        if len(rows):
            block, head = EDGES[edge]
            weight = attentions[block][rows, head, at, to]
            losses.append(-weight.clamp_min(1e-9).log().mean())
    return torch.stack(losses).mean() if losses else attentions[0].new_zeros(())


def match_hint_loss(hf_model, ids: Tensor, targets: dict[str, Targets],
                    parts: str = "match") -> Tensor:
    """:func:`attention_loss` of the plain pass over ``ids``: one forward with eager
    attention (the only kind that returns its weights), the model's attention put back
    after (no forward when no edge of ``parts`` has a target: 0)."""
    if not any(len(targets[edge][0]) for edge in PARTS[parts]):
        return torch.zeros(())
    kept = hf_model.config._attn_implementation
    hf_model.set_attn_implementation("eager")
    try:
        out = hf_model.model(ids, use_cache=False, output_attentions=True)
    finally:
        hf_model.set_attn_implementation(kept)
    return attention_loss(out.attentions, targets, parts)


def hint_weight(step: int, weight: float, steps: int) -> float:
    """``weight`` at step 0, decayed linearly to zero at ``steps``."""
    return weight * max(0.0, 1 - step / steps)
