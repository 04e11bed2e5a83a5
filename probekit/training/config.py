"""The hyperparameters of latent-feedback training (:class:`TrainConfig`).

``TrainConfig`` is both the library's configuration of :func:`probekit.training.train.train`
and the flags of ``probekit train-feedback`` (tyro makes one flag per field; each field's
docstring is its help). Several defaults depend on ``--mode``; those fields default to
None, meaning "the mode's default" (:data:`MODE_DEFAULTS`), and :meth:`TrainConfig.resolved`
fills them in. The reasons for each default are in docs/latent-feedback.md.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from typing import Literal

from probekit.runs import added_later, not_identity
from probekit.validation import check_fields, flag

MODES = ("gate", "organism")
#: Defaults that differ by mode: a gate on a frozen pretrained model learns from few,
#: small batches of long windows; the organism trains from scratch on short task rows.
#: (Each field's help repeats these numbers; a test checks that they agree.)
MODE_DEFAULTS = {
    "gate": dict(steps=200, batch_size=4, lr=1e-3, warmup=20, eval_every=50, save_every=25,
                 answer_weight=1.0, feedback_start=0),
    "organism": dict(steps=2000, batch_size=64, lr=2e-3, warmup=200, eval_every=250,
                     save_every=100, answer_weight=20.0, feedback_start=600),
}


#: Options only the organism trains with: (field, what it does, the option it also needs).
#: At its default a field is off and needs nothing; the error names what it needs.
ORGANISM_ONLY = (
    ("ahead_loss", "trains the organism's top states to predict two tokens ahead", None),
    ("short_first", "draws the organism's short task rows first", None),
    ("fixed_point_rows", "chooses the rows of the organism's fixed-point batches",
     "fixed_point"),
    ("close_pairs", "draws the organism's completion rows", None),
    ("close_pairs_rows", "chooses the organism's close-pair batches", "close_pairs"),
    ("close_pairs_batch", "chooses the organism's close-pair batches", "close_pairs"),
    ("match_hint", "trains the organism's register lookups", None),
    ("match_hint_steps", "sets how long the match hint trains", "match_hint"),
    ("match_hint_parts", "chooses the heads the match hint trains", "match_hint"),
)


@dataclass(frozen=True)
class TrainConfig:
    """Multi-pass training of a latent-feedback gate (paper Sec. 3.3, App. C)."""

    mode: Literal["gate", "organism"] = "gate"
    """gate: a gate on a frozen pretrained --model; organism: a small Llama from scratch"""
    steps: int | None = not_identity(None)
    """total optimizer steps, resumable (default: gate 200, organism 2000)"""
    batch_size: int | None = None
    """sequences per step (default: gate 4, organism 64)"""
    seq_len: int = 128
    """tokens per training window (gate mode; organism rows are whole examples)"""
    batch_tokens: int = 4096
    """most tokens per organism batch: long rows come in smaller batches"""
    lr: float | None = None
    """peak AdamW learning rate (default: gate 0.001, organism 0.002)"""
    weight_decay: float = 0.01
    """AdamW weight decay (matrices only)"""
    warmup: int | None = None
    """linear warm-up steps (default: gate 20, organism 200)"""
    lr_floor: float = added_later(0.1)
    """learning rate at the last step as a share of --lr: the cosine decays to it (0: to
    zero)"""
    lam: float = 1.0
    """lambda of Eq. 12: the weight of the fused passes' losses"""
    schedule: tuple[float, ...] = (0.75, 0.22, 0.03)
    """probabilities of 1, 2, 3, ... passes per batch (paper: 0.75 0.22 0.03)"""
    feedback_start: int | None = None
    """one pass only before this step (default: gate 0, organism 600)"""
    mixin: float = 0.5
    """probability that a row keeps a random plain prefix in passes > 1"""
    jitter: float = 0.02
    """sigma of the uniform noise on the carried state (Eq. 13)"""
    feed: Literal["normed", "residual"] = "normed"
    """top state fed back: normed (after the final norm) or residual (before it)"""
    fixed_point: float = added_later(0.0)
    """probability that a batch after --feedback-start feeds back the exact full-recurrence
    state (token by token, no gradient) through one pass instead of Jacobi passes"""
    fixed_point_rows: Literal["all", "long"] = added_later("all")
    """organism mode: the rows of the --fixed-point batches: any (all) or only those longer
    than the validation rows (long: 16-256 null updates), where full recurrence's feedback
    chain is longest (the other batches keep every row)"""
    ahead_loss: float = added_later(0.0)
    """organism mode: weight of a second head's loss that predicts, from each position's
    top state, the token two ahead (multi-token prediction; 0: none)"""
    short_first: int = added_later(0)
    """organism mode: the first this-many steps draw their batches only from rows no longer
    than the validation rows (0-8 null updates, and the copy rows), so that the tasks are
    learned on short rows before the long rows come in (0: every row from the start)"""
    close_pairs: float = added_later(0.0)
    """organism mode: probability that a batch after --feedback-start holds, instead of
    (or beside: --close-pairs-batch) drawn rows, completion rows (all four assignments) of
    the 400 training pairs whose numerals the organism's embeddings hold closest at that
    step: the pairs it most often answers "done" for although they differ"""
    close_pairs_rows: Literal["all", "short"] = added_later("all")
    """organism mode: the null-update counts of the --close-pairs batches: every training
    count by its weight (all), or only those of the validation rows (short: 0-8)"""
    close_pairs_batch: Literal["instead", "added"] = added_later("instead")
    """organism mode: a --close-pairs batch replaces the step's batch (instead) or trains
    beside it, its loss's gradient added before the step's one update (added), so that
    every batch of the recipe stays"""
    match_hint: float = added_later(0.0)
    """organism mode: weight, at step 0, of the match hint (probekit.training.match_hint):
    -log of the attention of head 0 of the last block, at each "Value:" colon of a
    register row, on the digit the row asks for (0: none)"""
    match_hint_steps: int = added_later(500)
    """organism mode: steps over which the --match-hint weight decays linearly to zero"""
    match_hint_parts: Literal["match", "circuit"] = added_later("match")
    """organism mode: the heads --match-hint trains: the match alone, or the whole lookup
    circuit (also head 0 of block 0 from the colon onto the queried name and head 1 of
    block 0 from each written digit onto its register's name)"""
    ema: float = added_later(0.0)
    """decay D of an exponential moving average of the trained weights, taken after every
    step from --feedback-start on (average <- D average + (1 - D) weights): the checkpoint
    saves, and validation measures, the average, and keeps the last weights beside it to
    resume (0: none, the last weights; 0.999 averages about the last 1,000 steps)"""
    grad_clip: float = 1.0
    """gradient-norm clip (0: none)"""
    answer_weight: float | None = None
    """loss weight of each row's last target, 1 = the paper (default: gate 1, organism 20)"""
    eval_every: int | None = not_identity(None)
    """steps between validations, 0 = at the end (default: gate 50, organism 250)"""
    save_every: int | None = not_identity(None)
    """steps between checkpoints (default: gate 25, organism 100)"""
    seed: int = 0
    """seeds initialisation, data order, pass counts, mixin and jitter"""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {MODES}; got {self.mode!r}")
        object.__setattr__(self, "schedule", tuple(float(p) for p in self.schedule))
        if self._unresolved():
            self.resolved()  # building the filled-in copy checks it (the branch below)
        else:
            _validate(self)

    def _unresolved(self) -> bool:
        return any(getattr(self, name) is None for name in MODE_DEFAULTS[self.mode])

    def resolved(self) -> TrainConfig:
        """This config with every mode default (None) filled in from :data:`MODE_DEFAULTS`."""
        if not self._unresolved():
            return self
        filled = {k: v for k, v in MODE_DEFAULTS[self.mode].items() if getattr(self, k) is None}
        return dataclasses.replace(self, **filled)

    @property
    def max_passes(self) -> int:
        return len(self.schedule)


def _validate(c: TrainConfig) -> None:
    """Every check of a resolved config; messages name the flag."""
    for name in ("steps", "batch_size", "seq_len", "batch_tokens", "save_every",
                 "match_hint_steps"):
        v = getattr(c, name)
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{flag(name)} must be a positive integer; got {v!r}")
    for name in ("warmup", "eval_every", "seed", "feedback_start", "short_first"):
        v = getattr(c, name)
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"{flag(name)} must be an integer >= 0; got {v!r}")
    if c.seq_len < 2:
        raise ValueError(f"--seq-len must be >= 2 (one next-token target); got {c.seq_len}")
    if not c.schedule or not all(p >= 0 for p in c.schedule) or abs(sum(c.schedule) - 1) > 1e-6:
        raise ValueError(
            f"--schedule must be probabilities of 1, 2, 3, ... passes summing to 1 "
            f"(e.g. 0.75 0.22 0.03); got {' '.join(map(str, c.schedule))}"
        )
    if not c.lr > 0:
        raise ValueError(f"--lr must be > 0; got {c.lr}")
    for name in ("lam", "weight_decay", "grad_clip", "jitter"):
        if not getattr(c, name) >= 0:  # NaN too
            raise ValueError(f"{flag(name)} must be >= 0; got {getattr(c, name)}")
    for name in ("ahead_loss", "match_hint"):
        if not 0 <= getattr(c, name) < math.inf:  # NaN fails too
            raise ValueError(f"{flag(name)} must be a finite number >= 0; got "
                             f"{getattr(c, name)}")
    defaults = {f.name: f.default for f in dataclasses.fields(c)}
    if not 0 <= c.ema < 1:  # 1 would never leave the first weights (NaN: check_fields)
        raise ValueError(f"--ema must lie in [0, 1); got {c.ema}")
    for name, does, also in ORGANISM_ONLY:
        v = getattr(c, name)
        if v == defaults[name] or (c.mode == "organism" and (also is None or getattr(c, also))):
            continue
        named = f"{flag(name)} {v}" if isinstance(v, str) else flag(name)
        needs = f"--mode organism and {flag(also)} > 0" if also else "--mode organism"
        raise ValueError(f"{named} {does}; it needs {needs}")
    if not c.answer_weight > 0:
        raise ValueError(f"--answer-weight must be > 0; got {c.answer_weight}")
    for name in ("mixin", "fixed_point", "lr_floor", "close_pairs"):
        if not 0 <= getattr(c, name) <= 1:
            raise ValueError(f"{flag(name)} must lie in [0, 1]; got {getattr(c, name)}")


@dataclass(frozen=True)
class OrganismConfig:
    """Shape of the organism (a Llama; organism mode of ``probekit train-feedback``)."""

    n_blocks: int = 4
    """organism transformer blocks"""
    d_model: int = 128
    """organism residual width"""
    n_heads: int = 4
    """organism attention heads (--d-model must be a multiple)"""
    d_mlp: int = 512
    """organism SwiGLU hidden width"""
    n_ctx: int = 1280
    """organism context length (256 distractors: 1,057 tokens)"""
    init_std: float = added_later(0.02)
    """standard deviation of the fresh organism's weight matrices and embedding (HF's
    Llama default; larger starts attention further from uniform)"""

    def __post_init__(self) -> None:
        check_fields(self)
        if not 0 < self.init_std <= 1:  # NaN fails too
            raise ValueError(f"--init-std must lie in (0, 1]; got {self.init_std}")
        for name, v in asdict(self).items():
            if name != "init_std" and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{flag(name)} (organism shape) must be a "
                                 f"positive integer; got {v!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"--d-model ({self.d_model}) must be a multiple of --n-heads "
                             f"({self.n_heads})")


@dataclass(frozen=True)
class DataConfig:
    """What training reads: Wikipedia windows (gate mode) or task rows (organism mode)."""

    n_windows: int = 2048
    """training windows of --seq-len Wikipedia tokens (gate mode)"""
    tasks: tuple[Literal["completion", "memory", "registers"], ...] = ("completion", "memory")
    """organism training tasks"""
    n_examples: int = 24000
    """organism training examples"""
    copy_rows: float = added_later(0.0)
    """numeral copy rows (some numerals, then the same again) added to the organism's rows,
    as a share of --n-examples: they keep the numerals' embeddings apart"""
    copy_from: int = added_later(10)
    """smallest numeral of the copy rows, which run to 99: 10 copies completion's numerals
    only, 0 also the digits (memory answers with 0 or 1)"""
    recall_rows: float = added_later(0.0)
    """numeral recall rows (a list of numerals, then each but the last with its successor)
    added to the organism's rows, as a share of --n-examples: they train matching a
    numeral against others, which completion's equality needs"""
    long_rows: float = added_later(1.0)
    """how many times the default share of long completion and memory rows (64, 128 and
    256 null updates) the organism trains on: 4 draws them four times as often"""

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("copy_rows", "recall_rows"):  # shares of --n-examples
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{flag(name)} must lie in [0, 1]; got {getattr(self, name)}")
        if not 0 <= self.copy_from <= 99:
            raise ValueError(f"--copy-from must lie in 0..99; got {self.copy_from}")
        if not 0 < self.long_rows < math.inf:  # NaN fails too
            raise ValueError(f"--long-rows must be a finite number > 0; got {self.long_rows}")
        if self.copy_from != 10 and not self.copy_rows:
            raise ValueError("--copy-from sets the copy rows' numerals; give --copy-rows "
                             "too, or drop it")
        if self.n_windows < 1:
            raise ValueError(f"--n-windows must be >= 1; got {self.n_windows}")
        if not self.tasks:
            raise ValueError("--tasks needs at least one task (completion, memory, "
                             "registers)")
        if self.n_examples < 1:
            raise ValueError(f"--n-examples must be >= 1; got {self.n_examples}")


def check_organism_shape(shape: OrganismConfig, train: TrainConfig) -> None:
    """Refuse a training the organism's shape cannot serve: ``--match-hint-parts circuit``
    without the two blocks and two heads its edges name. The one check of it, for
    ``probekit train-feedback`` and every organism recipe."""
    if not train.match_hint:
        return
    from probekit.training.match_hint import fits  # imports torch: only when hinted

    if not fits(train.match_hint_parts, shape.n_blocks, shape.n_heads):
        raise ValueError("--match-hint-parts circuit trains heads 0 and 1 of block 0 and "
                         "head 0 of the last block; it needs --n-blocks and --n-heads >= 2")


def check_organism_data(data: DataConfig, train: TrainConfig) -> None:
    """Refuse an organism training its task rows cannot serve: fewer rows (``--n-examples``)
    than one batch, or ``--close-pairs`` without completion rows. The one check of it, for
    ``probekit train-feedback`` and every organism recipe."""
    train = train.resolved()
    if train.mode == "organism" and data.n_examples < train.batch_size:
        raise ValueError(f"--n-examples must be >= --batch-size ({train.batch_size}); "
                         f"got {data.n_examples}")
    if train.close_pairs and "completion" not in data.tasks:
        raise ValueError(f"--close-pairs draws completion rows; it needs completion among "
                         f"--tasks (got {' '.join(data.tasks)})")
    if train.match_hint and "registers" not in data.tasks:
        raise ValueError(f"--match-hint trains register lookups; it needs registers among "
                         f"--tasks (got {' '.join(data.tasks)})")
