"""``probekit lag-analysis``: benefit of recirculating one token at each later lag
(docs/commands/lag-analysis.md)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Annotated

import numpy as np

from probekit.commands import common
from probekit.commands.common import FLAT, CorpusFlags, ModelFlags, RecirculationFlags, RunFlags
from probekit.validation import check_fields


@dataclasses.dataclass(frozen=True)
class Config:
    """Recirculate one position t at a time and measure the change in log-likelihood of the
    predictions at t+k (paper Fig. 9a,b). Guide: docs/commands/lag-analysis.md."""

    model: Annotated[ModelFlags, FLAT] = ModelFlags()
    recirculation: Annotated[RecirculationFlags, FLAT] = RecirculationFlags()
    positions: tuple[str, ...] = ()
    """recirculated t: a:b or a:b:step ranges, b exclusive (default: all with a full lag range)"""
    max_lag: int = 32
    """largest lag K"""
    complement: bool = False
    """also run the all-but-one complement (slow: ~K+1 steps per t)"""
    complement_positions: tuple[str, ...] = ()
    """positions for --complement, as --positions (default: those of --positions)"""
    corpus: Annotated[CorpusFlags, FLAT] = CorpusFlags(windows=4, window_tokens=128)
    run: Annotated[RunFlags, FLAT] = RunFlags()

    def __post_init__(self) -> None:
        check_fields(self)
        if self.max_lag < 1:
            raise common.UsageError(f"--max-lag must be >= 1; got {self.max_lag}")
        if self.complement_positions and not self.complement:
            raise common.UsageError("--complement-positions needs --complement")
        self.position_list()  # every position must leave a full lag range
        self.complement_position_list()

    def position_list(self) -> list[int]:
        """The parsed, validated ``--positions``."""
        from probekit.analysis.lag import check_positions, parse_positions

        T = self.corpus.window_tokens
        out = parse_positions(self.positions, T, self.max_lag)
        check_positions(out, T, self.max_lag)
        return out

    def complement_position_list(self) -> list[int]:
        """The parsed, validated ``--complement-positions`` (those of ``--positions`` if
        not given)."""
        from probekit.analysis.lag import check_positions, parse_positions

        if not self.complement_positions:
            return self.position_list()
        T = self.corpus.window_tokens
        out = parse_positions(self.complement_positions, T, self.max_lag,
                              flag="--complement-positions")
        check_positions(out, T, self.max_lag, flag="--complement-positions")
        return out


def run(config: Config) -> int:
    import torch

    from probekit.analysis import lag, lag_summary
    from probekit.core.engine import StepEngine
    from probekit.core.models import load_model
    from probekit.plots.lag import plot_lag_analysis
    from probekit.runs import RunDir

    common.set_threads(config.model)
    positions = config.position_list()
    comp_positions = config.complement_position_list()
    model = load_model(config.model.model)
    rec = config.recirculation.build(model.n_blocks)
    ids = torch.tensor([w.input_ids for w in config.corpus.load(model)])
    run_dir = RunDir.open("lag-analysis", config, model=model,
                          inputs={"text_file": config.corpus.text_file},
                          path=config.run.run_dir, fresh=config.run.fresh)
    engine = StepEngine(model, config.model.backend)
    corpus, K, show = config.corpus, config.max_lag, config.run.progress
    common.say(
        f"model {model.name} ({model.n_blocks} blocks, hash {model.content_hash}); {rec}",
        f"{len(ids)} windows x {corpus.window_tokens} tokens; K={K}; run dir {run_dir.path}")

    size = corpus.batch_size
    starts = range(0, len(ids), size)

    def benefit(kind: str, ts: list[int], prepare, compute) -> np.ndarray:
        """``[windows, len(ts), K+1]``: one part per (window batch, t); the batch's shared
        run (``prepare``) is made once per batch, and only when one of its parts is missing."""
        prepared = functools.lru_cache(maxsize=1)(lambda w0: prepare(ids[w0 : w0 + size]))
        parts = run_dir.map(
            [(f"{kind}-w{w0:05d}-t{t:05d}", (w0, t)) for w0 in starts for t in ts],
            lambda u: {"benefit": compute(ids[u[0] : u[0] + size], u[1], prepared(u[0]))
                       .numpy()},
            desc=kind, progress=show)
        return np.concatenate([np.stack([parts[f"{kind}-w{w0:05d}-t{t:05d}"]["benefit"]
                                         for t in ts], axis=1) for w0 in starts], axis=0)

    single = benefit(
        "single", positions, lambda batch: engine.forward(batch, return_cache=True),
        lambda batch, t, base: lag.single_token_benefit(engine, batch, rec, [t], K,
                                                        baseline=base)[:, 0])
    summary = {
        "config": {
            "model": config.model.model, "model_hash": model.content_hash,
            "backend": config.model.backend, "recirculation": repr(rec),
            "positions": positions, "max_lag": K, "complement": config.complement,
            "complement_positions": comp_positions if config.complement else None,
            "corpus": corpus.corpus,
            "text_file": None if corpus.text_file is None else str(corpus.text_file),
            "windows": corpus.windows, "window_tokens": corpus.window_tokens,
            "batch_size": size,
        },
        "single": lag_summary.summarize(single, positions),
    }
    if config.complement:
        comp = benefit(
            "complement", comp_positions,
            lambda batch: lag.all_positions_run(engine, batch, rec, progress=show),
            lambda batch, t, all_run: lag.complement_benefit(engine, batch, rec, [t], K,
                                                             all_run=all_run)[:, 0])
        summary["complement"] = lag_summary.summarize(comp, comp_positions)
        both = lag_summary.compare(single, positions, comp, comp_positions)
        if both is not None:
            summary["single_vs_complement"] = both
    run_dir.write_json("summary.json", summary)
    source = corpus.corpus if corpus.text_file is None else corpus.text_file
    title = (f"{model.name}: lag benefit, {rec!r}; {len(ids)} windows x {corpus.window_tokens} "
             f"tokens ({source}), t in {positions[0]}..{positions[-1]}, K={K}")
    out = run_dir.save_figure(plot_lag_analysis(summary["single"], summary.get("complement"),
                                                title), "lag_analysis.png")
    common.say(*report(summary), f"wrote {run_dir.path / 'summary.json'} and {out}")
    return 0


def report(summary: dict) -> list[str]:
    """The summary's headline numbers as lines of text."""
    s = summary["single"]
    fit, early, K = s["fit"], s["early"], len(s["mean_curve"]) - 1
    lines = [f"lag curve: mean benefit at k=1 {s['mean_curve'][1]:+.5f} (s.e. "
             f"{s['stderr'][1]:.5f}) nats, at k={K} {s['mean_curve'][-1]:+.5f}; "
             f"{s['n_lags_above_2se']} of {K} lags above +2 s.e., {s['n_lags_below_2se']} "
             f"below -2 s.e.; power law b={fit['b']:.3f} R^2={fit['r2']:.3f} "
             f"({fit['n_excluded']} non-positive lags left out)"]
    # A grid may sample only early (or only late) positions: that side has no mean.
    early_mean, late_mean = (f"{v:+.5f}" if v is not None else "none sampled"
                             for v in (early["mean_early"], early["mean_late"]))
    lines.append(f"early positions t<{early['threshold']}: mean {early_mean}; "
                 f"t>={early['threshold']}: {late_mean}")
    if "single_vs_complement" in summary:
        c = summary["single_vs_complement"]
        lines.append(f"complement: mean {c['mean_complement']:+.5f} vs single "
                     f"{c['mean_single']:+.5f}, correlation {c['correlation']:.3f}")
    return lines
