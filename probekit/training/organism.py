"""The model organism: a small Llama trained from scratch on synthetic-task text.

The full-bandwidth paper (Sec. 4.4, Fig. 7) probes 1B models pretrained with latent
feedback; nothing of that kind exists for SmolLM2-135M, and training a gate on a
frozen pretrained model cannot teach the model itself to use the fed-back state. So
probekit trains its own latent-feedback model, small enough for a CPU in minutes:

- a **word-level tokenizer** fitted to the vocabulary of the synthetic tasks
  (:func:`fit_tokenizer`): every word, numeral, operator, ``:`` and newline is one
  token, so ``" done"`` / ``" zero"`` are single tokens as the tasks require;
- a **Llama** (:class:`OrganismConfig`, default 4 blocks, ``d_model`` 128, 4 heads,
  tied embeddings as the paper recommends, Sec. 3.3 "shared input basis");
- **training text** (:func:`training_examples`): task inputs (0-256 null updates)
  followed by their label word, drawn with other seeds than the probe sets (``make_task(...,
  seed=0)``), and completion-tracking numeral pairs of those probe sets held out, so
  that task accuracy on the probe sets is measured on unseen pairs.

The organism is saved as an ordinary Hugging Face folder (``config.json``,
``model.safetensors``, tokenizer files), so ``probekit.load_model(<folder>)`` loads
it like any local model; ``probekit train-feedback --mode organism`` writes it into
its checkpoint (``<checkpoint>/organism``).

Building the vocabulary needs task text, and the task generators need a tokenizer
(they validate token-level invariants). :func:`fit_tokenizer` breaks the circle with
a bootstrap word-level tokenizer that knows only the label words (everything else is
``<unk>``; word counts, and so every length and padding decision, are the same as in
the final tokenizer), generates every task with it, and fits the vocabulary on the
words of the result.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from probekit.training.config import OrganismConfig
from synthetic import make_task, registers
from synthetic.completion import NUMERALS, completion_dataset
from synthetic.dataset import FILLER_WORD, Dataset
from synthetic.memory import memory_dataset

EOT = "<|endoftext|>"
UNK = "<unk>"
#: Tasks generated to collect the vocabulary (the register sweeps add only the padding
#: words ``#`` and ``pad``, included explicitly, so they are not generated: that is slow).
VOCAB_TASKS = ("completion", "memory", "registers")
#: Tasks the organism trains on by default (the two of Fig. 7a).
TRAIN_TASKS = ("completion", "memory")
#: Tasks it can train on: also latest-write register tracking (Fig. 7b's task).
ORGANISM_TASKS = ("completion", "memory", "registers")
#: Shares of the training rows by task: completion (equality of two numerals) takes a
#: small model many more examples to learn than delayed memory.
TASK_SHARES = {"completion": 2, "memory": 1, "registers": 2}
LABEL_WORDS = ("more", "done", "zero", "one")
#: Register names the tokenizer always knows, r0 .. r(REGISTER_NAMES - 1).
REGISTER_NAMES = 16


def _word_tokenizer(vocab: dict[str, int]) -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # spaces separate words and vanish; newlines and colons are tokens of their own
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(" +"), behavior="removed"),
        pre_tokenizers.Split("\n", behavior="isolated"),
        pre_tokenizers.Split(":", behavior="isolated"),
    ])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOT, pad_token=EOT, bos_token=EOT, unk_token=UNK,
    )


def _words(texts: Iterable[str]) -> set[str]:
    out: set[str] = set()
    for text in texts:
        for line in text.split("\n"):
            out.update(w for w in re.split(r" +|(:)", line) if w)
    return out


def fit_tokenizer(tasks: Sequence[str] = VOCAB_TASKS) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer covering every word of ``tasks`` (module docstring).

    Ids: 0 ``<|endoftext|>`` (EOS, BOS and padding), 1 ``<unk>``, 2 newline, then the
    words in sorted order; numerals 0..99, registers r0..r15 and the padding words of the
    register sweeps are always included."""
    boot = _word_tokenizer({EOT: 0, UNK: 1, **{w: i + 2 for i, w in enumerate(LABEL_WORDS)}})
    texts: list[str] = []
    for name in tasks:
        data = make_task(name, boot)
        for d in data.values() if isinstance(data, dict) else [data]:
            texts += d.texts
    words = _words(texts) | set(LABEL_WORDS) | {str(i) for i in range(100)}
    words |= {f"r{i}" for i in range(REGISTER_NAMES)} | {"#", FILLER_WORD.strip()}
    vocab = {EOT: 0, UNK: 1, "\n": 2}
    for w in sorted(words):
        vocab.setdefault(w, len(vocab))
    return _word_tokenizer(vocab)


def build_organism(tokenizer, config: OrganismConfig | None = None, *,
                   seed: int = 0) -> transformers.LlamaForCausalLM:
    """A freshly initialised organism for ``tokenizer`` (trainable, train mode off);
    ``config`` None is the default shape (its ``init_std`` the standard deviation of every
    weight matrix and the embedding at initialisation, HF's Llama default 0.02)."""
    config = config or OrganismConfig()
    eot = tokenizer.convert_tokens_to_ids(EOT)
    cfg = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.d_model,
        intermediate_size=config.d_mlp,
        num_hidden_layers=config.n_blocks,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_heads,
        max_position_embeddings=config.n_ctx,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        initializer_range=config.init_std,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(cfg)
    # sdpa trains faster on CPU; load_model switches a saved organism to eager
    model.set_attn_implementation("sdpa")
    return model


def new_organism(config: OrganismConfig | None = None, seed: int = 0):
    """A fresh organism as a :class:`probekit.LoadedModel` (tokenizer fitted to the tasks);
    ``config`` None is the default shape."""
    config = config or OrganismConfig()
    from probekit.core.models import LoadedModel, content_hash

    tok = fit_tokenizer()
    hf = build_organism(tok, config, seed=seed)
    return LoadedModel(hf, tok, "organism", config.n_blocks, config.d_model, config.n_ctx,
                       content_hash(hf), f"organism:random:{seed}")


def save_organism(folder: str | Path, model: transformers.PreTrainedModel, tokenizer) -> Path:
    """Write an ordinary HF folder that ``probekit.load_model(folder)`` loads."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


# ------------------------------------------------------------------------ text
_PAIR = re.compile(r"required = (\d+)\ncompleted = (\d+)")


def completion_numerals(text: str) -> tuple[int, int]:
    """The ``required`` and ``completed`` numerals of a completion-tracking input."""
    a, b = map(int, _PAIR.search(text).groups())
    return a, b


def completion_pairs(data: Dataset) -> set[frozenset[int]]:
    """The unordered numeral pairs used by a completion-tracking dataset."""
    out = set()
    for text in data.texts:
        a, b = completion_numerals(text)
        if a != b:
            out.add(frozenset((a, b)))
    return out


#: Distractor counts of the organism's validation probe sets (also ``probekit run
#: state-tracking``'s default); the organism trains on 0..256 (:data:`TRAIN_DISTRACTORS`).
PROBE_DISTRACTORS = (0, 8)


def probe_sets(tokenizer, distractors: Sequence[int] = PROBE_DISTRACTORS,
               tasks: Sequence[str] = TRAIN_TASKS) -> dict[str, Dataset]:
    """The probe datasets of the organism's ``tasks``: ``make_task(name, tok, seed=0)``,
    completion and memory with ``distractors``, registers at its default shape."""
    return {name: make_task(name, tokenizer, **({} if name == "registers" else
                                                {"distractors": tuple(distractors)}))
            for name in tasks}


def probe_rows(tokenizer, tasks: Sequence[str] = TRAIN_TASKS) -> list[list[int]]:
    """Token ids of the probe sets' rows (input + ``" " + label``) of ``tasks``, in
    :data:`ORGANISM_TASKS` order: the organism's validation rows."""
    return [row for rows in probe_rows_by_task(tokenizer, tasks).values() for row in rows]


def probe_rows_by_task(tokenizer, tasks: Sequence[str] = TRAIN_TASKS
                       ) -> dict[str, list[list[int]]]:
    """:func:`probe_rows` of each task, in :data:`ORGANISM_TASKS` order."""
    ordered = [t for t in ORGANISM_TASKS if t in tasks]
    return {name: [list(x) for x in tokenizer(
                [ex.text + " " + ex.label for ex in data.examples],
                add_special_tokens=False)["input_ids"]]
            for name, data in probe_sets(tokenizer, tasks=ordered).items()}


#: Sizes (numeral pairs) of the seed-0 completion sets whose pairs training never shows.
HELD_OUT_GROUPS = (16, 32, 64, 80)


def held_out_pairs(tokenizer) -> set[frozenset[int]]:
    """Completion numeral pairs that seed-0 probe sets can use (16, 32, 64 or 80 groups:
    the default, ``--examples 128/256/512`` of state-tracking, the enlarged set)."""
    out: set[frozenset[int]] = set()
    for n in HELD_OUT_GROUPS:
        out |= completion_pairs(completion_dataset(tokenizer, n_groups=n, distractors=(0,),
                                                   seed=0))
    return out


#: Null-update counts of the training rows, with their weights (shares of the rows): the
#: probe sets' short counts densely, then doublings up to the paper's longest (256), so
#: every probed length is a trained one. Long rows are rarer: they cost many tokens and
#: teach length, while the short ones teach the tasks.
TRAIN_DISTRACTORS = {0: 4, 1: 4, 2: 4, 3: 4, 4: 4, 6: 4, 8: 4, 16: 2, 32: 2, 64: 1, 128: 1,
                     256: 1}
#: The null-update counts whose rows ``--long-rows`` reweights.
LONG_FROM = 64


def train_distractors(long_rows: float = 1.0) -> dict[int, float]:
    """:data:`TRAIN_DISTRACTORS` with the weights of the counts from :data:`LONG_FROM` on
    multiplied by ``long_rows`` (``DataConfig.long_rows``): the model sees the lengths of
    Fig. 7a's longest sets that much more often, and the short ones a little less."""
    return {d: w * long_rows if d >= LONG_FROM else w for d, w in TRAIN_DISTRACTORS.items()}


def training_examples(
    tokenizer,
    tasks: Sequence[str] = TRAIN_TASKS,
    *,
    n_examples: int = 24000,
    distractors: Mapping[int, float] | Sequence[int] = TRAIN_DISTRACTORS,
    seed: int = 1,
    copy_share: float = 0.0,
    copy_from: int = 10,
    recall_share: float = 0.0,
) -> list[list[int]]:
    """Token ids of ``n_examples`` training sequences (task input + ``" " + label``), and
    ``n_examples * copy_share`` numeral copy rows of ``copy_from..99`` (:func:`copy_rows`)
    and ``n_examples * recall_share`` numeral recall rows (:func:`recall_rows`) shuffled in.

    Each task gets its share of :data:`TASK_SHARES`, and within a task each distractor
    count a share
    proportional to its weight (``distractors``: counts -> weights, or counts of equal
    weight). Every generated dataset uses a single distractor count and fresh random
    groups, so the rows cover as many completion numeral pairs (and memory contexts) as
    there are rows: a model that saw only a few hundred pairs, each at every distractor
    count, could learn those pairs instead of equality. Completion pairs of the probe
    sets are excluded; examples are shuffled across tasks.
    """
    if not tasks:
        raise ValueError("training needs at least one task (--tasks)")
    unknown = sorted(set(tasks) - set(ORGANISM_TASKS))
    if unknown:
        raise ValueError(f"organism tasks must be among {ORGANISM_TASKS}; got {unknown}")
    if not distractors:
        raise ValueError("training needs at least one distractor count")
    weights = distractors if isinstance(distractors, Mapping) else dict.fromkeys(distractors, 1)
    total = sum(weights.values())
    held_out = held_out_pairs(tokenizer) if "completion" in tasks else set()
    texts: list[str] = []
    for i, name in enumerate(tasks):
        per_task = -(-n_examples * TASK_SHARES[name] // sum(TASK_SHARES[t] for t in tasks))
        if name == "registers":  # varied register counts and writes, 0..50 null updates
            texts += registers.training_texts(per_task, seed=seed * 1_000_000 + i * 100_000)
            continue
        for j, (d, w) in enumerate(weights.items()):
            # exact ceiling for fractional weights (--long-rows), the same integer as
            # before for whole ones: every earlier recipe draws the same rows
            want = math.ceil(Fraction(per_task) * Fraction(w) / Fraction(total))
            got: list[str] = []
            s = seed * 1_000_000 + i * 100_000 + j * 1_000
            while len(got) < want:
                got += _rows(tokenizer, name, d, s, held_out)
                s += 1
            texts += got[:want]
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(texts))[:n_examples]
    ids = tokenizer([texts[i] for i in order], add_special_tokens=False)["input_ids"]
    rows = [list(x) for x in ids]
    if copy_share or recall_share:  # the task rows stay as they are; these are shuffled in
        if copy_share:
            rows += copy_rows(tokenizer, int(n_examples * copy_share), seed, low=copy_from)
        if recall_share:
            rows += recall_rows(tokenizer, int(n_examples * recall_share), seed)
        order = np.random.default_rng(seed + 5).permutation(len(rows))
        rows = [rows[i] for i in order]
    return rows


#: How many numerals a copy row repeats (:func:`copy_rows`), least and most.
COPY_LENGTHS = (4, 8)


def copy_rows(tokenizer, n: int, seed: int, low: int = 10) -> list[list[int]]:
    """Token ids of ``n`` numeral copy rows: 4-8 random numerals of ``low..99`` (10: the
    completion task's range), a newline, the same numerals again
    (``"41 97 13 55\n41 97 13 55"``).

    Why: in the task rows every numeral is unpredictable, so next-token prediction only
    teaches the model *that* a numeral comes; on every completion plateau we measured, the
    numerals' (tied) embeddings had drifted together, leaving equality nothing to
    compare. Predicting the copy needs each numeral's own output row, and so keeps them
    apart (docs/latent-feedback.md, "The completion plateau"). ``low=0`` copies the digits
    too, among them memory's answers ``0`` and ``1``. The rows carry no task label and no
    completion pair."""
    lo, hi = low, max(NUMERALS)
    rng = np.random.default_rng(seed + 4242)
    texts = []
    for _ in range(n):
        k = int(rng.integers(COPY_LENGTHS[0], COPY_LENGTHS[1] + 1))
        numerals = " ".join(str(x) for x in rng.integers(lo, hi + 1, k))
        texts.append(numerals + "\n" + numerals)
    return [list(x) for x in tokenizer(texts, add_special_tokens=False)["input_ids"]]


#: How many distinct numerals a recall row lists (:func:`recall_rows`), least and most.
RECALL_LENGTHS = (4, 8)


def recall_rows(tokenizer, n: int, seed: int) -> list[list[int]]:
    """Token ids of ``n`` numeral recall rows: ``k`` distinct random numerals of
    completion's range (10..99; ``k`` 4-8), then ``k - 1`` lines that each name one of
    them and its successor in the list, every listed numeral but the last once, in random
    order (``"41 97 13 55\n13 55\n41 97\n97 13"``).

    Why: the successor can only be found by matching the queried numeral against the
    list, token by token, while 3-7 other numerals compete for the match; a model that
    confuses two numerals answers with the wrong successor. Completion's ``done`` is the
    same match (is the completed numeral the required one?), and the long-range recipe's
    last misses looked like rows whose two different numerals the model takes for one;
    on two seeds the rows did not remove them (docs/latent-feedback.md, "Recall rows").
    A copy row (:func:`copy_rows`) can instead be copied by position.
    The rows carry no task label and no completion pair as such; any two numerals, held-out
    completion pairs among them, may share a list, as they may in copy rows."""
    rng = np.random.default_rng(seed + 4343)
    texts = []
    for _ in range(n):
        k = int(rng.integers(RECALL_LENGTHS[0], RECALL_LENGTHS[1] + 1))
        listed = [int(NUMERALS[i]) for i in rng.choice(len(NUMERALS), k, replace=False)]
        queries = [f"{listed[i]} {listed[i + 1]}" for i in rng.permutation(k - 1)]
        texts.append("\n".join([" ".join(map(str, listed)), *queries]))
    return [list(x) for x in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def _rows(tokenizer, task: str, distractors: int, seed: int,
          held_out: set[frozenset[int]]) -> list[str]:
    """Half of one freshly drawn dataset of ``task`` (one distractor count), shuffled, as
    texts with their labels: fresh groups for every few rows."""
    if task == "completion":
        data = completion_dataset(tokenizer, n_groups=64, distractors=(distractors,), seed=seed)
        # drop whole groups (all four assignments) whose pair is held out
        bad = {ex.group for ex in data.examples
               if frozenset(completion_numerals(ex.text)) in held_out}
        data.examples = [ex for ex in data.examples if ex.group not in bad]
    else:
        data = memory_dataset(tokenizer, n_groups=64, distractors=(distractors,), seed=seed)
    order = np.random.default_rng(seed).permutation(len(data.examples))
    return [data.examples[k].text + " " + data.examples[k].label
            for k in order[: len(order) // 2]]


# -------------------------------------------------------------------- accuracy
def label_predictions(engine, gate, rows: Sequence[Sequence[int]],
                      label_ids: Sequence[int], regime: str = "none", *,
                      batch_size: int = 64) -> np.ndarray:
    """The index (in ``label_ids``' order) of the label word with the larger logit at
    each row's last token, under prefill ``regime``: ``[len(rows)]``."""
    from probekit.mechanisms.latent_feedback import prefill

    ids = torch.tensor(list(label_ids))
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))  # similar lengths batched
    pred = np.empty(len(rows), dtype=np.int64)
    for b in range(0, len(order), batch_size):
        idx = order[b: b + batch_size]
        res = prefill(engine, [rows[i] for i in idx], gate, regime, return_logits=True)
        last = torch.tensor([len(rows[i]) - 1 for i in idx])
        pred[idx] = res.logits[torch.arange(len(idx)), last][:, ids].argmax(-1).numpy()
    return pred


def label_accuracy(engine, gate, rows: Sequence[Sequence[int]], labels: Sequence[int],
                   label_ids: Sequence[int], regime: str = "none", *,
                   batch_size: int = 64) -> float:
    """How often the label word with the larger logit at each row's last token (among
    ``label_ids``, in label order) is the row's label, under prefill ``regime``
    (:func:`label_predictions`)."""
    pred = label_predictions(engine, gate, rows, label_ids, regime, batch_size=batch_size)
    return int((pred == np.asarray(labels)).sum()) / len(rows)


def task_accuracy(model, gate, tasks: Sequence[str] = TRAIN_TASKS,
                  regimes: Sequence[str] = ("none", "last-1", "full"),
                  *, batch_size: int = 64) -> dict[str, dict[str, float]]:
    """Accuracy of the label prediction at the final colon of each probe set
    (:func:`probe_sets`), per prefill regime (:func:`label_accuracy`)."""
    from probekit.core.engine import StepEngine
    from synthetic.dataset import label_token_ids

    engine = StepEngine(model)
    tok = model.tokenizer
    sets = probe_sets(tok, tasks=tasks)
    out: dict[str, dict[str, float]] = {}
    for task in tasks:
        data = sets[task]
        label_ids = label_token_ids(tok, data.label_words)
        rows = tok(data.texts, add_special_tokens=False)["input_ids"]
        out[task] = {regime: label_accuracy(engine, gate, rows, data.labels, label_ids, regime,
                                            batch_size=batch_size) for regime in regimes}
    return out
