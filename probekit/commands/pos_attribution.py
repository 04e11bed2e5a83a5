"""``probekit pos-attribution``: which parts of speech recirculation helps
(docs/commands/pos-attribution.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Annotated

import numpy as np

from probekit.analysis.pos_attribution import DEFAULT_SELECTIVE
from probekit.commands import common
from probekit.commands.common import FLAT, CorpusFlags, ModelFlags, RecirculationFlags, RunFlags
from probekit.runs import not_identity
from probekit.validation import check_fields


@dataclasses.dataclass(frozen=True)
class ExtendableCorpusFlags(CorpusFlags):
    """Corpus flags whose window count and batch size stay out of the run identity: windows
    come in a fixed order and each is its own part, so more windows extend a run."""

    windows: int = not_identity(8)
    """number of windows (a later call with more reuses the finished ones)"""
    batch_size: int = not_identity(8)
    """windows per batch"""


@dataclasses.dataclass(frozen=True)
class Config:
    """Perplexity change per part of speech of the predicted token (paper Fig. 9c), and
    selective recirculation of one tag vs random positions (Fig. C.3).
    Guide: docs/commands/pos-attribution.md."""

    model: Annotated[ModelFlags, FLAT] = ModelFlags()
    recirculation: Annotated[RecirculationFlags, FLAT] = RecirculationFlags()
    corpus: Annotated[ExtendableCorpusFlags, FLAT] = ExtendableCorpusFlags(window_tokens=128)
    selective: tuple[str, ...] = not_identity(DEFAULT_SELECTIVE)
    """tags (e.g. ADV NOUN.pl) to recirculate vs count-matched random positions; all; none"""
    noun_number: bool = not_identity(False)
    """also report singular (NOUN.sg) and plural (NOUN.pl) nouns"""
    bootstrap: int = not_identity(1000)
    """bootstrap resamples over windows"""
    confidence: float = not_identity(0.95)
    """confidence level of the intervals"""
    seed: int = 0
    """seed of the random controls and the bootstrap"""
    run: Annotated[RunFlags, FLAT] = RunFlags()

    def __post_init__(self) -> None:
        check_fields(self)
        if self.seed < 0:
            raise common.UsageError(f"--seed must be >= 0; got {self.seed}")
        if self.bootstrap < 1:
            raise common.UsageError(f"--bootstrap must be >= 1; got {self.bootstrap}")
        if not 0 < self.confidence < 1:
            raise common.UsageError(f"--confidence must lie in (0, 1); got {self.confidence}")
        self.tags()

    def tags(self) -> tuple[str, ...]:
        """The ``--selective`` tags (items may also be comma-separated: ``ADV,DET``)."""
        from probekit.analysis.pos_attribution import parse_tags

        return parse_tags(",".join(self.selective), noun_number=self.noun_number)


def run(config: Config) -> int:
    import torch

    from probekit.analysis import pos_attribution as pos
    from probekit.core.engine import StepEngine
    from probekit.core.models import load_model
    from probekit.data.corpora import load_corpus
    from probekit.data.postag import ensure_tagger
    from probekit.plots.pos_attribution import plot_selective, plot_tag_changes
    from probekit.runs import RunDir

    common.set_threads(config.model)
    selective, corpus, progress = config.tags(), config.corpus, config.run.progress
    ensure_tagger()  # a missing textblob-aptagger raises an error that names the fix
    model = load_model(config.model.model)
    rec = config.recirculation.build(model.n_blocks)
    windows = corpus.load(model)
    documents = load_corpus(corpus.corpus, text_file=corpus.text_file)
    engine = StepEngine(model, config.model.backend)
    run_dir = RunDir.open("pos-attribution", config, model=model,
                          inputs={"text_file": corpus.text_file},
                          path=config.run.run_dir, fresh=config.run.fresh)
    common.say(
        f"model {model.name} ({model.n_blocks} blocks, hash {model.content_hash}); {rec}",
        f"{len(windows)} windows x {corpus.window_tokens} tokens; selective: "
        f"{', '.join(selective) or 'none'}; run dir {run_dir.path}")

    ids = torch.tensor([w.input_ids for w in windows])
    tags = [pos.window_tags(w, documents[w.doc_index].text) for w in windows]

    def per_window(prefix: str, compute: Callable[[list[int]], dict]) -> list[dict]:
        """One part per window (``prefix-00000``...), computed ``--batch-size`` at a time."""
        def rows_of(rows: list[int]) -> list[dict]:
            out = compute(rows)
            return [{k: v[j] for k, v in out.items()} for j in range(len(rows))]

        parts = run_dir.map([(f"{prefix}-{i:05d}", i) for i in range(len(windows))],
                            _in_batches(rows_of, len(windows), corpus.batch_size),
                            desc=prefix, progress=progress)
        return list(parts.values())

    whole = per_window("window", lambda rows: {
        "input_ids": ids[rows].numpy(), **pos.score_windows(engine, ids[rows], rec,
                                                            progress=progress),
        "universal": np.stack([tags[i].universal for i in rows]),
        "fine": np.stack([tags[i].fine for i in rows])})
    for i, part in enumerate(whole):
        if not np.array_equal(part["input_ids"], ids[i].numpy()):
            raise ValueError(f"{run_dir.path} holds window {i} with other tokens (a changed "
                             "corpus or tokenizer?): pass --fresh or another --run-dir")
    chosen = {tag: per_window(f"selective-{_part_key(tag)}", lambda rows, tag=tag:
                              pos.score_selective(engine, ids[rows], rec, [tags[i] for i in rows],
                                                  rows, tag, seed=config.seed, progress=progress))
              for tag in selective}

    base = np.stack([p["base"] for p in whole])
    boot = {"n_boot": config.bootstrap, "level": config.confidence, "seed": config.seed}
    per_tag = pos.tag_changes(base, np.stack([p["rec"] for p in whole]), tags,
                              pos.reported_tags(tags, noun_number=config.noun_number), **boot)
    sel_rows = [pos.selective_changes(
        base, np.stack([p["tag"] for p in sp]), np.stack([p["random"] for p in sp]),
        sum(int(p["mask"].sum()) for p in sp), tag, **boot) for tag, sp in chosen.items()]
    pct = f"{100 * config.confidence:.0f}% CI"
    common.say(*per_tag_table(per_tag, pct), *selective_table(sel_rows))
    summary = {
        "n_windows": len(windows), "window_tokens": corpus.window_tokens,
        "windows": [{"doc": w.doc_title, "start_token": w.start_token} for w in windows],
        "tag_of": {"per_tag": "the predicted token x[t+1]",
                   "selective": "the recirculated position's own token x[t]"},
        "interval": f"{pct}, percentile bootstrap over windows, {config.bootstrap} resamples, "
                    f"seed {config.seed}",
        "analysis": {"windows": corpus.windows, "batch_size": corpus.batch_size,
                     "selective": ",".join(config.selective),
                     "noun_number": config.noun_number, "bootstrap": config.bootstrap,
                     "confidence": config.confidence},
        "per_tag": per_tag, "selective": sel_rows, "recurrence": repr(rec),
    }
    source = corpus.corpus if corpus.text_file is None else corpus.text_file
    title = (f"{model.name}, {rec!r}\n{len(windows)} windows x {corpus.window_tokens} tokens "
             f"({source}), {100 * config.confidence:.0f}% bootstrap CI over windows")
    wrote = [run_dir.save_figure(plot_tag_changes(per_tag, title), "pos_attribution.png")]
    if sel_rows:
        wrote.append(run_dir.save_figure(plot_selective(sel_rows, title), "pos_selective.png"))
    wrote.append(run_dir.write_json("summary.json", summary))
    common.say(*(f"wrote {p}" for p in wrote))
    return 0


def _in_batches(compute_rows: Callable[[list[int]], list], n: int, size: int):
    """``compute(i)`` for :meth:`RunDir.map` over items ``0 .. n-1``: the first item asked
    for runs with the ``size - 1`` after it in one batch, whose other results are handed
    out as they are asked for (finished items are loaded by ``map``, never asked for)."""
    ready: dict[int, object] = {}

    def compute(i: int):
        if i not in ready:
            rows = list(range(i, min(i + size, n)))
            ready.clear()
            ready.update(zip(rows, compute_rows(rows), strict=True))
        return ready.pop(i)

    return compute


def _part_key(tag: str) -> str:
    return {".": "PUNCT"}.get(tag, tag)


def _ci(lo, hi) -> str:
    return "n/a" if lo is None or hi is None else f"[{lo:+.2f}, {hi:+.2f}]"


def per_tag_table(rows: Sequence[dict], pct: str) -> list[str]:
    lines = ["", "Net change in perplexity of the predicted tokens of each tag, all positions "
             "recirculated", f"{'tag':<8} {'tokens':>7} {'ppl base':>9} {'ppl rec':>9} "
             f"{'change':>8}  {pct}"]
    for r in sorted(rows, key=lambda r: (r["tag"] != "all", r["change"] or 0)):
        if r["n_tokens"]:
            lines.append(f"{r['tag']:<8} {r['n_tokens']:>7} {r['ppl_base']:>9.3f} "
                         f"{r['ppl_rec']:>9.3f} {r['change']:>+7.2f}%  "
                         f"{_ci(r['ci_low'], r['ci_high'])}")
    return lines


def selective_table(rows: Sequence[dict]) -> list[str]:
    if not rows:
        return []
    lines = ["", "Selective recirculation: % change in perplexity over all tokens",
             f"{'tag':<8} {'recirc':>7} {'tag positions':>28} {'random positions':>28} "
             f"{'tag - random':>28}"]
    for r in rows:
        cells = [f"{r[f'{k}_change' if k != 'difference' else k]:>+7.2f}"
                 f"{'%' if k != 'difference' else ' '} "
                 f"{_ci(r[f'{k}_ci_low'], r[f'{k}_ci_high']):>19}"
                 for k in ("tag", "random", "difference")]
        lines.append(f"{r['tag']:<8} {r['n_recirculated']:>7} " + " ".join(cells))
    return lines
