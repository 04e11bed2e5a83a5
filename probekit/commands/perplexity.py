"""``probekit perplexity``: baseline vs recirculated perplexity (docs/commands.md)."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import numpy as np

from probekit.commands.common import (
    FLAT,
    CorpusFlags,
    ModelFlags,
    RecirculationFlags,
    RunFlags,
    UsageError,
    say,
    set_threads,
)
from probekit.validation import check_fields


@dataclasses.dataclass(frozen=True)
class Config:
    """Baseline vs recirculated perplexity on a corpus, per window and overall, with a
    bootstrap interval over windows. Guide: docs/commands/perplexity.md."""

    model: Annotated[ModelFlags, FLAT] = ModelFlags()
    recirculation: Annotated[RecirculationFlags, FLAT] = RecirculationFlags()
    corpus: Annotated[CorpusFlags, FLAT] = CorpusFlags()
    temperature: float = 1.0
    """softmax temperature of both runs"""
    bootstrap: int = 1000
    """bootstrap resamples for the interval"""
    seed: int = 0
    """bootstrap seed"""
    run: Annotated[RunFlags, FLAT] = RunFlags()

    def __post_init__(self) -> None:
        check_fields(self)
        if self.seed < 0:
            raise UsageError(f"--seed must be >= 0; got {self.seed}")
        if not 0 < self.temperature < float("inf"):
            raise UsageError(f"--temperature must be a finite number > 0; got {self.temperature}")
        if self.bootstrap < 1:
            raise UsageError(f"--bootstrap must be >= 1; got {self.bootstrap}")


def run(config: Config) -> int:
    from probekit.analysis.perplexity import PerplexitySummary, window_log_probs
    from probekit.core.engine import StepEngine
    from probekit.core.models import load_model
    from probekit.runs import RunDir

    set_threads(config.model)
    model = load_model(config.model.model)
    rec = config.recirculation.build(model.n_blocks)
    windows = config.corpus.load(model)
    engine = StepEngine(model, config.model.backend)
    run_dir = RunDir.open("perplexity", config, model=model,
                          inputs={"text_file": config.corpus.text_file},
                          path=config.run.run_dir, fresh=config.run.fresh)
    say(f"model {model.name} ({model.n_blocks} blocks, hash {model.content_hash}); {rec}",
        f"{len(windows)} windows x {config.corpus.window_tokens} tokens; run dir {run_dir.path}")

    ids = [w.input_ids for w in windows]
    size, T = config.corpus.batch_size, config.temperature

    def compute(b0: int) -> dict:
        chunk = ids[b0 : b0 + size]
        base = window_log_probs(engine, chunk, None, batch_size=len(chunk), temperature=T)
        recd = window_log_probs(engine, chunk, rec, batch_size=len(chunk), temperature=T,
                                progress=config.run.progress)
        return {"base": base, "rec": recd, "input_ids": np.array(chunk)}

    parts = run_dir.map([(f"batch{b0:05d}", b0) for b0 in range(0, len(ids), size)], compute,
                        desc="perplexity", progress=config.run.progress).values()
    base = np.concatenate([p["base"] for p in parts])
    recd = np.concatenate([p["rec"] for p in parts])
    np.savez_compressed(run_dir.path / "token_log_probs.npz", base=base, rec=recd,
                        input_ids=np.concatenate([p["input_ids"] for p in parts]))
    s = PerplexitySummary.from_log_probs(base, recd, n_boot=config.bootstrap, seed=config.seed)

    say(f"\n{'window':>6} {'doc':<28} {'ppl base':>9} {'ppl rec':>9} {'change':>8}")
    for w, row in zip(windows, s.per_window, strict=True):
        say(f"{row['window']:>6} {w.doc_title[:28]:<28} {row['ppl_base']:>9.3f} "
            f"{row['ppl_rec']:>9.3f} {row['pct_change']:>+7.2f}%")
    say(f"\noverall ({s.n_tokens} predicted tokens): ppl {s.ppl_base:.3f} -> {s.ppl_rec:.3f}, "
        f"{s.pct_change:+.2f}% (95% bootstrap CI over windows {s.ci_low:+.2f}% .. "
        f"{s.ci_high:+.2f}%)")
    verdict = ("lower perplexity (helps)" if s.ci_high < 0 else
               "higher perplexity (hurts)" if s.ci_low > 0 else
               "no change distinguishable from zero at this size")
    say(f"recirculation gives {verdict}")
    summary = {**s.__dict__, "recurrence": repr(rec), "verdict": verdict}
    say(f"wrote {run_dir.write_json('summary.json', summary)}")
    return 0
