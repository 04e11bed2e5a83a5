"""Data model, validator and token-exact padding for the synthetic state-tracking tasks.

Every task of ``synthetic`` (paper: latent-feedback-full-bandwidth-transformer.md, App. F)
returns a :class:`Dataset` of :class:`Example` s. The paper's invariants, which
``validate`` enforces for a given tokenizer (SEMANTICS.md, "Synthetic tasks"):

- every example ends with the same final token (the shared colon the probe reads);
- no label token occurs in any input ("the target token itself is never included"):
  neither ``" done"`` nor, where it is one token, bare ``"done"``;
- each label word is a single token of the tokenizer (as it would follow the colon,
  i.e. with a leading space: ``" done"``);
- where the task fixes a length, every input is exactly that many tokens;
- matched pairs (``Example.pair``) are two examples of one group with opposite labels
  and the same token count, so a patching experiment can align them position by position.

Lengths are counted in the tokens of the model in use, **without** special tokens:
``len(tokenizer(text, add_special_tokens=False).input_ids)``. A tokenizer that prepends
a BOS token therefore feeds the model one more position than the stated length.

Padding (register sweeps, "padded to exactly 180 tokens") inserts a block of extra null
updates ``scratch += 0`` and then, for the remainder, one comment line of single filler
tokens ``# pad pad ...`` (a one-token remainder, which that line cannot fill, becomes a
line holding one space); the block is measured and checked in the tokenizer given.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: Numbers of semantically null scratch updates the paper appends (App. F).
DISTRACTOR_COUNTS: tuple[int, ...] = (0, 8, 32, 128, 256)

#: The semantically null scratch update used as distractor and as padding.
NULL_UPDATE = "scratch += 0"

#: One filler token for the remainder of a padding block (measured, not assumed).
FILLER_WORD = " pad"


def filler_line(words: int) -> str:
    """The remainder line of a padding block: ``#`` and ``words`` filler words."""
    return "#" + FILLER_WORD * words + "\n"


@dataclass(frozen=True)
class Example:
    """One input of a synthetic task.

    Args:
        text: the input; it ends with the shared final token (a colon) and no newline.
        label: the target word (e.g. ``"done"``); the model's next token would be
            ``" " + label``.
        label_id: the class index, ``dataset.label_words.index(label)``.
        group: cross-validation group (numeral pair, scratch context or schedule); no
            group may be split between train and test.
        pair: id shared with the matched partner (same group, opposite label, differs
            only in the state-determining content), or -1 when unpaired.
        task: task name.
        condition: the generation condition, e.g. ``{"distractors": 8}`` or
            ``{"m": 4, "query": 2, "complement": False}``.
    """

    text: str
    label: str
    label_id: int
    group: int
    pair: int = -1
    task: str = ""
    condition: dict[str, Any] = field(default_factory=dict)


@dataclass
class Dataset:
    """The examples of one task (one sweep condition), with their label words.

    Args:
        task: task name.
        label_words: the label word of each class, indexed by ``Example.label_id``.
        examples: the examples, in generation order (group-major).
        length: the exact token count every input must have, or None.
        metadata: generation parameters (seed, sizes, paper section), JSON-friendly.
    """

    task: str
    label_words: tuple[str, ...]
    examples: list[Example]
    length: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.examples)

    def __iter__(self) -> Iterator[Example]:
        return iter(self.examples)

    def __getitem__(self, i: int) -> Example:
        return self.examples[i]

    @property
    def texts(self) -> list[str]:
        """The inputs (a list, so it can go straight into a tokenizer)."""
        return [ex.text for ex in self.examples]

    @property
    def labels(self) -> np.ndarray:
        """Class index of every example, int64 ``[n_examples]``."""
        return np.array([ex.label_id for ex in self.examples], dtype=np.int64)

    @property
    def groups(self) -> np.ndarray:
        """Group id of every example, int64 ``[n_examples]``."""
        return np.array([ex.group for ex in self.examples], dtype=np.int64)

    @property
    def pairs(self) -> np.ndarray:
        """Matched-pair id of every example (-1 when unpaired), int64 ``[n_examples]``."""
        return np.array([ex.pair for ex in self.examples], dtype=np.int64)

    def filter(self, **condition: Any) -> Dataset:
        """The examples whose condition has all the given values, e.g. ``distractors=8``."""
        kept = [
            ex for ex in self.examples
            if all(ex.condition.get(k) == v for k, v in condition.items())
        ]
        return Dataset(self.task, self.label_words, kept, self.length,
                       {**self.metadata, "filter": condition})


def token_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def n_tokens(tokenizer: Any, text: str) -> int:
    """Length of ``text`` in tokens, without special tokens (the unit of every length)."""
    return len(token_ids(tokenizer, text))


def label_token_ids(tokenizer: Any, label_words: Sequence[str]) -> list[int]:
    """The single token id of ``" " + word`` for each label word.

    Raises:
        ValueError: if a label word is not a single token in this tokenizer.
    """
    ids = []
    for word in label_words:
        toks = token_ids(tokenizer, " " + word)
        if len(toks) != 1:
            raise ValueError(
                f"label word {word!r} must be a single token after a space in this "
                f"tokenizer; ' {word}' is {len(toks)} tokens {toks}"
            )
        ids.append(toks[0])
    return ids


def _forbidden_ids(tokenizer: Any, label_words: Sequence[str]) -> dict[int, str]:
    """Token ids an input must not contain: ``" word"`` and, if one token, bare ``"word"``."""
    forbidden = {i: " " + w for i, w in zip(label_token_ids(tokenizer, label_words), label_words)}
    for word in label_words:
        bare = token_ids(tokenizer, word)
        if len(bare) == 1:
            forbidden[bare[0]] = word
    return forbidden


def validate(dataset: Dataset, tokenizer: Any) -> None:
    """Check the task invariants (module docstring) for ``tokenizer``.

    Raises:
        ValueError: naming the first offending example (index, group) and the rule broken.
    """
    name = f"{dataset.task!r}"
    if not dataset.examples:
        raise ValueError(f"dataset {name} has no examples")
    forbidden = _forbidden_ids(tokenizer, dataset.label_words)
    ids = [token_ids(tokenizer, text) for text in dataset.texts]
    final = ids[0][-1] if ids[0] else -1
    for i, (ex, toks) in enumerate(zip(dataset.examples, ids)):
        where = f"dataset {name}, example {i} (group {ex.group})"
        if not 0 <= ex.label_id < len(dataset.label_words) or (
            dataset.label_words[ex.label_id] != ex.label
        ):
            raise ValueError(
                f"{where}: label {ex.label!r} does not match label_id {ex.label_id} "
                f"of label_words {dataset.label_words}"
            )
        if not toks:
            raise ValueError(f"{where}: input is empty")
        if toks[-1] != final:
            raise ValueError(
                f"{where}: ends with token {tokenizer.decode(toks[-1:])!r} but example 0 ends with "
                f"{tokenizer.decode([final])!r}; every example must end with the same final token"
            )
        leaked = sorted(set(toks) & forbidden.keys())
        if leaked:
            raise ValueError(
                f"{where}: input contains the label token {forbidden[leaked[0]]!r} "
                f"(id {leaked[0]}); the target token must never appear in the input"
            )
        if dataset.length is not None and len(toks) != dataset.length:
            raise ValueError(
                f"{where}: input is {len(toks)} tokens, but the task requires exactly "
                f"{dataset.length}"
            )
    _validate_pairs(dataset, [len(t) for t in ids])


def _validate_pairs(dataset: Dataset, lengths: list[int]) -> None:
    members: dict[int, list[int]] = {}
    for i, ex in enumerate(dataset.examples):
        if ex.pair >= 0:
            members.setdefault(ex.pair, []).append(i)
    for pair, idx in members.items():
        where = f"dataset {dataset.task!r}, pair {pair} (examples {idx})"
        if len(idx) != 2:
            raise ValueError(f"{where}: a matched pair must have exactly 2 examples")
        a, b = (dataset.examples[i] for i in idx)
        if a.group != b.group:
            raise ValueError(f"{where}: partners are in groups {a.group} and {b.group}")
        if a.label_id == b.label_id:
            raise ValueError(f"{where}: partners share the label {a.label!r}")
        if lengths[idx[0]] != lengths[idx[1]]:
            raise ValueError(
                f"{where}: partners are {lengths[idx[0]]} and {lengths[idx[1]]} tokens"
            )


def scratch_lines(start: int, distractors: int) -> list[str]:
    """``scratch = start`` followed by ``distractors`` null updates (App. F)."""
    return [f"scratch = {start}"] + [NULL_UPDATE] * distractors


def pad_to_length(
    head: str,
    tail: str,
    length: int,
    tokenizer: Any,
    *,
    cache: dict[int, str] | None = None,
) -> str:
    """``head + block + tail`` with a padding block making it exactly ``length`` tokens.

    ``head`` must end with a newline. The block is ``n`` lines ``scratch += 0`` (as many
    as fit) and, for a remainder, one line ``#`` + ``" pad" * j`` (or, for a remainder
    too short for that line, lines holding one space, which cost one token each in
    byte-level BPE); each candidate is tokenized, so the result is exact for this
    tokenizer whatever its merges.
    ``cache`` (shortfall -> block) skips the search for inputs needing the same padding.

    Raises:
        ValueError: if the unpadded text is longer than ``length``, or no block fits.
    """
    base = n_tokens(tokenizer, head + tail)
    need = length - base
    if need < 0:
        raise ValueError(
            f"length={length} is too short: the unpadded input is already {base} tokens"
        )
    if cache is not None and need in cache:
        text = head + cache[need] + tail
        if n_tokens(tokenizer, text) == length:
            return text
    line = NULL_UPDATE + "\n"
    line_cost = n_tokens(tokenizer, head + line + tail) - base
    filler_cost = n_tokens(tokenizer, head + filler_line(0) + tail) - base
    for n in range(need // max(line_cost, 1), -1, -1):
        rem = need - n * line_cost
        tails = [""] if rem == 0 else [" \n" * rem]  # blank lines: the last resort
        if rem >= filler_cost:
            tails.insert(0, filler_line(rem - filler_cost))
        for rest in tails:
            text = head + line * n + rest + tail
            if n_tokens(tokenizer, text) == length:
                if cache is not None:
                    cache[need] = line * n + rest
                return text
    raise ValueError(f"cannot pad this input to exactly {length} tokens with this tokenizer")
