"""Decoding with or without latent feedback (full-bandwidth paper Sec. 4.2, Fig. 2 right).

    from probekit.mechanisms.generation import generate
    out = generate(engine, prompt_ids, gate=gate, regime="soft", max_new_tokens=64)
    out.tokens[0]          # the new token ids of prompt 0 (up to and including EOS)

Three decoding regimes (SEMANTICS.md "Latent feedback"):

- ``standard``: one plain prefill; every generated token enters as its embedding.
- ``soft``: one plain prefill; every generated token enters fused with the previous
  position's top state (Eq. 3). The prompt keeps plain inputs (the heterogeneous
  prompt-then-generation regime that prefix mixin trains for).
- ``fused``: one extra fused prefill pass (``passes=2``, Eq. 10) whose keys/values,
  logits and last state replace the plain ones; then as ``soft``.

Every step continues the step engine's own KV cache (``start``, ``cache``): one
position per step, so the per-token work is the plain model's plus, for ``soft`` and
``fused``, the final norm and two ``D x D`` products of the gate (Sec. 3.1, "free to
serve"; ``benchmarks/bench_latent_feedback.py`` measures it).

Sampling: ``temperature=0`` is greedy (argmax); ``temperature > 0`` samples from
``softmax(logits / temperature)``, restricted to the smallest set of tokens whose
probability reaches ``top_p`` (nucleus sampling; ``top_p=1`` keeps all). A row stops at
its first ``eos`` token; generation stops when every row has stopped or after
``max_new_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from tqdm.auto import tqdm

from probekit.core.engine import StepEngine
from probekit.mechanisms.latent_feedback import FeedbackGate, LatentFeedback, prefill

DECODING = ("standard", "soft", "fused")


@dataclass
class Generation:
    """The outcome of :func:`generate`.

    Attributes:
        tokens: the new token ids of every prompt, up to and including its EOS.
        finished: whether each row stopped at EOS (False: it ran out of tokens).
        prompt_length: the common prompt length ``T``.
    """

    tokens: list[list[int]]
    finished: list[bool]
    prompt_length: int

    def texts(self, tokenizer) -> list[str]:
        return [tokenizer.decode(t) for t in self.tokens]


def sample_next(logits: Tensor, temperature: float, top_p: float,
                generator: torch.Generator | None = None) -> Tensor:
    """``[batch, vocab]`` logits -> ``[batch]`` next tokens (greedy when temperature is 0)."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, -1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        # keep a token if the mass strictly before it is < top_p (the top token always stays)
        keep = (sorted_p.cumsum(-1) - sorted_p) < top_p
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, generator=generator)[:, 0]


def _check(engine: StepEngine, prompt_ids, gate, regime, max_new_tokens, temperature,
           top_p) -> Tensor:
    if regime not in DECODING:
        raise ValueError(f"regime must be one of {DECODING}; got {regime!r}")
    if regime != "standard" and gate is None:
        raise ValueError(f"decoding regime {regime!r} needs a feedback gate (--checkpoint)")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1; got {max_new_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy); got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must lie in (0, 1]; got {top_p}")
    rows = prompt_ids.tolist() if isinstance(prompt_ids, Tensor) else [list(r) for r in prompt_ids]
    if rows and not isinstance(rows[0], list):
        rows = [rows]
    if len({len(r) for r in rows}) > 1:
        raise ValueError(
            f"prompts must all have the same length to decode together; got lengths "
            f"{sorted({len(r) for r in rows})} (generate them one at a time)"
        )
    ids, _ = engine.batch(rows)
    if ids.shape[1] + max_new_tokens > engine.n_ctx:
        raise ValueError(
            f"prompt of {ids.shape[1]} tokens + max_new_tokens={max_new_tokens} exceeds the "
            f"model's context of {engine.n_ctx}"
        )
    return ids


@torch.no_grad()
def generate(
    engine: StepEngine,
    prompt_ids: Tensor | Sequence[Sequence[int]],
    *,
    gate: FeedbackGate | None = None,
    regime: str = "standard",
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos: int | None = None,
    seed: int = 0,
    progress: bool = False,
) -> Generation:
    """Decode from equal-length prompts under ``regime`` (module docstring).

    Args:
        eos: the stop token (default: the tokenizer's ``eos_token_id``; None never stops).
        seed: seeds the sampler (``temperature > 0``).
    """
    ids = _check(engine, prompt_ids, gate, regime, max_new_tokens, temperature, top_p)
    if eos is None:
        eos = getattr(engine.model.tokenizer, "eos_token_id", None)
    batch, T = ids.shape
    generator = torch.Generator().manual_seed(seed)
    first = "passes=2" if regime == "fused" else "none"
    res = prefill(engine, ids, gate if regime != "standard" else None, first,
                  return_logits=True, return_cache=True)
    cache = res.cache.copy(max_len=T + max_new_tokens)
    state = res.extras["state"]
    logits = res.logits[:, -1]
    seq = torch.cat([ids, torch.zeros(batch, max_new_tokens, dtype=torch.long)], 1)
    new: list[list[int]] = [[] for _ in range(batch)]
    done = torch.zeros(batch, dtype=torch.bool)
    for i in tqdm(range(max_new_tokens), desc="decode", unit="tok", disable=not progress,
                  leave=False):
        tok = sample_next(logits, temperature, top_p, generator)
        t = T + i
        seq[:, t] = tok
        for r in range(batch):
            if not done[r]:
                new[r].append(int(tok[r]))
        if eos is not None:
            done |= tok == eos
        if bool(done.all()) or i == max_new_tokens - 1:
            break
        rec = None
        if regime != "standard":
            rec = LatentFeedback(gate, engine.model, initial_state=state)
        step = engine.run(seq[:, : t + 1], rec, start=t, cache=cache, return_logits=True)
        logits = step.logits[:, t]
        if rec is not None:
            state = rec.state
    return Generation(new, done.tolist(), T)
