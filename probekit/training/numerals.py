"""The completion task's numerals (10..99) as an organism holds them: how far apart their
embeddings lie (:func:`numeral_cosines`), the inputs Eq. 4's gate makes of them under
``full`` prefill (:func:`fused_numerals`), and the training rows of the pairs it holds
closest (:func:`close_pair_rows`, ``--close-pairs``).

An organism's completion misses are false "done" on pairs it holds close, ranked by
closeness (docs/latent-feedback.md, "What the gate does to the numerals"), so these are
what the diagnostics measure and what ``--close-pairs`` trains on.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor

from synthetic.completion import LABEL_WORDS, NUMERALS, completion_text


def cosines(x: Tensor) -> np.ndarray:
    """``[..., n, n]`` float32 cosines between the rows of ``x`` ``[..., n, D]``."""
    unit = torch.nn.functional.normalize(x.float(), dim=-1)
    return (unit @ unit.transpose(-1, -2)).numpy()


def numeral_embeddings(model) -> Tensor:
    """``[90, D]`` input embeddings of the numerals 10..99 (one token each), detached."""
    ids = [model.tokenizer.convert_tokens_to_ids(str(n)) for n in NUMERALS]
    return model.hf_model.get_input_embeddings().weight.detach()[ids]


def numeral_cosines(model) -> np.ndarray:
    """``[90, 90]`` cosine similarities between the input embeddings of the completion
    task's numerals (10..99): how far apart the model keeps the symbols that completion
    must tell apart (near 0 at initialisation)."""
    return cosines(numeral_embeddings(model))


@torch.no_grad()
def fused_numerals(model, gate) -> tuple[Tensor, Tensor]:
    """The inputs the completion task's numerals (10..99) get under ``full`` prefill: Eq. 4's
    fusion of the top state before each numeral with its embedding.

    Returns ``(required, completed)``: ``required[n]`` ``[90, D]`` is numeral ``n``'s input
    after ``required =`` (the same in every row: the state before it depends on those two
    tokens only); ``completed[a, n]`` ``[90, 90, D]`` is numeral ``n``'s input after
    ``required = a`` and ``completed =``. The token enters only as the gate's multiplicative
    pattern on the carried state (the paper, Sec. 3.1), so these inputs show how much of a
    numeral's identity the organism's own inputs keep."""
    from probekit.core.engine import StepEngine
    from probekit.mechanisms.latent_feedback import prefill

    tok, engine = model.tokenizer, StepEngine(model)
    emb = numeral_embeddings(model)

    def top_state(texts: list[str]) -> Tensor:  # h of each text's last token under full
        rows = tok(texts, add_special_tokens=False)["input_ids"]
        return prefill(engine, rows, gate, "full").extras["state"]

    h_required = top_state(["required ="])  # [1, D]
    h_completed = top_state([f"required = {a}\ncompleted =" for a in NUMERALS])  # [90, D]
    required = gate(h_required.expand(len(emb), -1), emb).float()
    completed = gate(h_completed[:, None, :], emb[None, :, :]).float()
    return required, completed


#: How many of the closest training pairs ``--close-pairs`` batches draw from: about the
#: closest tenth of the 4,005, since the misses spread over many pairs, ranked by
#: closeness (why this size: docs/latent-feedback.md, "Training on the pairs the organism
#: holds closest").
CLOSE_POOL = 400


def close_pairs(model, held_out: set[frozenset[int]], n: int = CLOSE_POOL) -> list[tuple[int, int]]:
    """The ``n`` numeral pairs ``(a, b)``, ``a < b``, whose input embeddings the model holds
    closest (largest cosine first), held-out pairs left out: the pairs an organism most
    often answers "done" for although they differ (docs/latent-feedback.md, "What the
    gate does to the numerals")."""
    cos = numeral_cosines(model)
    upper = [(cos[i, j], NUMERALS[i], NUMERALS[j]) for i in range(len(NUMERALS))
             for j in range(i + 1, len(NUMERALS))
             if frozenset((NUMERALS[i], NUMERALS[j])) not in held_out]
    return [(a, b) for _, a, b in sorted(upper, key=lambda t: -t[0])[:n]]


def close_pair_rows(model, size: int, generator: torch.Generator, *,
                    held_out: set[frozenset[int]], distractors: Mapping[int, float],
                    max_tokens: int | None = None) -> list[list[int]]:
    """Training rows (input + ``" " + label``) of the completion groups, all four
    assignments, of pairs drawn from :func:`close_pairs` of the model as it is now: one
    null-update count per batch, drawn by its weight in ``distractors``; ``size`` rows,
    fewer when ``max_tokens`` holds fewer of that length (the rows shuffled first, so
    both labels stay equally likely). Every draw comes from ``generator``."""
    pool = close_pairs(model, held_out)
    counts = list(distractors)
    weights = torch.tensor([float(distractors[d]) for d in counts])
    d = counts[int(torch.multinomial(weights, 1, generator=generator))]
    picks = torch.randint(len(pool), (-(-size // 4),), generator=generator).tolist()
    scratch = torch.randint(10, (len(picks),), generator=generator).tolist()
    texts = []
    for k, s in zip(picks, scratch, strict=True):
        a, b = pool[k]
        for required, completed in ((a, b), (a, a), (b, a), (b, b)):
            label = LABEL_WORDS[int(required == completed)]
            texts.append(completion_text(required, completed, s, d) + " " + label)
    order = torch.randperm(len(texts), generator=generator).tolist()
    rows = model.tokenizer([texts[i] for i in order], add_special_tokens=False)["input_ids"]
    fit = size if max_tokens is None else max(1, min(size, max_tokens // len(rows[0])))
    return [list(r) for r in rows[:fit]]
