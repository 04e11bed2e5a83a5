"""State tracking: at which depth is a task's state readable, and is it used?

The latent-feedback paper's state-tracking probes (Sec. 4.4, Fig. 7, App. F) as a
pipeline any prefill mechanism (:class:`probekit.mechanisms.prefill.Mechanism`) plugs into:

1. **Tasks** (:mod:`synthetic`): completion tracking, delayed memory, multi-register
   latest-write, and the register-count and overwrite sweeps (:func:`build_datasets`).
   Every example ends with the same colon; the label token never occurs in the input;
   matched pairs differ only in the state-determining content.
2. **Capture** (:mod:`probekit.analysis.capture`): the colon's residual at every depth
   ``0 .. L`` under each prefill regime, prompts batched by token length
   (:func:`plan_batches`), only final-token vectors kept. The standard-prefill baseline
   ``none`` is always run, first: every comparison is against it.
3. **Probes** (:class:`probekit.analysis.probing.DepthProbe`): per depth, L2 logistic
   regression with grouped k-fold CV (a numeral pair / scratch context / schedule is
   never split); mean and spread over folds; chance = majority rate of the test folds.
4. **Causal accessibility** (:mod:`probekit.analysis.causal`): on matched pairs, patch
   the partner's depth-``r`` residual into the final token and count how often the
   model's preference between the two label tokens flips to the partner's label.
   Decodable is not the same as used (Sec. 4.4, last paragraph); the model's own accuracy
   on the task (does its own label token beat the other?) is reported beside it.

The work is cut into units, one batch of one dataset under one regime
(:func:`state_tracking_units`), each computed by :func:`compute_unit` into arrays; a
command stores them with :meth:`probekit.runs.RunDir.map` (so a run resumes) and
:func:`summarize` turns them into probe and patching results. :func:`run_state_tracking`
does all of it in memory.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from probekit.analysis.capture import capture_final
from probekit.analysis.causal import (
    flip_statistics,
    partner_index,
    patched_label_logits,
    readout_logits,
)
from probekit.analysis.probing import DepthProbe, grouped_folds
from probekit.core.engine import StepEngine
from probekit.mechanisms.prefill import Mechanism
from probekit.mechanisms.regimes import Regime, plan
from probekit.validation import check_fields
from synthetic import TASKS, Dataset, label_token_ids, make_task

#: Default examples per task: small enough that ``--recurrence full`` on the default model
#: finishes in minutes on 2 CPU cores.
DEFAULT_EXAMPLES = {
    "completion": 128,       # 16 groups x 4 assignments x distractors (0, 8)
    "memory": 128,           # 32 groups x 2 states x distractors (0, 8)
    "registers": 128,        # 8 schedules x 2 (complement) x 8 queries
    "register-sweep": 240,   # 8 schedules per m in (1, 2, 4, 8), padded to 180 tokens
    "overwrite-sweep": 384,  # 8 schedules per 2/4/8 writes
}
DEFAULT_DISTRACTORS = (0, 8)
NONE = Regime("none")


@dataclass(frozen=True)
class StateTrackingConfig:
    """What to run (everything but the model and the mechanism).

    Args:
        tasks: task names of :data:`synthetic.TASKS`.
        regimes: :class:`~probekit.mechanisms.regimes.Regime` values; ``none`` is put
            first if missing.
        n_examples: examples per task (sweeps: over all conditions); None takes
            :data:`DEFAULT_EXAMPLES`.
        distractors: null-update counts of the completion and memory tasks.
        seed: task generation and fold assignment.
        batch_tokens: rows per batch = ``batch_tokens // prompt length`` (at most
            ``max_batch``, at least 2): bounds a batch's memory.
        n_folds, C: the probes' grouped folds and inverse L2 strength.
        pass_index: None probes the readout pass (default); a number probes that pass
            (:func:`probekit.analysis.capture.capture_final`), and causal patching,
            defined on the readout pass, is skipped.
        causal: run the patching experiment.
    """

    tasks: tuple[str, ...] = ("completion",)
    regimes: tuple[Regime, ...] = (NONE, Regime("full"))
    n_examples: int | None = None
    distractors: tuple[int, ...] = DEFAULT_DISTRACTORS
    seed: int = 0
    batch_tokens: int = 4096
    max_batch: int = 64
    n_folds: int = 4
    C: float = 1.0
    pass_index: int | None = None
    causal: bool = True

    def __post_init__(self) -> None:
        check_fields(self, names={"n_examples": "--examples", "n_folds": "--folds",
                                  "pass_index": "--pass"})
        if self.seed < 0:
            raise ValueError(f"--seed must be >= 0; got {self.seed}")
        tasks = tuple(self.tasks)
        if not tasks or any(t not in TASKS for t in tasks):
            raise ValueError(f"tasks must be among {sorted(TASKS)} (or 'all'); got {list(tasks)}")
        bad = [r for r in self.regimes if not isinstance(r, Regime)]
        if bad:
            raise TypeError(f"regimes must be Regime values (probekit.mechanisms.regimes."
                            f"parse_regimes); got {bad[0]!r}")
        regimes = tuple(self.regimes)
        if NONE not in regimes:
            regimes = (NONE, *regimes)
        object.__setattr__(self, "tasks", tuple(dict.fromkeys(tasks)))
        object.__setattr__(self, "regimes", tuple(dict.fromkeys(regimes)))
        object.__setattr__(self, "distractors", tuple(self.distractors))
        if self.n_examples is not None and self.n_examples < 1:
            raise ValueError(f"--examples must be >= 1; got {self.n_examples}")
        if not self.distractors or any(d < 0 for d in self.distractors):
            raise ValueError(f"--distractors must be counts >= 0; got {list(self.distractors)}")
        if self.batch_tokens < 1 or self.max_batch < 2:
            raise ValueError(f"--batch-tokens must be >= 1 and --max-batch >= 2; got "
                             f"{self.batch_tokens} and {self.max_batch}")
        if self.n_folds < 2:
            raise ValueError(f"--folds must be >= 2; got {self.n_folds}")
        if not self.C > 0:
            raise ValueError(f"--C must be > 0; got {self.C}")
        if self.pass_index is not None and self.pass_index < 0:
            raise ValueError(f"--pass must be >= 0; got {self.pass_index}")

    @property
    def probes_readout(self) -> bool:
        """Patching runs only on the readout pass (module docstring, step 4)."""
        return self.causal and self.pass_index is None

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly fields, regimes by name (``"last-2"``)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**out, "regimes": tuple(str(r) for r in self.regimes)}


@dataclass
class TaskData:
    """One dataset to probe: a task, or one condition of a sweep, tokenized."""

    key: str                 # "completion", "register-sweep-m4", ...
    task: str
    title: str               # "completion", "register-sweep m=4", ...
    dataset: Dataset
    input_ids: list[list[int]]
    label_ids: list[int]     # token of each label word (" done", " more", ...)
    condition: dict[str, Any] = field(default_factory=dict)

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(x) for x in self.input_ids])


def build_datasets(config: StateTrackingConfig, tokenizer) -> list[TaskData]:
    """Generate and tokenize every task of ``config`` (ValueError on a bad size, or when a
    label word is not one token of ``tokenizer``).

    Prompts are tokenized with the tokenizer's own special tokens (SmolLM2 adds none; a
    model that expects a BOS token gets it), so every prompt still ends with the colon."""
    out = []
    for task in config.tasks:
        n = config.n_examples or DEFAULT_EXAMPLES[task]
        kw = {"distractors": config.distractors} if task in ("completion", "memory") else {}
        made = make_task(task, tokenizer, n_examples=n, seed=config.seed, **kw)
        if isinstance(made, Dataset):
            parts = [(task, task, {}, made)]
        else:
            name = "m" if task == "register-sweep" else "writes"
            parts = [(f"{task}-{name}{c}", f"{task} {name}={c}", {name: c}, ds)
                     for c, ds in made.items()]
        for key, title, cond, ds in parts:
            ids = [list(tokenizer(t)["input_ids"]) for t in ds.texts]
            out.append(TaskData(key, task, title, ds, ids,
                                label_token_ids(tokenizer, ds.label_words), cond))
    return out


def plan_batches(lengths: np.ndarray, pairs: np.ndarray, batch_tokens: int,
                 max_batch: int) -> list[np.ndarray]:
    """Example indices of each batch: equal lengths only, partners always together.

    Within a length, examples are ordered by pair id (unpaired last) and cut into the
    fewest batches of at most ``clip(batch_tokens // length, 2, max_batch)`` rows, sized
    alike (an even number of rows each, so that a pair is never cut): a token-by-token run
    costs about the same per step for 4 rows as for 32, so no batch is left small."""
    batches = []
    for length in np.unique(lengths):
        idx = np.flatnonzero(lengths == length)
        order = np.lexsort((idx, np.where(pairs[idx] >= 0, pairs[idx], np.iinfo(np.int64).max)))
        idx = idx[order]
        most = int(np.clip(batch_tokens // int(length), 2, max_batch)) // 2 * 2
        n_batches = -(-len(idx) // most)
        rows = min(most, 2 * -(-len(idx) // (2 * n_batches)))
        batches += [idx[i:i + rows] for i in range(0, len(idx), rows)]
    return batches


@dataclass(frozen=True, eq=False)
class Unit:
    """One batch of one dataset under one regime: the unit of work and of resuming.

    ``partners[j]`` is row ``j``'s partner row in this batch (-1: none; it is then
    patched with its own residuals, a no-op, and left out of the flip statistics)."""

    data: TaskData
    regime: Regime
    index: np.ndarray
    partners: np.ndarray


def state_tracking_units(mechanism: Mechanism, config: StateTrackingConfig,
                         data: Sequence[TaskData]) -> list[tuple[str, Unit]]:
    """``[(key, unit), ...]`` for every dataset, regime and batch, keys like
    ``"completion.last-2.000"``. Raises ValueError, before anything runs, if a regime does
    not suit the mechanism or the prompts (:func:`probekit.mechanisms.regimes.plan`), or a
    dataset cannot fill the probes' grouped folds (:func:`check_folds`)."""
    check_folds(config, data)
    units = []
    for td in data:
        partners = partner_index(td.dataset.pairs)
        batches = plan_batches(td.lengths, td.dataset.pairs, config.batch_tokens,
                               config.max_batch)
        for regime in config.regimes:
            mechanism.check_regime(regime)
            plan(regime, td.lengths)  # validates last-k against the shortest prompt
            for b, idx in enumerate(batches):
                where = {int(i): j for j, i in enumerate(idx)}
                local = np.array([where.get(int(partners[i]), -1) for i in idx])
                units.append((f"{td.key}.{regime}.{b:03d}", Unit(td, regime, idx, local)))
    return units


def check_folds(config: StateTrackingConfig, data: Sequence[TaskData]) -> None:
    """ValueError unless every dataset splits into ``n_folds`` grouped folds: checked before
    anything runs, since the probes that need them are fitted only after all compute."""
    given = f"--examples {config.n_examples}" if config.n_examples else "the default --examples"
    for td in data:
        n_groups = np.unique(td.dataset.groups).size
        try:
            grouped_folds(td.dataset.labels, td.dataset.groups, config.n_folds, config.seed)
        except ValueError:
            short = (f"fewer than --folds {config.n_folds}" if n_groups < config.n_folds else
                     f"too few to fill --folds {config.n_folds} test folds")
            raise ValueError(f"{td.title}: {len(td.dataset)} examples ({given}) form "
                             f"{n_groups} groups, {short}; give more --examples or fewer "
                             f"--folds") from None


def compute_unit(engine: StepEngine, mechanism: Mechanism, config: StateTrackingConfig,
                 unit: Unit) -> dict[str, np.ndarray]:
    """Capture one batch, its label logits and (if patching) the patched label logits."""
    t0 = time.perf_counter()
    td = unit.data
    ids = torch.tensor([td.input_ids[i] for i in unit.index])
    cap = capture_final(engine, mechanism, ids, unit.regime, pass_index=config.pass_index)
    clean = readout_logits(engine, cap.readout_top)[:, list(td.label_ids)]
    out = {"index": unit.index, "resid": cap.resid.numpy(), "clean": clean.numpy()}
    if config.probes_readout:
        donor_rows = np.where(unit.partners >= 0, unit.partners, np.arange(len(unit.partners)))
        donors = cap.resid[torch.as_tensor(donor_rows)]
        out["patched"] = patched_label_logits(engine, cap, donors, td.label_ids).numpy()
    out["seconds"] = np.array(time.perf_counter() - t0)
    return out


def summarize(mechanism: Mechanism, config: StateTrackingConfig, data: Sequence[TaskData],
              units: Sequence[tuple[str, Unit]], parts: Mapping[str, Mapping[str, Any]]
              ) -> dict[str, Any]:
    """Probe and patching results of every dataset and regime from the units' ``parts``
    (``{key: compute_unit(...)}``, e.g. from :meth:`probekit.runs.RunDir.map`)."""
    by_regime: dict[tuple[str, Regime], list[tuple[np.ndarray, Mapping]]] = {}
    for key, unit in units:
        by_regime.setdefault((unit.data.key, unit.regime), []).append((unit.index, parts[key]))
    out: dict[str, Any] = {
        "config": config.to_dict(), "mechanism": mechanism.config(),
        "notes": mechanism.notes(), "datasets": {},
    }
    for td in data:
        y, groups = td.dataset.labels, td.dataset.groups
        entry = {"task": td.task, "title": td.title, "condition": td.condition,
                 "label_words": list(td.dataset.label_words), "label_ids": td.label_ids,
                 "n_examples": len(td.dataset), "n_groups": int(np.unique(groups).size),
                 "lengths": sorted({int(n) for n in td.lengths}), "regimes": {}}
        for regime in config.regimes:
            batches = by_regime[(td.key, regime)]
            order = np.concatenate([idx for idx, _ in batches])

            def gather(name: str, order=order, batches=batches) -> np.ndarray:
                return _in_order(order, [p[name] for _, p in batches])

            X, clean = gather("resid"), gather("clean")
            probe = DepthProbe(C=config.C, n_folds=config.n_folds, seed=config.seed)
            probe.fit(X, y, groups)
            flips = None
            if config.probes_readout:
                flips = flip_statistics(clean, gather("patched"), y,
                                        partner_index(td.dataset.pairs)).to_dict()
            entry["regimes"][str(regime)] = {
                "probe": probe.to_dict(),
                "model_accuracy": float((clean.argmax(1) == y).mean()),
                "model_auc": model_auc(clean, y),
                "causal": flips,
                "seconds": float(sum(float(p["seconds"]) for _, p in batches)),
            }
        out["datasets"][td.key] = entry
    # the units' own recorded times: unlike wall_seconds, it survives a resume, which
    # reads finished parts from disk and so spends next to nothing on them
    out["compute_seconds"] = float(sum(float(parts[key]["seconds"]) for key, _ in units))
    return out


def run_state_tracking(engine: StepEngine, mechanism: Mechanism, config: StateTrackingConfig,
                       data: Sequence[TaskData], *, progress: bool = True) -> dict[str, Any]:
    """The whole pipeline in memory (no run directory): units, computed, summarized."""
    started = time.perf_counter()
    units = state_tracking_units(mechanism, config, data)
    compute = partial(compute_unit, engine, mechanism, config)
    parts = {key: compute(unit) for key, unit in tqdm(units, desc="state-tracking",
                                                       unit="batch", disable=not progress)}
    out = summarize(mechanism, config, data, units, parts)
    out["wall_seconds"] = time.perf_counter() - started
    return out


def model_auc(clean: np.ndarray, y: np.ndarray) -> float | None:
    """ROC AUC of the model's own ``logit(label 1) - logit(label 0)`` for the labels: does
    its output track the state at all, whatever its bias toward one label word? (None
    unless there are exactly two labels.)"""
    if clean.shape[1] != 2 or np.unique(y).size != 2:
        return None
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(y, clean[:, 1] - clean[:, 0]))


def _in_order(order: np.ndarray, chunks: list[np.ndarray]) -> np.ndarray:
    """Concatenate per-batch arrays and put row ``order[j]`` at index ``order[j]``."""
    stacked = np.concatenate(chunks)
    out = np.empty_like(stacked)
    out[order] = stacked
    return out
