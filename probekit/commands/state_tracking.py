"""``probekit run state-tracking``: probe and patch a task's state per depth under prefill
regimes (latent-feedback paper Fig. 7; docs/commands/state-tracking.md)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any

import tyro

from probekit.commands.common import FLAT, ModelFlags, RecirculationFlags, RunFlags, UsageError
from probekit.validation import check_fields


@dataclasses.dataclass(frozen=True)
class Config:
    """Probe (and patch) a synthetic task's state at the final token, at every depth, under
    prefill regimes. Guide: docs/commands/state-tracking.md."""

    model: Annotated[ModelFlags, FLAT] = ModelFlags()
    recurrence: tuple[str, ...] = ("full",)
    """prefill regimes: none, last-k (one per --k), last-<k>, full, passes=<n>; none is added"""
    k: tuple[int, ...] = (1, 2, 4)
    """suffix lengths that last-k stands for"""
    task: tuple[str, ...] = ("completion",)
    """tasks: completion, memory, registers, register-sweep, overwrite-sweep, or all"""
    mechanism: str = "recirculation"
    """how positions recur: recirculation or latent-feedback"""
    checkpoint: Path | None = None
    """latent-feedback checkpoint folder (<run dir>/checkpoint of `probekit train-feedback`)"""
    recirculation: Annotated[RecirculationFlags, FLAT] = RecirculationFlags()
    examples: int | None = None
    """examples per task, sweeps over all conditions (default 128; sweeps 240 and 384)"""
    distractors: tuple[int, ...] = (0, 8)
    """null-update counts of completion and memory (the paper's: 0 8 32 128 256)"""
    seed: int = 0
    """task and fold seed"""
    folds: int = 4
    """grouped cross-validation folds of the probes"""
    C: float = 1.0
    """probe inverse L2 strength"""
    pass_index: Annotated[int | None, tyro.conf.arg(name="pass")] = None
    """probe this pass instead of the readout pass (skips patching)"""
    causal: bool = True
    """run the patching experiment (--no-causal skips it)"""
    batch_tokens: int = 4096
    """rows per batch = batch-tokens // prompt length (bounds memory)"""
    max_batch: int = 64
    """most rows per batch"""
    run: Annotated[RunFlags, FLAT] = RunFlags()

    def __post_init__(self) -> None:
        check_fields(self, names={"pass_index": "--pass"})
        if self.seed < 0:
            raise UsageError(f"--seed must be >= 0; got {self.seed}")
        from probekit.mechanisms.prefill import mechanism_class

        try:
            cls = mechanism_class(self.mechanism)
        except ValueError as e:
            raise UsageError(f"--{e}") from None
        for regime in self.regimes():
            cls.check_regime(regime)
        if self.mechanism == "latent-feedback" and self.checkpoint is None:
            raise UsageError("--mechanism latent-feedback needs --checkpoint C, a folder "
                             "written by `probekit train-feedback` (e.g. "
                             "runs/train-feedback-<hash>/checkpoint)")
        if self.mechanism != "latent-feedback" and self.checkpoint is not None:
            raise UsageError("--checkpoint is read by --mechanism latent-feedback only")
        if self.checkpoint is not None and not (self.checkpoint / "config.json").is_file():
            raise UsageError(f"--checkpoint {self.checkpoint} is not a checkpoint folder (no "
                             f"config.json); give <run dir>/checkpoint of `probekit "
                             f"train-feedback`")
        if self.checkpoint is not None:
            from probekit.training.checkpoint import check_checkpoint

            check_checkpoint(self.checkpoint)  # a damaged file: one line, before any loading
        self.analysis()  # validates the remaining flags

    def regimes(self) -> list:
        """The ``--recurrence`` words as :class:`~probekit.mechanisms.regimes.Regime` values."""
        from probekit.mechanisms.regimes import parse_regimes

        try:
            return parse_regimes(self.recurrence, self.k)
        except ValueError as e:
            message = str(e) if str(e).startswith("--") else f"--recurrence: {e}"
            raise UsageError(message) from None

    def analysis(self):
        """The :class:`~probekit.analysis.state_tracking.StateTrackingConfig` of these flags."""
        from probekit.analysis.state_tracking import StateTrackingConfig
        from synthetic import TASKS

        words = [w.strip() for t in self.task for w in t.split(",") if w.strip()]
        tasks = list(TASKS) if "all" in words else words
        return StateTrackingConfig(
            tasks=tuple(tasks), regimes=tuple(self.regimes()), n_examples=self.examples,
            distractors=self.distractors, seed=self.seed, batch_tokens=self.batch_tokens,
            max_batch=self.max_batch, n_folds=self.folds, C=self.C,
            pass_index=self.pass_index, causal=self.causal)


def load_recirculation(config: Config):
    """``(model, RecirculationMechanism)``: ``--model`` (a tiny model gets the synthetic
    tasks' word-level tokenizer, since the tasks need single-token label words) and the
    recirculation flags, source/destination defaulting by the model-relative rule."""
    from probekit.core.models import is_tiny, load_model
    from probekit.mechanisms.prefill import RecirculationMechanism
    from probekit.training.organism import fit_tokenizer

    name = config.model.model
    model = load_model(name, tokenizer=fit_tokenizer() if is_tiny(name) else None)
    r = config.recirculation
    source, destination = r.pair(model.n_blocks)
    mechanism = RecirculationMechanism(source, destination, r.alpha, r.beta, norm=r.norm,
                                       ramp=r.ramp, iterations=r.iterations)
    return model, mechanism


def latent_feedback_mechanism(checkpoint: Path, model_name: str):
    """``(model, LatentFeedbackMechanism)`` from a checkpoint: ``model_name`` left at the
    default runs the checkpoint's own model (an organism's, or the one a gate was trained
    for); any other must be the checkpoint's (ValueError otherwise)."""
    from probekit.core.models import DEFAULT_MODEL, load_model
    from probekit.mechanisms.prefill import LatentFeedbackMechanism
    from probekit.training.checkpoint import load_checkpoint

    given = model_name not in (DEFAULT_MODEL, "default")
    ckpt = load_checkpoint(checkpoint, load_model(model_name) if given else None)
    return ckpt.model, LatentFeedbackMechanism(ckpt.gate, ckpt.model,
                                               checkpoint=str(ckpt.path), step=ckpt.step)


def run(config: Config) -> int:
    import time
    from functools import partial

    import matplotlib.pyplot as plt

    from probekit.analysis.state_tracking import (
        build_datasets,
        compute_unit,
        state_tracking_units,
        summarize,
    )
    from probekit.commands.common import say, set_threads
    from probekit.core.engine import StepEngine
    from probekit.plots.state_tracking import plot_state_tracking
    from probekit.runs import RunDir

    set_threads(config.model)
    st = config.analysis()
    if config.mechanism == "latent-feedback":
        model, mechanism = latent_feedback_mechanism(config.checkpoint, config.model.model)
    else:
        model, mechanism = load_recirculation(config)
    mechanism.check(model.n_blocks)
    data = build_datasets(st, model.tokenizer)
    units = state_tracking_units(mechanism, st, data)  # every check before the run dir
    engine = StepEngine(model, config.model.backend)
    run_dir = RunDir.open("state-tracking", config, model=model,
                          inputs={"checkpoint": config.checkpoint}, path=config.run.run_dir,
                          fresh=config.run.fresh)
    say(f"model {model.name} ({model.n_blocks} blocks, hash {model.content_hash}); "
        f"{mechanism!r}",
        f"regimes {', '.join(map(str, st.regimes))}; "
        + "; ".join(f"{td.title}: {len(td.dataset)} examples, lengths "
                    f"{sorted({int(n) for n in td.lengths})}" for td in data),
        f"run dir {run_dir.path}")

    started = time.perf_counter()
    parts = run_dir.map(units, partial(compute_unit, engine, mechanism, st),
                        desc="state-tracking", progress=config.run.progress)
    results = summarize(mechanism, st, data, units, parts)
    results["wall_seconds"] = time.perf_counter() - started
    results["model"] = {"name": model.name, "content_hash": model.content_hash,
                        "n_blocks": model.n_blocks, "d_model": model.d_model}
    results["plots"] = []
    for task in st.tasks:
        fig = plot_state_tracking(results, task)
        results["plots"].append(str(run_dir.save_figure(fig, f"state-tracking-{task}.png")))
        plt.close(fig)
    say("", summary_table(results), *(f"note: {n}" for n in results["notes"]),
        f"\nwrote {run_dir.write_json('summary.json', results)}",
        *(f"wrote {p}" for p in results["plots"]))
    return 0


def summary_table(results: dict[str, Any]) -> str:
    """A short plain-text table: one row per dataset and regime.

    ``model``: how often the model's own label token wins; ``AUC``: how well its label
    logit difference separates the classes; ``probe@r``: probe accuracy at depth ``r``;
    ``flip>=50%``: the shallowest patched depth that flips half the recipients;
    ``shift@L``: the mean logit shift from patching the whole final state."""
    import numpy as np

    w = max([7] + [len(e["title"]) for e in results["datasets"].values()])
    r_w = max([6] + [len(r) for e in results["datasets"].values() for r in e["regimes"]])
    head = (f"{'dataset':<{w}} {'regime':<{r_w}} {'model':>5} {'AUC':>5} {'chance':>6} "
            f"{'probe@0':>7} {'@1':>5} {'@2':>5} {'@4':>5} {'best (depth)':>12} "
            f"{'flip>=50%':>9} {'shift@L':>7}")
    lines = [head, "-" * len(head)]
    for e in results["datasets"].values():
        for regime, r in e["regimes"].items():
            acc = np.array(r["probe"]["accuracy_mean"])
            best = int(np.argmax(acc))
            at = [f"{acc[i]:5.2f}" if i < acc.size else "    -" for i in (1, 2, 4)]
            first, shift = "-", "-"
            if r["causal"]:
                rate = np.array(r["causal"]["flip_rate"], float)
                hit = np.flatnonzero(rate >= 0.5)
                first = f"depth {hit[0]}" if hit.size else "never"
                shift = f"{r['causal']['shift'][-1]:+.2f}"
            auc = "-" if r["model_auc"] is None else f"{r['model_auc']:.2f}"
            lines.append(
                f"{e['title']:<{w}} {regime:<{r_w}} {r['model_accuracy']:>5.2f} {auc:>5} "
                f"{r['probe']['chance']:>6.2f} {acc[0]:>7.2f} {at[0]} {at[1]} {at[2]} "
                f"{acc[best]:>5.2f} ({best:>2})  {first:>9} {shift:>7}")
    return "\n".join(lines)
