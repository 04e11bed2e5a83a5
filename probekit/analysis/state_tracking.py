"""``probekit run state-tracking``: at which depth is a task's state readable, and is it used?

The headline experiment of probekit: the latent-feedback paper's state-tracking probes
(Sec. 4.4, Fig. 7, App. F) as a pipeline any prefill mechanism plugs into
(:class:`probekit.analysis.capture.Mechanism`), run first with training-free recirculation::

    probekit run state-tracking --recurrence full                 # none vs full, completion
    probekit run state-tracking --recurrence none,last-k,full --k 1 2 4 --task memory
    probekit run state-tracking --task all --examples 256         # every task (long)

1. **Tasks** (:mod:`synthetic`): completion tracking, delayed memory, multi-register
   latest-write, and the register-count and overwrite sweeps. Every example ends with the
   same colon; the label token never occurs in the input; matched pairs differ only in
   the state-determining content.
2. **Capture** (:mod:`probekit.analysis.capture`): the colon's residual at every depth
   ``0 .. L`` under each prefill regime (``none``, ``last-k``, ``full``), prompts batched
   by token length, only final-token vectors kept. The standard-prefill baseline
   ``none`` is always run, first: every comparison is against it.
3. **Probes** (:class:`probekit.analysis.probing.DepthProbe`): per depth, L2 logistic regression
   with grouped k-fold CV (a numeral pair / scratch context / schedule is never split);
   mean and spread over folds; chance = majority rate of the test folds.
4. **Causal accessibility** (:mod:`probekit.analysis.causal`): on matched pairs, patch the
   partner's depth-``r`` residual into the final token and count how often the model's
   preference between the two label tokens flips to the partner's label. Decodable is
   not the same as used (Sec. 4.4, last paragraph); the model's own accuracy on the task
   (does its own label token beat the other?) is reported beside it.
5. **Output**: a run directory ``runs/state-tracking-<hash>/`` (``config.json``,
   ``manifest.json``, ``parts/`` of finished batches so an interrupted run resumes,
   ``summary.json``, one ``state-tracking-<task>.png`` per task: probe accuracy per
   depth, one line per regime with a +-1 std band over folds and the chance line, and
   the flip rate per depth beside it), and a short table in the terminal.

How to read it for recirculation (see :mod:`probekit.analysis.capture`): the final token's
readout depends only on *earlier* positions recirculating, and blocks ``0 .. d`` keep
first-pass keys/values, so the final token's residuals at depths ``0 .. d + 1`` are the
same under every regime, and ``last-1`` is the same as ``none``. Recirculation can only
change what the colon reads from depth ``d + 2`` upward; latent feedback changes the
model input (depth 0) itself, which is what the paper's Fig. 7 shows.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from probekit.analysis.capture import (
    MECHANISMS,
    Mechanism,
    capture_final,
    expand_regimes,
    mechanism_class,
    parse_regime,
)
from probekit.analysis.causal import (
    FlipStats,
    flip_statistics,
    partner_index,
    patched_label_logits,
    readout_logits,
)
from probekit.analysis.probing import DepthProbe
from probekit.core.engine import StepEngine
from synthetic import TASKS, Dataset, label_token_ids, make_task

#: Default examples per task: small enough that ``--recurrence full`` on the default model
#: finishes in minutes on 2 CPU cores (completion: 16 numeral-pair groups x 4 x 2 counts).
DEFAULT_EXAMPLES = {
    "completion": 128,       # 16 groups x 4 assignments x distractors (0, 8)
    "memory": 128,           # 32 groups x 2 states x distractors (0, 8)
    "registers": 128,        # 8 schedules x 2 (complement) x 8 queries, 157 tokens
    "register-sweep": 240,   # 8 schedules per m in (1, 2, 4, 8), 180 tokens
    "overwrite-sweep": 384,  # 8 schedules per 2/4/8 writes, 180/276/468 tokens
}
DEFAULT_DISTRACTORS = (0, 8)


@dataclass(frozen=True)
class StateTrackingConfig:
    """What to run (everything but the model and the mechanism).

    Args:
        tasks: task names of :data:`synthetic.TASKS`.
        regimes: regime names (``none``, ``last-<k>``, ``full``, or a mechanism's own);
            ``none`` is put first if missing.
        n_examples: examples per task (sweeps: over all conditions); None takes
            :data:`DEFAULT_EXAMPLES`.
        distractors: null-update counts of the completion and memory tasks.
        seed: task generation and fold assignment.
        batch_tokens: rows per batch = ``batch_tokens // prompt length`` (at most
            ``max_batch``, at least 2): bounds the ``[rows, T, vocab]`` logits of a
            parallel forward.
        n_folds, C: the probes' grouped folds and inverse L2 strength.
        pass_index: None probes the readout pass (default); a number probes that pass
            (:func:`probekit.analysis.capture.capture_final`), and causal patching, defined on the
            readout pass, is skipped.
        causal: run the patching experiment.
    """

    tasks: tuple[str, ...] = ("completion",)
    regimes: tuple[str, ...] = ("none", "full")
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
        tasks = tuple(self.tasks)
        if not tasks or any(t not in TASKS for t in tasks):
            raise ValueError(f"tasks must be among {sorted(TASKS)} (or 'all'); got {list(tasks)}")
        regimes = tuple(self.regimes)
        if "none" not in regimes:
            regimes = ("none", *regimes)
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
    """Generate and tokenize every task of ``config`` (ValueError on a bad size).

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


def run_batch(engine: StepEngine, mechanism: Mechanism, ids: torch.Tensor, regime: str,
              label_ids: Sequence[int], partners: np.ndarray, *, pass_index: int | None,
              causal: bool) -> dict[str, np.ndarray]:
    """Capture one batch, its label logits and (if ``causal``) the patched label logits.

    ``partners[i]`` is row ``i``'s partner row in this batch (-1: none; it is then
    patched with its own residuals, a no-op, and left out of the flip statistics)."""
    t0 = time.perf_counter()
    cap = capture_final(engine, mechanism, ids, regime, pass_index=pass_index)
    clean = readout_logits(engine, cap.readout_top)[:, list(label_ids)]
    out = {"resid": cap.resid.numpy(), "clean": clean.numpy()}
    if causal:
        donor_rows = np.where(partners >= 0, partners, np.arange(len(partners)))
        donors = cap.resid[torch.as_tensor(donor_rows)]
        out["patched"] = patched_label_logits(engine, cap, donors, label_ids).numpy()
    out["seconds"] = np.array(time.perf_counter() - t0)
    return out


def run_state_tracking(
    engine: StepEngine,
    mechanism: Mechanism,
    config: StateTrackingConfig,
    data: Sequence[TaskData],
    *,
    run=None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the pipeline on ``data`` (from :func:`build_datasets`); return the results.

    ``run`` (a :class:`probekit.runs.RunDir`) stores every finished batch as a part and
    skips parts already there, so an interrupted run resumes where it stopped."""
    causal = config.causal and config.pass_index is None
    started = time.perf_counter()
    units = []
    for td in data:
        partners = partner_index(td.dataset.pairs)
        for regime in config.regimes:
            for b, idx in enumerate(plan_batches(td.lengths, td.dataset.pairs,
                                                 config.batch_tokens, config.max_batch)):
                units.append((td, partners, regime, b, idx))
    results: dict[tuple[str, str], list[tuple[np.ndarray, dict]]] = {}
    bar = tqdm(units, desc="state-tracking", unit="batch", disable=not progress)
    for td, partners, regime, b, idx in bar:
        bar.set_postfix_str(f"{td.key} {regime} T={len(td.input_ids[idx[0]])}")
        key = f"{td.key}.{regime}.{b:03d}"
        if run is not None and run.has_part(key):
            part = run.load_part(key)
            if not np.array_equal(part["index"], idx):
                raise ValueError(f"part {key} of {run.path} holds other examples than this "
                                 f"run plans; rerun with --fresh")
        else:
            where = {int(i): j for j, i in enumerate(idx)}
            local = np.array([where.get(int(partners[i]), -1) for i in idx])
            ids = torch.tensor([td.input_ids[i] for i in idx])
            part = run_batch(engine, mechanism, ids, regime, td.label_ids, local,
                             pass_index=config.pass_index, causal=causal)
            if run is not None:
                run.save_part(key, index=idx, **part)
        results.setdefault((td.key, regime), []).append((idx, part))

    out: dict[str, Any] = {
        "config": asdict(config), "mechanism": mechanism.config(), "notes": mechanism.notes(),
        "datasets": {},
    }
    for td in data:
        y, groups = td.dataset.labels, td.dataset.groups
        partners = partner_index(td.dataset.pairs)
        entry = {"task": td.task, "title": td.title, "condition": td.condition,
                 "label_words": list(td.dataset.label_words), "label_ids": td.label_ids,
                 "n_examples": len(td.dataset), "n_groups": int(np.unique(groups).size),
                 "lengths": sorted({int(n) for n in td.lengths}), "regimes": {}}
        for regime in config.regimes:
            parts = results[(td.key, regime)]
            order = np.concatenate([idx for idx, _ in parts])

            def gather(name: str, order=order, parts=parts) -> np.ndarray:
                return _in_order(order, [p[name] for _, p in parts])

            X, clean = gather("resid"), gather("clean")
            probe = DepthProbe(C=config.C, n_folds=config.n_folds, seed=config.seed)
            probe.fit(X, y, groups)
            flips: FlipStats | None = None
            if causal:
                flips = flip_statistics(clean, gather("patched"), y, partners)
            entry["regimes"][regime] = {
                "probe": probe.to_dict(),
                "model_accuracy": float((clean.argmax(1) == y).mean()),
                "model_auc": model_auc(clean, y),
                "causal": flips.to_dict() if flips else None,
                "seconds": float(sum(float(p["seconds"]) for _, p in parts)),
            }
        out["datasets"][td.key] = entry
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


# ------------------------------------------------------------------------ reporting
def plot_results(results: dict[str, Any], task: str):
    """Figure for one task: a row per dataset (sweep condition); probe accuracy per depth
    (+-1 std over folds, dashed chance line), then, if patching ran, the flip rate and the
    mean logit shift toward the partner's label per patched depth (+-1 standard error)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = [e for e in results["datasets"].values() if e["task"] == task]
    causal = any(r["causal"] for e in entries for r in e["regimes"].values())
    ncols = 3 if causal else 1
    fig, axes = plt.subplots(len(entries), ncols, figsize=(4.6 * ncols, 3.2 * len(entries)),
                             squeeze=False)
    for row, e in zip(axes, entries, strict=True):
        for regime, r in e["regimes"].items():
            p = r["probe"]
            depths = np.arange(len(p["accuracy_mean"]))
            color = _band(row[0], depths, p["accuracy_mean"], p["accuracy_std"], regime)
            if causal and r["causal"]:
                c = r["causal"]
                label = f"{regime} (model acc {r['model_accuracy']:.0%})"
                _band(row[1], depths, c["flip_rate"], c["flip_se"], label, color)
                _band(row[2], depths, c["shift"], c["shift_se"], regime, color)
        chance = next(iter(e["regimes"].values()))["probe"]["chance"]
        row[0].axhline(chance, color="grey", ls="--", lw=1, label="chance")
        row[0].set(title=f"{e['title']}: linear probe ({e['n_examples']} ex., "
                         f"{e['n_groups']} groups)", xlabel="residual depth (0 = input)",
                   ylabel="accuracy", ylim=(0.3, 1.02))
        if causal:
            row[1].set(title="patch the partner's residual", ylim=(-0.02, 1.02),
                       xlabel="residual depth patched", ylabel="flip rate to partner's label")
            row[2].axhline(0, color="grey", lw=0.8)
            row[2].set(title="logit shift toward partner's label",
                       xlabel="residual depth patched", ylabel="mean change (logits)")
        for ax in row:
            ax.legend(fontsize=8)
    mech = results["mechanism"]
    params = ", ".join(f"{k}={v}" for k, v in mech.items() if k != "mechanism")
    fig.suptitle(f"{mech['mechanism']} ({params})", fontsize=9)
    fig.tight_layout()
    return fig


def _band(ax, x, mean, spread, label, color=None) -> str:
    """A line with a +-spread band; returns its colour."""
    mean, spread = np.asarray(mean, float), np.asarray(spread, float)
    (line,) = ax.plot(x, mean, marker=".", label=label, color=color)
    ax.fill_between(x, mean - spread, mean + spread, alpha=0.2, color=line.get_color())
    return line.get_color()


def summary_table(results: dict[str, Any]) -> str:
    """A short plain-text table: one row per dataset and regime.

    ``model``: how often the model's own label token wins; ``AUC``: how well its label
    logit difference separates the classes; ``probe@r``: probe accuracy at depth ``r``;
    ``flip>=50%``: the shallowest patched depth that flips half the recipients;
    ``shift@L``: the mean logit shift from patching the whole final state."""
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


# ----------------------------------------------------------------------------- CLI
def _words(values: Sequence[str]) -> list[str]:
    return [w for v in values for w in (x.strip() for x in v.split(",")) if w]


def add_experiment_cli(sub) -> None:
    """Add ``state-tracking`` to the sub-parsers of ``probekit run``."""
    from probekit.analysis.perplexity import add_recirculation_args
    from probekit.commands.main import add_model_args, add_run_args

    p = sub.add_parser("state-tracking", help="probe and patch task state per depth (Fig. 7)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recurrence", nargs="+", default=["full"], metavar="REGIME",
                   help="prefill regimes to compare: none, last-k (one per --k), last-<k>, "
                        "full; space or comma separated. none is always added as the "
                        "baseline (default: full)")
    p.add_argument("--k", nargs="+", type=int, default=[1, 2, 4],
                   help="suffix lengths for last-k (default 1 2 4, the paper's controls)")
    p.add_argument("--task", nargs="+", default=["completion"], metavar="TASK",
                   help=f"tasks: {', '.join(TASKS)} or all (default completion)")
    p.add_argument("--mechanism", default="recirculation", choices=sorted(MECHANISMS),
                   help="how positions recur (default recirculation)")
    add_recirculation_args(p)
    for name in MECHANISMS:
        try:
            cls = mechanism_class(name)
        except ValueError:
            continue  # not installed yet: --mechanism NAME reports it when asked for
        if hasattr(cls, "add_args"):
            cls.add_args(p)
    p.add_argument("--examples", type=int, default=None,
                   help="examples per task (sweeps: over all conditions); default "
                        + ", ".join(f"{t} {n}" for t, n in DEFAULT_EXAMPLES.items()))
    p.add_argument("--distractors", nargs="+", type=int, default=list(DEFAULT_DISTRACTORS),
                   help="null-update counts of completion and memory (default 0 8; the "
                        "paper's full set is 0 8 32 128 256)")
    p.add_argument("--seed", type=int, default=0, help="task and fold seed")
    p.add_argument("--folds", type=int, default=4, help="grouped CV folds (default 4)")
    p.add_argument("--C", type=float, default=1.0, help="probe inverse L2 strength")
    p.add_argument("--pass", dest="pass_index", type=int, default=None,
                   help="probe this pass instead of the readout pass (skips patching)")
    p.add_argument("--no-causal", action="store_true", help="skip the patching experiment")
    p.add_argument("--batch-tokens", type=int, default=4096,
                   help="rows per batch = batch-tokens // prompt length (memory bound)")
    p.add_argument("--max-batch", type=int, default=64, help="most rows per batch")
    add_model_args(p)
    add_run_args(p)
    p.set_defaults(func=run_cli)


def config_from_args(args) -> StateTrackingConfig:
    tasks = _words(args.task)
    if "all" in tasks:
        tasks = list(TASKS)
    return StateTrackingConfig(
        tasks=tuple(tasks), regimes=tuple(expand_regimes(args.recurrence, args.k)),
        n_examples=args.examples, distractors=tuple(args.distractors), seed=args.seed,
        batch_tokens=args.batch_tokens, max_batch=args.max_batch, n_folds=args.folds,
        C=args.C, pass_index=args.pass_index, causal=not args.no_causal,
    )


def check_regimes(mechanism: Mechanism, regimes: Sequence[str], data: Sequence[TaskData]):
    """ValueError unless every regime suits the mechanism and the shortest prompt."""
    shortest = min(int(td.lengths.min()) for td in data)
    for regime in regimes:
        mechanism.check_regime(regime)
        try:
            kind, k = parse_regime(regime)
        except ValueError:
            continue  # a mechanism's own regime (e.g. passes=<n>), accepted just above
        if kind == "last-k" and k >= shortest:
            raise ValueError(f"regime {regime} needs prompts longer than k={k} tokens; the "
                             f"shortest prompt of these tasks has {shortest}")


def run_cli(args) -> int:
    from probekit.core.models import load_model
    from probekit.runs import RunDir

    # Everything is validated before the run directory is touched.
    config = config_from_args(args)
    cls = mechanism_class(args.mechanism)
    # a mechanism may bring its model (latent feedback: an organism checkpoint's own)
    model = cls.load_model(args) if hasattr(cls, "load_model") else load_model(args.model)
    mechanism = cls.from_args(args, model)
    mechanism.check(model.n_blocks)
    data = build_datasets(config, model.tokenizer)
    check_regimes(mechanism, config.regimes, data)
    engine = StepEngine(model, args.backend)
    run_config = {"model": model.name, "model_hash": model.content_hash,
                  "mechanism": mechanism.config(), **asdict(config)}
    run = RunDir.open("state-tracking", run_config, model=model, path=args.run_dir,
                      fresh=args.fresh)
    print(f"model {model.name} ({model.n_blocks} blocks, hash {model.content_hash}); "
          f"{mechanism!r}")
    print(f"regimes {', '.join(config.regimes)}; "
          + "; ".join(f"{td.title}: {len(td.dataset)} examples, lengths "
                      f"{sorted({int(n) for n in td.lengths})}" for td in data))
    print(f"run dir {run.path}")

    results = run_state_tracking(engine, mechanism, config, data, run=run,
                                 progress=not args.no_progress)
    results["model"] = {"name": model.name, "content_hash": model.content_hash,
                        "n_blocks": model.n_blocks, "d_model": model.d_model}
    plots = []
    for task in config.tasks:
        fig = plot_results(results, task)
        plots.append(str(run.save_figure(fig, f"state-tracking-{task}.png")))
        import matplotlib.pyplot as plt

        plt.close(fig)
    results["plots"] = plots
    print()
    print(summary_table(results))
    for note in results["notes"]:
        print(f"note: {note}")
    print(f"\nwrote {run.write_json('summary.json', results)}")
    for path in plots:
        print(f"wrote {path}")
    return 0
