"""``probekit train-feedback``: train latent feedback (docs/commands/train-feedback.md)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from typing import Annotated

from probekit.commands.common import FLAT, ModelFlags, RunFlags, UsageError, say, set_threads
from probekit.training.config import (
    DataConfig,
    OrganismConfig,
    TrainConfig,
    check_organism_data,
    check_organism_shape,
)
from probekit.validation import check_fields, flag


@dataclasses.dataclass(frozen=True)
class Config:
    """Train latent feedback with the multi-pass objective: a gate on a frozen model, or a
    small Llama from scratch with its gate. Guide: docs/commands/train-feedback.md."""

    train: Annotated[TrainConfig, FLAT] = TrainConfig()
    model: Annotated[ModelFlags, FLAT] = ModelFlags()
    data: Annotated[DataConfig, FLAT] = DataConfig()
    organism: Annotated[OrganismConfig, FLAT] = OrganismConfig()
    run: Annotated[RunFlags, FLAT] = RunFlags()

    def __post_init__(self) -> None:
        check_fields(self)
        train = self.train.resolved()
        for name in ("copy_rows", "recall_rows"):
            if train.mode == "gate" and getattr(self.data, name):
                raise UsageError(f"{flag(name)} adds rows to the organism's task data; the "
                                 "gate trains on Wikipedia windows: drop it or use --mode "
                                 "organism")
        if train.mode == "gate" and self.data.long_rows != 1:
            raise UsageError("--long-rows weights the organism's task rows; the gate trains "
                             "on Wikipedia windows: drop it or use --mode organism")
        check_organism_data(self.data, train)
        check_organism_shape(self.organism, train)


def run(config: Config) -> int:
    from tqdm.auto import tqdm

    from probekit.core.models import load_model
    from probekit.mechanisms.latent_feedback import FeedbackGate
    from probekit.plots.training import plot_history
    from probekit.runs import RunDir
    from probekit.training.checkpoint import load_checkpoint
    from probekit.training.data import gate_data
    from probekit.training.organism import task_accuracy
    from probekit.training.organism_cache import Recipe, train_organism
    from probekit.training.train import final_validation, train, training_seconds

    set_threads(config.model)
    tc = config.train.resolved()
    organism = tc.mode == "organism"
    # the organism is defined by its config and seed; a gate also by the frozen model
    model = None if organism else load_model(config.model.model)
    run_dir = RunDir.open("train-feedback", dataclasses.replace(config, train=tc),
                          model=model, path=config.run.run_dir, fresh=config.run.fresh)
    ckpt = run_dir.path / "checkpoint"
    if config.run.fresh and ckpt.exists():
        shutil.rmtree(ckpt)
    t0 = time.time()
    if organism:  # the same training as the organisms probekit caches (one thread)
        recipe = Recipe(train=tc, data=config.data, shape=config.organism)
        say(f"train-feedback (organism): {config.organism}; run dir {run_dir.path}")
        trained = train_organism(recipe, ckpt, progress=config.run.progress, log=tqdm.write)
        history, description, name = trained["history"], trained["data"], "organism"
    else:
        data = gate_data(model, tc.seq_len, n_windows=config.data.n_windows)
        gate = FeedbackGate.for_model(model, feed=tc.feed)
        say(f"train-feedback (gate): model {model.name} ({model.n_blocks} blocks, "
            f"d_model {model.d_model}); data {data.description}; run dir {run_dir.path}")
        history = train(model, gate, data, tc, ckpt, progress=config.run.progress,
                        log=tqdm.write)
        description, name = data.description, model.name
    elapsed = time.time() - t0
    run_dir.save_figure(plot_history(history, f"train-feedback ({tc.mode}, {name})"),
                        "loss_curves.png")
    summary = {"steps": tc.steps, "seconds_this_run": elapsed,
               "train_seconds_total": training_seconds(history),
               "final_val_pass_losses": final_validation(history),
               "checkpoint": str(ckpt), "data": description}
    if organism:
        loaded = load_checkpoint(ckpt)
        summary["task_accuracy"] = task_accuracy(loaded.model, loaded.gate, config.data.tasks)
        say("task accuracy (label at the final colon): " + json.dumps(summary["task_accuracy"]))
    run_dir.write_json("summary.json", summary)
    say(f"final validation loss by pass: {summary['final_val_pass_losses']}",
        f"checkpoint: {ckpt}  (use --checkpoint {ckpt})")
    return 0
