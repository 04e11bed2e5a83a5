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
    task: tuple[str, ...] = ("completion", "memory")
    """tasks: completion, memory, registers, register-sweep, overwrite-sweep, or all"""
    mechanism: tuple[str, ...] = ("latent-feedback", "recirculation")
    """how positions recur: latent-feedback (on an organism), recirculation (on --model)"""
    checkpoint: Path | None = None
    """latent-feedback checkpoint (default: probekit's organism, trained on first use)"""
    organism_seeds: tuple[int, ...] = (0,)
    """training seeds of probekit's headline organism; several give mean and spread"""
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
    batch_tokens: int | None = None
    """rows per batch = batch-tokens // prompt length (default: 4096 x SmolLM2's size/model's)"""
    max_batch: int = 64
    """most rows per batch"""
    run: Annotated[RunFlags, FLAT] = RunFlags()

    def __post_init__(self) -> None:
        check_fields(self, names={"pass_index": "--pass"})
        if self.seed < 0:
            raise UsageError(f"--seed must be >= 0; got {self.seed}")
        from probekit.mechanisms.prefill import mechanism_class

        if not self.mechanism:
            raise UsageError("--mechanism needs at least one of latent-feedback, recirculation")
        if len(set(self.mechanism)) != len(self.mechanism):
            raise UsageError(f"--mechanism lists a mechanism twice: {' '.join(self.mechanism)}")
        for name in self.mechanism:
            try:
                cls = mechanism_class(name)
            except ValueError as e:
                raise UsageError(f"--{e}") from None
            for regime in self.regimes():
                cls.check_regime(regime)
        if not self.organism_seeds or min(self.organism_seeds) < 0:
            raise UsageError(f"--organism-seeds must be integers >= 0; got "
                             f"{' '.join(map(str, self.organism_seeds)) or 'nothing'}")
        if len(set(self.organism_seeds)) != len(self.organism_seeds):
            raise UsageError("--organism-seeds lists a seed twice")
        if self.batch_tokens is not None and self.batch_tokens < 1:
            raise UsageError(f"--batch-tokens must be >= 1; got {self.batch_tokens}")
        if "latent-feedback" not in self.mechanism and self.checkpoint is not None:
            raise UsageError("--checkpoint is read by --mechanism latent-feedback only")
        if self.checkpoint is not None and self.organism_seeds != (0,):
            raise UsageError("--organism-seeds picks probekit's own organisms; with "
                             "--checkpoint, leave it out")
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
            distractors=self.distractors, seed=self.seed, batch_tokens=self.batch_tokens or 4096,
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


def latent_feedback_mechanism(checkpoint: Path, model_name: str | None):
    """``(model, LatentFeedbackMechanism)`` from a checkpoint: ``model_name`` None or the
    default runs the checkpoint's own model (an organism's, or the one a gate was trained
    for); any other must be the checkpoint's (ValueError otherwise)."""
    from probekit.core.models import DEFAULT_MODEL, load_model
    from probekit.mechanisms.prefill import LatentFeedbackMechanism
    from probekit.training.checkpoint import load_checkpoint

    given = model_name not in (None, DEFAULT_MODEL, "default")
    ckpt = load_checkpoint(checkpoint, load_model(model_name) if given else None)
    return ckpt.model, LatentFeedbackMechanism(ckpt.gate, ckpt.model,
                                               checkpoint=str(ckpt.path), step=ckpt.step)


def run(config: Config) -> int:
    """Each mechanism (and each organism seed) in its own run folder; with several, they sit
    inside one folder that also holds the combined summary and the side-by-side figures.
    A single run keeps the one-folder layout (parts, summary, figures with patching)."""
    import matplotlib.pyplot as plt

    from probekit.analysis.across_runs import combine_runs
    from probekit.analysis.headline import headline_sentences
    from probekit.commands.common import say, set_threads
    from probekit.plots.state_tracking import plot_headline
    from probekit.runs import RunDir

    set_threads(config.model)
    recirculation = _preflight(config)
    n_runs = sum(1 if m != "latent-feedback" or config.checkpoint else
                 len(config.organism_seeds) for m in config.mechanism)
    top = None
    if n_runs > 1:
        top = RunDir.open("state-tracking", config, inputs={"gate": gate_file(config.checkpoint)},
                          path=config.run.run_dir, fresh=config.run.fresh)
        say(f"run dir {top.path}")
    runs: dict[str, dict[str, Any]] = {}
    for name in config.mechanism:
        if name == "latent-feedback":
            for seed, ckpt in _feedback_checkpoints(config):
                only = config.mechanism == ("latent-feedback",)
                model, mechanism = latent_feedback_mechanism(
                    ckpt, config.model.model if only else None)
                label = "latent-feedback" if config.checkpoint else f"latent-feedback-seed{seed}"
                runs[label], run_dir = _run_one(
                    config, top, label, model, mechanism, ckpt,
                    replace=_feedback_identity(config, seed))
        else:
            model, mechanism = recirculation
            runs[name], run_dir = _run_one(config, top, name, model, mechanism, None,
                                           replace={"mechanism": (name,), "checkpoint": None,
                                                    "organism_seeds": (0,)})
    combined = combine_runs(runs)
    if top is None:  # one run: its folder is the run's, its summary gains the combined view
        results = {**runs[next(iter(runs))], "mechanisms": combined["mechanisms"]}
        say(*headline_sentences(combined)[2:],
            f"wrote {run_dir.write_json('summary.json', results)}")
        return 0
    combined["plots"] = []
    for task in config.analysis().tasks:
        fig = plot_headline(combined, task)
        combined["plots"].append(str(top.save_figure(fig, f"state-tracking-{task}.png")))
        plt.close(fig)
    say("", *headline_sentences(combined),
        f"\nwrote {top.write_json('summary.json', combined)}",
        *(f"wrote {p}" for p in combined["plots"]))
    return 0


def gate_file(checkpoint: Path | None) -> Path | None:
    """The file of a checkpoint that enters a run's identity: the gate's weights (the
    model's weights enter as its content hash). Not the whole folder: its history and
    optimizer state change with every training, also one that ends in the same weights."""
    return None if checkpoint is None else checkpoint / "model.safetensors"


def _feedback_identity(config: Config, seed: int) -> dict[str, Any]:
    """The fields a latent-feedback sub-run replaces: one mechanism and seed, and the
    flags it never reads reset (recirculation's, and --model unless it names the model)."""
    from probekit.commands.common import RecirculationFlags
    from probekit.core.models import DEFAULT_MODEL

    out: dict[str, Any] = {"mechanism": ("latent-feedback",), "organism_seeds": (seed,),
                           "recirculation": RecirculationFlags()}
    if config.mechanism != ("latent-feedback",) or config.checkpoint is None:
        out["model"] = dataclasses.replace(config.model, model=DEFAULT_MODEL)
    return out


def _preflight(config: Config):
    """Every check of the runs to come, before anything trains, runs or is written (bad
    input costs nothing); returns ``load_recirculation(config)`` if recirculation runs."""
    from probekit.analysis.state_tracking import build_datasets, check_folds, state_tracking_units
    from probekit.core.models import DEFAULT_MODEL
    from probekit.mechanisms.prefill import mechanism_class
    from probekit.mechanisms.regimes import plan
    from probekit.training.config import OrganismConfig
    from probekit.training.organism import fit_tokenizer

    st = config.analysis()
    only = config.mechanism == ("latent-feedback",)
    model_name = config.model.model if only else None
    if only and config.checkpoint is None and config.model.model not in (DEFAULT_MODEL,
                                                                         "default"):
        raise UsageError(f"--model {config.model.model}: latent feedback runs on probekit's "
                         f"organism (or on --checkpoint's model); --model names the model "
                         f"recirculation runs on")
    recirculation = None
    if "recirculation" in config.mechanism:
        recirculation = model, mechanism = load_recirculation(config)
        mechanism.check(model.n_blocks)
        state_tracking_units(mechanism, st, build_datasets(st, model.tokenizer))
    if "latent-feedback" in config.mechanism:
        if config.checkpoint is None:  # probekit's organism: its tokenizer and context
            tokenizer, n_ctx = fit_tokenizer(), OrganismConfig().n_ctx
        else:
            model, _ = latent_feedback_mechanism(config.checkpoint, model_name)
            tokenizer, n_ctx = model.tokenizer, model.n_ctx
        data = build_datasets(st, tokenizer)
        check_folds(st, data)
        for td in data:
            if int(td.lengths.max()) > n_ctx:
                raise UsageError(f"{td.title}: prompts of up to {int(td.lengths.max())} tokens "
                                 f"exceed the latent-feedback model's context of {n_ctx}; "
                                 f"give fewer --distractors")
            for regime in st.regimes:
                mechanism_class("latent-feedback").check_regime(regime)
                plan(regime, td.lengths)
    return recirculation


def _feedback_checkpoints(config: Config) -> list[tuple[int, Path]]:
    """``(seed, checkpoint)`` of each latent-feedback model: ``--checkpoint``, or probekit's
    headline organism (:meth:`Recipe.headline`) of every ``--organism-seeds`` seed, trained
    now if the cache lacks it."""
    from probekit.commands.common import say
    from probekit.training.organism_cache import Recipe, sealed, trained_organism

    if config.checkpoint is not None:
        return [(0, config.checkpoint)]
    out = []
    for seed in config.organism_seeds:
        recipe = Recipe.headline(seed)
        if sealed(recipe) is None:
            say(f"training probekit's latent-feedback organism (seed {seed}) once; it is "
                f"cached for later runs (an interrupted training resumes)")
        out.append((seed, trained_organism(recipe, progress=config.run.progress, log=say)))
    return out


def _run_one(config: Config, top, label: str, model, mechanism, checkpoint: Path | None, *,
             replace: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """One mechanism on one model, in its own resumable run folder (inside ``top`` unless
    None: then at ``--run-dir`` or the default place); returns its results and folder."""
    import time
    from functools import partial

    import matplotlib.pyplot as plt

    from probekit.analysis.state_tracking import (
        build_datasets,
        compute_unit,
        state_tracking_units,
        summarize,
    )
    from probekit.commands.common import say
    from probekit.core.engine import StepEngine
    from probekit.plots.state_tracking import plot_state_tracking
    from probekit.runs import RunDir

    sub = dataclasses.replace(config, **replace)
    st = dataclasses.replace(sub.analysis(), batch_tokens=batch_tokens(config, model))
    mechanism.check(model.n_blocks)
    data = build_datasets(st, model.tokenizer)
    units = state_tracking_units(mechanism, st, data)  # every check before the run dir
    engine = StepEngine(model, config.model.backend)
    if top is None:
        run_dir = RunDir.open("state-tracking", sub, model=model,
                              inputs={"gate": gate_file(checkpoint)}, path=config.run.run_dir,
                              fresh=config.run.fresh)
    else:
        run_dir = RunDir.open(label, sub, model=model, inputs={"gate": gate_file(checkpoint)},
                              root=top.path, fresh=config.run.fresh)
    say(f"{label}: model {model.name} ({model.n_blocks} blocks, hash {model.content_hash}); "
        f"{mechanism!r}",
        f"regimes {', '.join(map(str, st.regimes))}; "
        + "; ".join(f"{td.title}: {len(td.dataset)} examples, lengths "
                    f"{sorted({int(n) for n in td.lengths})}" for td in data),
        f"run dir {run_dir.path}")
    started = time.perf_counter()
    parts = run_dir.map(units, partial(compute_unit, engine, mechanism, st),
                        desc=label, progress=config.run.progress)
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
        f"wrote {run_dir.write_json('summary.json', results)}",
        *(f"wrote {p}" for p in results["plots"]), "")
    return results, run_dir


#: SmolLM2-135M's d_model x n_blocks: --batch-tokens' default is 4096 for a model that size
REFERENCE_SIZE = 576 * 30


def batch_tokens(config: Config, model) -> int:
    """``--batch-tokens``, or by default 4096 scaled by activation size (d_model x blocks)
    relative to SmolLM2-135M: a small organism batches many long rows at once."""
    if config.batch_tokens is not None:
        return config.batch_tokens
    return max(4096, 4096 * REFERENCE_SIZE // (model.d_model * model.n_blocks))


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
