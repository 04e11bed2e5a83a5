"""Trained organisms on demand: train on first use, verify on every use.

``probekit run state-tracking`` shows latent feedback on a model organism trained by
probekit's own trainer (:mod:`probekit.training.organism`). Nobody should have to train
it by hand first, and nobody should get a half-trained or damaged one:

- :func:`trained_organism` returns the checkpoint folder of a :class:`Recipe` from
  probekit's cache (``<cache>/organisms/seed<seed>-<recipe hash>/checkpoint``), training
  it first when it is not there. Training checkpoints as it goes, so an interrupted first
  use resumes where it stopped (the trainer's resume is exact).
- A finished organism is sealed: the size and sha256 of every file, with the recipe,
  the training time, the task accuracy and the machine that trained it, go into
  ``probekit-cache.json`` (:func:`probekit.core.model_cache.seal`). Every later use
  checks that record; a damaged organism is trained again, with one warning line saying
  why.
- Training runs on one CPU thread whatever ``--threads`` says: the organism is too small
  to gain from more, and one thread makes a seed's weights a function of the seed and
  the machine alone (other machines' matmul kernels may still round differently).
- A second process asking for the same organism waits for the first (a folder lock held
  while it trains), then uses its result.
- :func:`organism_record` reads back the record of the organism a run read, from the
  checkpoint path its summary names: figures describe the organisms their runs used.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from probekit.core import model_cache
from probekit.paths import cache_dir
from probekit.runs import config_hash, holding, identity, machine, versions
from probekit.training.config import (
    DataConfig,
    OrganismConfig,
    TrainConfig,
    check_organism_data,
    check_organism_shape,
)
from probekit.training.train import final_validation, training_seconds

#: Bumped when a change to probekit's training code changes what a recipe trains.
RECIPE_VERSION = 3

#: How the headline's organisms differ from the default recipe: numeral copy rows,
#: fixed-point batches, 3,000 steps with the rate decayed to zero, and the two-ahead
#: loss (docs/latent-feedback.md, "The headline recipe"): the first recipe on whose every
#: trained seed feedback carries completion's state into the input as in Fig. 7a. The
#: headline command needs it at 0 and 8 null updates only, where it holds.
HEADLINE: Mapping[str, Any] = MappingProxyType(
    {"copy_rows": 0.25, "fixed_point": 0.1, "steps": 3000, "lr_floor": 0.0,
     "ahead_loss": 4.0})

#: Fig. 7a's recipe (``experiments/latent_feedback_organism.sh`` trains it by default):
#: the headline's with four times the rows of 64-256 null updates, a quarter of the
#: feedback batches at the exact fixed point and 4,500 steps, so that the state also
#: survives the paper's longest rows, and twice the weight on the fused passes (Eq. 12's
#: lambda), which cuts the misses that come with running on fused inputs
#: (docs/latent-feedback.md, "The long-range recipe"). It trains about three times as long
#: as the headline's, which is why the headline keeps its own.
LONG_RANGE: Mapping[str, Any] = MappingProxyType(
    {**HEADLINE, "fixed_point": 0.25, "steps": 4500, "long_rows": 4.0, "lam": 2.0})


@dataclass(frozen=True)
class Recipe:
    """Everything that decides an organism's weights: the training hyperparameters
    (organism mode), the training data and the organism's shape."""

    train: TrainConfig = field(default_factory=lambda: TrainConfig(mode="organism"))
    data: DataConfig = field(default_factory=DataConfig)
    shape: OrganismConfig = field(default_factory=OrganismConfig)

    def __post_init__(self) -> None:
        if self.train.mode != "organism":
            raise ValueError(f"an organism recipe trains in organism mode, not {self.train.mode}")
        object.__setattr__(self, "train", self.train.resolved())
        check_organism_data(self.data, self.train)
        check_organism_shape(self.shape, self.train)

    @classmethod
    def default(cls, seed: int = 0, tasks: tuple[str, ...] | None = None,
                shape: OrganismConfig | None = None, copy_rows: float = 0.0,
                copy_from: int = 10, n_examples: int | None = None, long_rows: float = 1.0,
                recall_rows: float = 0.0, **train: Any) -> Recipe:
        """The default recipe with training seed ``seed``, training ``tasks`` (None: the
        default two), organism ``shape`` (None: the default), a share of numeral
        ``copy_rows`` of ``copy_from..99``, ``n_examples`` task rows (None: the default),
        ``long_rows`` times the default share of long rows, a share of numeral
        ``recall_rows``, and any other ``TrainConfig`` field."""
        data = DataConfig(copy_rows=copy_rows, copy_from=copy_from, long_rows=long_rows,
                          recall_rows=recall_rows,
                          **({} if tasks is None else {"tasks": tuple(tasks)}),
                          **({} if n_examples is None else {"n_examples": n_examples}))
        return cls(train=TrainConfig(mode="organism", seed=seed, **train), data=data,
                   shape=shape or OrganismConfig())

    @classmethod
    def headline(cls, seed: int = 0) -> Recipe:
        """The organism ``probekit run state-tracking`` trains for ``--organism-seeds``:
        the default recipe changed as :data:`HEADLINE` says."""
        return cls.default(seed, **HEADLINE)

    @classmethod
    def long_range(cls, seed: int = 0) -> Recipe:
        """The organism Fig. 7a's script (``experiments/latent_feedback_organism.sh``)
        shows: the default recipe changed as :data:`LONG_RANGE` says."""
        return cls.default(seed, **LONG_RANGE)

    def key(self) -> str:
        # the step count is no part of a run's identity (train-feedback resumes to more
        # steps), but it is of a trained organism's; so are the data constants
        from probekit.training.organism import PROBE_DISTRACTORS

        # --short-first's short rows (and --fixed-point-rows long's long ones, and
        # --close-pairs-rows short's counts) are told apart by the validation rows' length
        # or counts, whose null-update counts therefore shape their weights
        by_length = (self.train.short_first or self.train.fixed_point_rows != "all"
                     or self.train.close_pairs_rows != "all")
        short = {"short_rows_as_long_as": PROBE_DISTRACTORS} if by_length else {}
        return config_hash({"recipe": identity(self), "steps": self.train.steps,
                            "data": data_constants(self.data),
                            "version": RECIPE_VERSION, **short})


def data_constants(data: DataConfig) -> dict[str, Any]:
    """The module constants that shape the training rows of ``data`` (they decide the
    weights too)."""
    from probekit.training import organism
    from synthetic import registers

    tasks = data.tasks
    out = {"task_shares": organism.TASK_SHARES,
           "distractors": {str(k): v for k, v in organism.TRAIN_DISTRACTORS.items()},
           "register_writes": registers.TRAINING_WRITES,
           "register_counts": registers.TRAINING_REGISTERS,
           "register_distractors": registers.TRAINING_DISTRACTORS}
    # Constants added later shape only register rows, so they enter only the key of a
    # recipe that trains on them: every other recipe keeps its key (and its cached
    # organisms) when the register rows change.
    if data.long_rows != 1:  # only a recipe that reweights long rows depends on the cut
        out["long_from"] = organism.LONG_FROM
    if "registers" in tasks:
        out["register_distractor_weights"] = {
            str(k): v for k, v in registers.TRAINING_DISTRACTOR_WEIGHTS.items()}
        out["register_reads"] = (registers.TRAINING_READ_ROWS, registers.TRAINING_READ_RATE,
                                 registers.TRAINING_READ_RULE)
        out["register_pad_rows"] = registers.TRAINING_PAD_ROWS
    if data.copy_rows:  # likewise only for recipes with copy rows
        out["copy_lengths"] = organism.COPY_LENGTHS
    if data.recall_rows:  # and with recall rows
        out["recall_lengths"] = organism.RECALL_LENGTHS
    return out


def organism_folder(recipe: Recipe) -> Path:
    """Where the recipe's organism lives in the cache (its ``checkpoint/`` inside)."""
    return cache_dir() / "organisms" / f"seed{recipe.train.seed}-{recipe.key()}"


def train_organism(recipe: Recipe, checkpoint: str | Path, *, progress: bool = True,
                   log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Train (or resume) the recipe's organism into ``checkpoint`` on one thread; returns
    ``{"history", "data", "seconds"}``."""
    from probekit.mechanisms.latent_feedback import FeedbackGate
    from probekit.training.data import organism_data
    from probekit.training.organism import new_organism
    from probekit.training.train import train

    tc = recipe.train
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = new_organism(recipe.shape, tc.seed)
        data = organism_data(model.tokenizer, tasks=recipe.data.tasks,
                             n_examples=recipe.data.n_examples, seed=tc.seed,
                             max_tokens=tc.batch_tokens, copy_share=recipe.data.copy_rows,
                             copy_from=recipe.data.copy_from,
                             long_rows=recipe.data.long_rows,
                             recall_share=recipe.data.recall_rows)
        gate = FeedbackGate.for_model(model, feed=tc.feed)
        started = time.perf_counter()
        history = train(model, gate, data, tc, checkpoint,
                        organism_config=dataclasses.asdict(recipe.shape),
                        progress=progress, log=log)
    finally:
        torch.set_num_threads(threads)
    return {"history": history, "data": data.description,
            "seconds": time.perf_counter() - started}


def sealed(recipe: Recipe) -> dict[str, Any] | None:
    """The seal record of the recipe's organism if it is finished and sound, else None."""
    folder = organism_folder(recipe)
    rec = model_cache.record(folder)
    if rec is None or model_cache.problem(folder) is not None:
        return None
    return rec


def organism_record(checkpoint: str | Path) -> tuple[Path, dict[str, Any]]:
    """The cache folder and seal record of the organism whose checkpoint folder a run read
    (the path its summary names), or a one-line ``ValueError`` saying why it is not a
    sound organism of the cache. A figure describes the organism its runs used this way,
    not whatever its recipe's organism is now."""
    folder = Path(checkpoint).parent
    rec = model_cache.record(folder)
    reason = "no training record" if rec is None else model_cache.problem(folder)
    if reason is None and "recipe" not in rec:
        reason = "no recipe in its record"
    if reason is not None:
        raise ValueError(f"its organism {folder} is not a sound cached organism ({reason})")
    return folder, rec


def _clear_damage(folder: Path, ckpt: Path) -> None:
    """Remove what cannot be resumed: an organism sealed once and damaged since, or an
    interrupted training whose checkpoint is damaged (one warning line each)."""
    from probekit.training.checkpoint import check_checkpoint

    if model_cache.record(folder) is not None:
        reason = model_cache.problem(folder)
        warnings.warn(f"the trained organism {folder} is broken ({reason}); training it "
                      f"again", stacklevel=3)
        (folder / model_cache.RECORD).unlink()
        shutil.rmtree(ckpt, ignore_errors=True)
    elif (ckpt / "config.json").is_file():
        try:  # an interrupted training: resume it unless its checkpoint is damaged
            check_checkpoint(ckpt)
        except ValueError as e:
            warnings.warn(f"{e}; training the organism from the start", stacklevel=3)
            shutil.rmtree(ckpt)


def trained_organism(recipe: Recipe | None = None, *, progress: bool = True,
                     log: Callable[[str], None] | None = None) -> Path:
    """The checkpoint folder of ``recipe``'s organism (default recipe if None), trained
    first if the cache does not hold a sound one (module docstring)."""
    from probekit.training.checkpoint import load_checkpoint
    from probekit.training.organism import task_accuracy

    recipe = recipe or Recipe()
    folder = organism_folder(recipe)
    ckpt = folder / "checkpoint"
    if sealed(recipe) is not None:
        return ckpt
    folder.mkdir(parents=True, exist_ok=True)
    with holding(folder):  # released once sealed: a waiting process then finds it done
        if sealed(recipe) is not None:  # another process finished it while we waited
            return ckpt
        _clear_damage(folder, ckpt)
        run = train_organism(recipe, ckpt, progress=progress, log=log)
        loaded = load_checkpoint(ckpt)
        accuracy = task_accuracy(loaded.model, loaded.gate, recipe.data.tasks)
        model_cache.seal(folder, {
            "recipe": identity(recipe), "steps": recipe.train.steps,
            "recipe_version": RECIPE_VERSION, "data_constants": data_constants(recipe.data),
            "train_seconds": training_seconds(run["history"], run["seconds"]),
            "task_accuracy": accuracy, "data": run["data"],
            "final_val_pass_losses": final_validation(run["history"]),
            # the machine that finished the training (an interrupted one may have begun
            # elsewhere): a seed's weights are a function of the recipe and the machine
            "versions": versions(), "machine": machine(),
        })
    return ckpt
