"""``probekit sweep``: perplexity change over (source, destination) x alpha x scheme
heatmaps, optionally beside the looping baseline (docs/commands/sweep.md)."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

from probekit.commands.common import FLAT, CorpusFlags, ModelFlags, RunFlags, UsageError
from probekit.validation import check_fields


@dataclasses.dataclass(frozen=True)
class Config:
    """% perplexity change against the plain model for every (source, destination, alpha,
    scheme) cell, optionally with the looping baseline. Guide: docs/commands/sweep.md."""

    model: Annotated[ModelFlags, FLAT] = ModelFlags()
    pairs: Literal["all", "max-gap", "list"] = "max-gap"
    """which pairs: every d < s (all), s - d <= --max-gap (max-gap), or --pair-list (list)"""
    max_gap: int | None = None
    """largest s - d for --pairs max-gap (default 4 grid steps)"""
    pair_list: tuple[str, ...] = ()
    """source-destination pairs for --pairs list, e.g. 11-4 12-4"""
    step: int | None = None
    """grid step of all/max-gap: d = 1, 1+step, ...; s - d = step, 2 step, ... (default ~L/10)"""
    destinations: str | None = None
    """only these destinations, a:b or a:b:step (b exclusive)"""
    sources: str | None = None
    """only these sources, a:b or a:b:step (b exclusive)"""
    alphas: tuple[float, ...] = (0.1,)
    """mix weights in [0, 1]"""
    norms: tuple[Literal["convex", "beta1", "none"], ...] = ("convex",)
    """schemes: convex (norm ratio, beta = 1 - alpha), beta1 (norm ratio, beta = 1), none"""
    looping: bool = False
    """also sweep the looping baseline (copy of blocks d+1..s after s) over the same pairs"""
    ramp: int = 0
    """alpha_t = min(t / ramp, 1) * alpha (0: no ramp)"""
    rows: int = 64
    """batch rows per recirculated engine run (cells x window batches packed together)"""
    corpus: Annotated[CorpusFlags, FLAT] = CorpusFlags(windows=4, window_tokens=128)
    run: Annotated[RunFlags, FLAT] = RunFlags()

    def __post_init__(self) -> None:
        check_fields(self)
        from probekit.analysis.pairs import parse_pair, parse_range

        if self.pairs == "list" and not self.pair_list:
            raise UsageError("--pairs list needs --pair-list, e.g. --pair-list 11-4 12-4")
        if self.pair_list and self.pairs != "list":
            raise UsageError(f"--pair-list needs --pairs list (got --pairs {self.pairs})")
        for spec in self.pair_list:
            parse_pair(spec, "--pair-list")
        if self.max_gap is not None:
            if self.pairs != "max-gap":
                raise UsageError(f"--max-gap applies to --pairs max-gap (got --pairs {self.pairs})")
            if self.max_gap < 1:
                raise UsageError(f"--max-gap must be >= 1; got {self.max_gap}")
        if self.step is not None and self.step < 1:
            raise UsageError(f"--step must be >= 1 (1 = every pair); got {self.step}")
        for name in ("destinations", "sources"):
            if getattr(self, name) is not None:
                parse_range(getattr(self, name), f"--{name}")
        for name in ("alphas", "norms"):
            values = getattr(self, name)
            if not values:
                raise UsageError(f"--{name} needs at least one value")
            twice = [v for i, v in enumerate(values) if v in values[:i]]
            if twice:
                raise UsageError(f"--{name} lists {twice[0]} twice")
        for a in self.alphas:
            if not 0.0 <= a <= 1.0:
                raise UsageError(f"--alphas: alpha must lie in [0, 1]; got {a}")
        if self.ramp < 0:
            raise UsageError(f"--ramp must be >= 0 (0 = no ramp); got {self.ramp}")
        if self.rows < 1:
            raise UsageError(f"--rows must be >= 1; got {self.rows}")

    def make_pairs(self, n_blocks: int) -> list[tuple[int, int]]:
        """The ``(source, destination)`` pairs these flags select on an ``n_blocks`` model."""
        from probekit.analysis.pairs import default_step, make_pairs, parse_pair, parse_range

        ranges = {name: parse_range(getattr(self, name), f"--{name}")
                  for name in ("destinations", "sources") if getattr(self, name) is not None}
        step = default_step(n_blocks) if self.step is None else self.step
        return make_pairs(n_blocks, self.pairs, max_gap=self.max_gap, step=step,
                          listed=[parse_pair(p) for p in self.pair_list], **ranges)


def run(config: Config) -> int:
    import torch

    from probekit.analysis.sweep import make_cells, run_sweep, summarize_sweep
    from probekit.commands.common import say, set_threads
    from probekit.core.engine import StepEngine
    from probekit.core.models import load_model
    from probekit.plots.sweep import plot_looping, plot_sweep
    from probekit.runs import RunDir

    set_threads(config.model)
    model = load_model(config.model.model)
    pairs = config.make_pairs(model.n_blocks)
    cells = make_cells(pairs, config.alphas, config.norms)
    corpus = config.corpus
    windows = torch.tensor([w.input_ids for w in corpus.load(model)])
    run_dir = RunDir.open("sweep", config, model=model, inputs={"text_file": corpus.text_file},
                          path=config.run.run_dir, fresh=config.run.fresh)
    engine = StepEngine(model, config.model.backend)
    say(f"sweep: {len(cells)} cells ({len(pairs)} pairs x {len(config.alphas)} alphas x "
        f"{len(config.norms)} schemes){' + looping' if config.looping else ''} on "
        f"{len(windows)} windows x {corpus.window_tokens} tokens; run dir {run_dir.path}")
    loop_pairs = pairs if config.looping else ()
    results = run_sweep(engine, windows, cells, run_dir, looping_pairs=loop_pairs,
                        ramp=config.ramp, batch_size=corpus.batch_size, rows=config.rows,
                        progress=config.run.progress)
    summary = summarize_sweep(results, cells, loop_pairs)
    # What was swept, resolved (pairs from the model-relative defaults), beside the numbers.
    summary["config"] = {
        "model": config.model.model, "model_hash": model.content_hash,
        "backend": config.model.backend, "pairs": pairs, "alphas": list(config.alphas),
        "schemes": list(config.norms), "looping": config.looping, "ramp": config.ramp,
        "batch_size": corpus.batch_size, "rows": config.rows, "corpus": corpus.corpus,
        "text_file": None if corpus.text_file is None else str(corpus.text_file),
        "windows": corpus.windows, "window_tokens": corpus.window_tokens,
    }
    run_dir.write_json("summary.json", summary)
    sizes = (f"{model.name}, {len(windows)} windows x {corpus.window_tokens} tokens of "
             f"{corpus.corpus if corpus.text_file is None else corpus.text_file}, "
             f"baseline ppl {summary['baseline_perplexity']:.2f}")
    run_dir.save_figure(plot_sweep(summary, f"Recirculation sweep: {sizes}"), "sweep.png")
    if config.looping:
        run_dir.save_figure(plot_looping(summary, f"Recirculation vs looping: {sizes}"),
                            "looping.png")
    b = summary["best"]
    say(f"baseline perplexity {summary['baseline_perplexity']:.3f} over {summary['n_tokens']} "
        f"tokens; best cell s={b['source']} d={b['destination']} alpha={b['alpha']:g} "
        f"{b['scheme']}: {b['percent_change']:+.3f}% (per window: "
        f"{', '.join(f'{v:+.2f}%' for v in b['per_window'])})")
    if config.looping:
        lb = summary["looping"]["best"]
        say(f"best looping l1={lb['l1']} l2={lb['l2']}: {lb['percent_change']:+.3f}% (per "
            f"window: {', '.join(f'{v:+.2f}%' for v in lb['per_window'])})")
    say(f"wrote {run_dir.path / 'summary.json'}, sweep.png"
        f"{', looping.png' if config.looping else ''}")
    return 0
