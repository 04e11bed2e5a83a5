"""What latent-feedback training reads: Wikipedia windows (gate mode) or task rows (organism).

:class:`TrainData` holds token rows to sample batches from and fixed validation batches.
A step's batch is drawn from that step's own generator (``probekit.training.train``),
so a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor


def pad_batch(rows: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-pad ``rows`` -> (``[B, T]`` ids, ``[B, T-1]`` valid next-token targets)."""
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    lengths = torch.tensor([len(r) for r in rows])
    valid = torch.arange(1, T)[None, :] < lengths[:, None]
    return ids, valid


@dataclass
class TrainData:
    """Where batches come from: ``train`` rows sampled per step, fixed ``val`` batches."""

    train: list[list[int]]
    val: list[tuple[Tensor, Tensor]]
    pad_id: int
    description: dict = field(default_factory=dict)
    #: draw each batch from rows of similar length (variable-length rows: less padding)
    bucket: bool = False
    #: bucketed batches hold at most this many tokens (fewer rows when rows are long), so
    #: a step's cost stays bounded whatever the rows' lengths; None: always ``size`` rows
    max_tokens: int | None = None
    #: the task of each ``val`` batch (organism mode), so validation reports accuracy per
    #: task; empty: one pool (gate mode's Wikipedia windows)
    val_tasks: tuple[str, ...] = ()
    #: rows of at most this many tokens are short (organism mode: the longest validation
    #: row); ``batch(..., rows="short")`` draws only those, ``rows="long"`` only the others;
    #: None: every row is short
    short_len: int | None = None
    #: organism mode with completion: ``(model, size, generator, rows) -> rows`` of the
    #: pairs the model holds closest now (``--close-pairs``), at every training length
    #: (``rows="all"``) or at the validation rows' (``"short"``); None: no such batches
    close_rows: Callable[[Any, int, torch.Generator, str], list[list[int]]] | None = None

    def __post_init__(self) -> None:
        self._by_length = sorted(range(len(self.train)), key=lambda i: len(self.train[i]))
        self.n_short = (len(self.train) if self.short_len is None else
                        sum(len(r) <= self.short_len for r in self.train))

    def batch(self, size: int, generator: torch.Generator,
              rows: Literal["all", "short", "long"] = "all") -> tuple[Tensor, Tensor]:
        """``size`` rows (fewer when bucketed rows exceed ``max_tokens``) of ``rows``: every
        row, the short ones (at most ``short_len`` tokens) or the long ones. Each takes the
        same draws from the generator, so a choice of rows at one step leaves the random
        streams of the others alone."""
        lo, hi = {"all": (0, len(self.train)), "short": (0, self.n_short),
                  "long": (self.n_short, len(self.train))}[rows]
        if self.bucket:  # `size` neighbours in length order, from a random start
            start = int(torch.randint(lo, hi, (1,), generator=generator))
            idx = self._by_length[start: min(start + size, hi)]  # shorter at the long
            if self.max_tokens is not None:                       # end: every row can
                fit = max(1, self.max_tokens // len(self.train[idx[-1]]))  # be drawn
                idx = idx[:fit]  # keep the shortest rows that fit the budget
        else:  # uniform draws; the length order's first n_short rows are the short ones
            pick = range(len(self.train)) if rows == "all" else self._by_length
            idx = [pick[i] for i in torch.randint(lo, hi, (size,), generator=generator).tolist()]
        return pad_batch([self.train[i] for i in idx], self.pad_id)

    def close_batch(self, model, size: int, generator: torch.Generator,
                    rows: Literal["all", "short"] = "all") -> tuple[Tensor, Tensor]:
        """A batch of :attr:`close_rows` (``--close-pairs``), padded as :meth:`batch`'s."""
        return pad_batch(self.close_rows(model, size, generator, rows), self.pad_id)


def gate_data(model, seq_len: int, *, n_windows: int = 2048, val_windows: int = 16) -> TrainData:
    """Wikipedia windows of ``seq_len`` tokens; the last ``val_windows`` are held out."""
    from probekit.data.corpora import load_corpus, make_windows

    docs, chars = [], 0
    need = 8 * (n_windows + val_windows) * seq_len  # chars; ~4 per token, 2x spare
    for doc in load_corpus("wiki"):  # tokenize only as much text as the windows need
        docs.append(doc)
        chars += len(doc.text)
        if chars >= need:
            break
    windows = make_windows(docs, model.tokenizer, seq_len, None, bos=False,
                           max_tokens=model.n_ctx)
    if len(windows) < val_windows + 1:
        raise ValueError(f"the corpus has only {len(windows)} windows of {seq_len} tokens; "
                         f"lower --seq-len")
    rows = [w.input_ids for w in windows]
    train_rows, val_rows = rows[: -val_windows][:n_windows], rows[-val_windows:]
    val = [pad_batch(val_rows[i: i + 8], 0) for i in range(0, len(val_rows), 8)]
    return TrainData(train_rows, val, pad_id=0,
                     description={"corpus": "wiki", "train_windows": len(train_rows),
                                  "val_windows": len(val_rows), "seq_len": seq_len})


def organism_data(tokenizer, *, tasks: Sequence[str], n_examples: int, seed: int,
                  distractors: Sequence[int] | None = None,
                  max_tokens: int | None = None, copy_share: float = 0.0,
                  copy_from: int = 10, long_rows: float = 1.0,
                  recall_share: float = 0.0) -> TrainData:
    """Task inputs + label words, numeral copy rows of ``copy_from..99`` if ``copy_share``
    and numeral recall rows if ``recall_share``
    (:func:`probekit.training.organism.training_examples`); the validation
    batches are the default probe sets with their labels. Without ``distractors`` the
    null-update counts are weighted by
    :func:`probekit.training.organism.train_distractors` of ``long_rows``."""
    from probekit.training.numerals import close_pair_rows
    from probekit.training.organism import (
        PROBE_DISTRACTORS,
        held_out_pairs,
        probe_rows_by_task,
        train_distractors,
        training_examples,
    )

    kw = {"distractors": train_distractors(long_rows) if distractors is None
          else tuple(distractors)}
    weights = kw["distractors"]
    weights = weights if isinstance(weights, dict) else dict.fromkeys(weights, 1.0)
    by_rows = {"all": weights,  # "short": the validation rows' counts
               "short": {d: w for d, w in weights.items() if d <= max(PROBE_DISTRACTORS)}}
    close = None
    if "completion" in tasks:
        held_out = held_out_pairs(tokenizer)

        def close(model, size: int, generator: torch.Generator, rows: str) -> list[list[int]]:
            return close_pair_rows(model, size, generator, held_out=held_out,
                                   distractors=by_rows[rows], max_tokens=max_tokens)

    rows = training_examples(tokenizer, tasks, n_examples=n_examples, seed=seed + 1,
                             copy_share=copy_share, copy_from=copy_from,
                             recall_share=recall_share, **kw)
    pad = tokenizer.pad_token_id
    val, val_tasks = [], []
    for task, task_rows in probe_rows_by_task(tokenizer, tasks).items():
        task_rows = sorted(task_rows, key=len)  # similar lengths per batch
        batches = [pad_batch(task_rows[i: i + 32], pad) for i in range(0, len(task_rows), 32)]
        val += batches
        val_tasks += [task] * len(batches)
    return TrainData(rows, val, pad_id=pad, bucket=True, max_tokens=max_tokens,
                     val_tasks=tuple(val_tasks), short_len=max(ids.shape[1] for ids, _ in val),
                     close_rows=close,
                     description={"tasks": list(tasks), "train_examples": len(rows),
                                  "val_examples": sum(len(ids) for ids, _ in val),
                                  **({"copy_rows": int(n_examples * copy_share),
                                      "copy_numerals": f"{copy_from}..99"}
                                     if copy_share else {}),
                                  **({"recall_rows": int(n_examples * recall_share)}
                                     if recall_share else {})})
