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
- **training text** (:func:`training_examples`): task inputs (0-8 null updates) followed
  by their label word, drawn with other seeds than the probe sets (``make_task(...,
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

import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from probekit.training.config import OrganismConfig
from synthetic import make_task
from synthetic.completion import completion_dataset
from synthetic.dataset import FILLER_WORD, Dataset
from synthetic.memory import memory_dataset

EOT = "<|endoftext|>"
UNK = "<unk>"
#: Tasks generated to collect the vocabulary (the register sweeps add only the padding
#: words ``#`` and ``pad``, included explicitly, so they are not generated: that is slow).
VOCAB_TASKS = ("completion", "memory", "registers")
#: Tasks the organism trains on by default (the two of Fig. 7a).
TRAIN_TASKS = ("completion", "memory")
LABEL_WORDS = ("more", "done", "zero", "one")


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
    words |= {f"r{i}" for i in range(16)} | {"#", FILLER_WORD.strip()}
    vocab = {EOT: 0, UNK: 1, "\n": 2}
    for w in sorted(words):
        vocab.setdefault(w, len(vocab))
    return _word_tokenizer(vocab)


def build_organism(tokenizer, config: OrganismConfig | None = None, *,
                   seed: int = 0) -> transformers.LlamaForCausalLM:
    """A freshly initialised organism for ``tokenizer`` (trainable, train mode off);
    ``config`` None is the default shape."""
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


def completion_pairs(data: Dataset) -> set[frozenset[int]]:
    """The unordered numeral pairs used by a completion-tracking dataset."""
    out = set()
    for text in data.texts:
        a, b = map(int, _PAIR.search(text).groups())
        if a != b:
            out.add(frozenset((a, b)))
    return out


#: Distractor counts of the organism's probe sets (also ``probekit run state-tracking``'s
#: default); the organism trains on 0..8, so longer inputs would test length generalisation.
PROBE_DISTRACTORS = (0, 8)


def probe_sets(tokenizer, distractors: Sequence[int] = PROBE_DISTRACTORS) -> dict[str, Dataset]:
    """The probe datasets of the organism's tasks: ``make_task(name, tok, seed=0)`` with
    ``distractors`` (default sizes)."""
    return {name: make_task(name, tokenizer, distractors=tuple(distractors))
            for name in TRAIN_TASKS}


def probe_rows(tokenizer, tasks: Sequence[str] = TRAIN_TASKS) -> list[list[int]]:
    """Token ids of the probe sets' rows (input + ``" " + label``) of ``tasks``, in
    :data:`TRAIN_TASKS` order: the organism's validation rows."""
    rows: list[list[int]] = []
    for name, data in probe_sets(tokenizer).items():
        if name in tasks:
            texts = [ex.text + " " + ex.label for ex in data.examples]
            rows += tokenizer(texts, add_special_tokens=False)["input_ids"]
    return rows


def held_out_pairs(tokenizer) -> set[frozenset[int]]:
    """Completion numeral pairs that seed-0 probe sets can use (16, 32, 64 or 80 groups:
    the default, ``--examples 128/256/512`` of state-tracking, the enlarged set)."""
    out: set[frozenset[int]] = set()
    for n in (16, 32, 64, 80):
        out |= completion_pairs(completion_dataset(tokenizer, n_groups=n, distractors=(0,),
                                                   seed=0))
    return out


def training_examples(
    tokenizer,
    tasks: Sequence[str] = TRAIN_TASKS,
    *,
    n_examples: int = 12000,
    distractors: Sequence[int] = (0, 1, 2, 3, 4, 6, 8),
    seed: int = 1,
) -> list[list[int]]:
    """Token ids of ``n_examples`` training sequences (task input + ``" " + label``).

    Completion pairs of the probe sets are excluded; examples are shuffled across tasks.
    """
    if not tasks:
        raise ValueError("training needs at least one task (--tasks)")
    unknown = sorted(set(tasks) - set(TRAIN_TASKS))
    if unknown:
        raise ValueError(f"organism tasks must be among {TRAIN_TASKS}; got {unknown}")
    held_out = held_out_pairs(tokenizer) if "completion" in tasks else set()
    per_task = -(-n_examples // len(tasks))
    texts: list[str] = []
    for i, name in enumerate(tasks):
        got: list[str] = []
        s = seed * 1000 + i * 100
        while len(got) < per_task:
            if name == "completion":
                data = completion_dataset(tokenizer, n_groups=400, distractors=distractors, seed=s)
                # drop whole groups (all four assignments) whose pair is held out
                bad = {ex.group for ex in data.examples
                       if frozenset(map(int, _PAIR.search(ex.text).groups())) in held_out}
                data.examples = [ex for ex in data.examples if ex.group not in bad]
            else:
                data = memory_dataset(tokenizer, n_groups=320, distractors=distractors, seed=s)
            # shuffled, so that a task's share covers every group, not the first few
            order = np.random.default_rng(s).permutation(len(data.examples))
            got += [data.examples[j].text + " " + data.examples[j].label for j in order]
            s += 1
        texts += got[:per_task]
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(texts))[:n_examples]
    ids = tokenizer([texts[i] for i in order], add_special_tokens=False)["input_ids"]
    return [list(x) for x in ids]


# -------------------------------------------------------------------- accuracy
def task_accuracy(model, gate, tasks: Sequence[str] = TRAIN_TASKS,
                  regimes: Sequence[str] = ("none", "last-1", "full"),
                  *, batch_size: int = 64) -> dict[str, dict[str, float]]:
    """Accuracy of the label prediction at the final colon of each probe set
    (:func:`probe_sets`), per prefill regime: the label word with the
    larger logit among the task's label words must be the example's label."""
    from probekit.core.engine import StepEngine
    from probekit.mechanisms.latent_feedback import prefill
    from synthetic.dataset import label_token_ids

    engine = StepEngine(model)
    tok = model.tokenizer
    out: dict[str, dict[str, float]] = {}
    sets = probe_sets(tok)
    for task in tasks:
        data = sets[task]
        label_ids = torch.tensor(label_token_ids(tok, data.label_words))
        rows = tok(data.texts, add_special_tokens=False)["input_ids"]
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        out[task] = {}
        for regime in regimes:
            correct = 0
            for b in range(0, len(order), batch_size):
                idx = order[b: b + batch_size]
                res = prefill(engine, [rows[i] for i in idx], gate, regime, return_logits=True)
                last = torch.tensor([len(rows[i]) - 1 for i in idx])
                logits = res.logits[torch.arange(len(idx)), last][:, label_ids]
                pred = logits.argmax(-1).numpy()
                correct += int((pred == data.labels[idx]).sum())
            out[task][regime] = correct / len(rows)
    return out
