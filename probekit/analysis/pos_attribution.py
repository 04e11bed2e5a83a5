"""Part-of-speech attribution: which tokens does recirculation help? (paper Sec. 4.4.4)

    probekit pos-attribution --source 20 --destination 10 --alpha 0.1        # 8 x 128 tokens
    probekit pos-attribution ... --noun-number --selective all --windows 32

Two experiments on the same windows (SEMANTICS.md "Part-of-speech attribution";
``papers/recirculation.md`` Sec. 4.4.4, Fig. 9c, App. C.4, Fig. C.3):

**1. Net change per tag (Fig. 9c).** Every window is scored by the plain model (one
parallel forward) and with every position recirculated (token by token). The
prediction made at position ``t`` scores the token ``x[t+1]``, and it is attributed to
the tag of that **predicted** token ``x[t+1]`` (the paper reports the change "for
tokens classified according to their PoS": how much better tokens of a class are
predicted). For a tag ``g`` whose predicted tokens are ``G``::

    change(g) = 100 * (exp(mean_G NLL_rec) / exp(mean_G NLL_base) - 1)     [%]

negative = recirculation lowers the perplexity of tokens of class ``g``. (The paper's
App. C.4 suggests its Fig. 9c was pooled from single-position recirculation runs over
lags; SEMANTICS.md fixes the all-token definition above, which is what this computes.)

**2. Selective recirculation (Fig. C.3).** For a tag ``g``, recirculate all and only
the positions whose own token ``x[t]`` has tag ``g`` (here the tag belongs to the
**recirculated** position). The control recirculates a count-matched random set of
positions: in every window, exactly as many positions as that window has tokens of
``g``, drawn uniformly without replacement from the window's tagged positions (any
tag, so it may overlap ``g``'s own positions; untagged white-space tokens are never
drawn), seeded by ``(seed, window index, tag)`` so that it does not depend on
batching. Both are scored as the change in perplexity over **all** predicted tokens of
the windows against the plain model.

Intervals are percentile bootstraps over windows (the independent units; tokens in a
window are correlated), the same resampling scheme as
:func:`probekit.analysis.perplexity.bootstrap_ci`. Every statistic of a run uses the same
resamples (same seed), so "tag minus random" is a paired difference. A resample that
holds no token of a rare tag is left out of that tag's interval; the count of such
resamples is reported.

**Exact sparse schedule.** A selective run recirculates few positions, so it need not
step token by token: :func:`sparse_chunks` cuts the window into chunks that each end at
a recirculated position (of any row of the batch) and the engine runs each chunk's
first pass in parallel. This is exact, not the blockwise approximation: positions
before the last one in a chunk do not recirculate, so their first-pass keys/values
are final, the last position's first pass sees exactly them, and its second pass
recomputes the others' keys/values unchanged (:class:`Recirculation` leaves
inactive positions at ``z'_d = z_d``). A test pins equality with the token-by-token run.

Tags come from :mod:`probekit.data.postag` (``nltk.pos_tag`` through the offline
textblob-aptagger conversion; run ``python -m probekit.data.postag`` once, or let this
command do it), tagging whole paragraphs around each window so sentences cut by the
window's edges are tagged in context. Universal tagset (Petrov et al. 2012); with
``--noun-number`` the rows ``NOUN.sg`` (NN, NNP) and ``NOUN.pl`` (NNS, NNPS) are added
(the paper's singular/plural finding).

Run directory (:mod:`probekit.runs`): one part per window, ``window-00000`` (ids,
tags, baseline and recirculated log-probs), and one per window and selective tag,
``selective-ADV-00000`` (mask, control mask and both runs' log-probs), so an
interrupted run resumes; then ``summary.json``, ``pos_attribution.png`` and
``pos_selective.png``. The folder's config hash leaves out ``--windows``,
``--selective``, ``--noun-number``, ``--bootstrap``, ``--confidence`` and
``--batch-size`` (the summary records them): they only choose which parts are made and
read (windows come in a fixed order, so the first ``N`` are the same for every
``--windows N``), so a later call with more windows or more tags reuses every
finished part and adds the missing ones.
"""

from __future__ import annotations

import argparse
import math
import warnings
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from probekit.core.engine import RunResult, StepEngine
from probekit.data.postag import NOUN_PLURAL, NOUN_SINGULAR
from probekit.mechanisms.recirculation import Recirculation

UNIVERSAL_TAGS = ("ADJ", "ADP", "ADV", "CONJ", "DET", "NOUN", "NUM", "PRON", "PRT", "VERB",
                  ".", "X")
NUMBER_TAGS = (NOUN_SINGULAR, NOUN_PLURAL)
# the paper's two most-helped and two least-helped classes (Fig. 9c); `all` for every tag
DEFAULT_SELECTIVE = ("ADV", "ADJ", "DET", "PRON")


# ------------------------------------------------------------------ tags per token
@dataclass(frozen=True)
class WindowTags:
    """Tags of one window's tokens, ``""`` where a token has no word (BOS, white space).

    Attributes:
        universal: ``[T]`` universal tag per token.
        fine: ``[T]`` the universal tag, with nouns split into ``NOUN.sg``/``NOUN.pl``.
    """

    universal: np.ndarray
    fine: np.ndarray

    def has(self, tag: str) -> np.ndarray:
        """``[T]`` bool: which tokens carry ``tag`` (a universal tag or ``NOUN.sg/pl``)."""
        return (self.universal == tag) | (self.fine == tag)

    @property
    def tagged(self) -> np.ndarray:
        """``[T]`` bool: tokens that belong to a word (the control's candidates)."""
        return self.universal != ""


def window_tags(window, document_text: str | None = None) -> WindowTags:
    """Tag a :class:`probekit.data.corpora.Window` (whole paragraphs when the text is given)."""
    from probekit.data.postag import noun_number_tag, token_words

    words = token_words(window, document_text)
    universal = [w.universal if w else "" for w in words]
    fine = [noun_number_tag(w.penn, w.universal) if w else "" for w in words]
    return WindowTags(np.array(universal, dtype="<U8"), np.array(fine, dtype="<U8"))


def parse_tags(spec: str, *, noun_number: bool) -> tuple[str, ...]:
    """``--selective``: ``"ADV,DET"``, ``"all"`` or ``"none"`` -> a tuple of tags."""
    spec = spec.strip()
    if spec.lower() == "none":
        return ()
    if spec.lower() == "all":
        return UNIVERSAL_TAGS + (NUMBER_TAGS if noun_number else ())
    tags = tuple(t.strip() for t in spec.split(",") if t.strip())
    known = UNIVERSAL_TAGS + NUMBER_TAGS
    bad = [t for t in tags if t not in known]
    if bad or not tags:
        raise ValueError(
            f"--selective: unknown tag(s) {', '.join(map(repr, bad)) or repr(spec)}; give a "
            f"comma-separated list of {', '.join(known)} (or all, or none)")
    if len(set(tags)) != len(tags):
        raise ValueError(f"--selective lists a tag twice: {spec!r}")
    return tags


# --------------------------------------------------------------- selective runs
def sparse_chunks(mask: Tensor | np.ndarray) -> list[int]:
    """Chunk sizes (summing to ``T``) such that every chunk ends at a position that
    some row of ``mask`` (``[T]`` or ``[B, T]`` bool) recirculates and no other position
    of a chunk recirculates; a final chunk holds the positions after the last one."""
    mask = torch.as_tensor(np.asarray(mask), dtype=torch.bool)
    active = mask.reshape(-1, mask.shape[-1]).any(0)
    ends = (torch.nonzero(active).flatten() + 1).tolist()
    seq = active.shape[0]
    if not ends or ends[-1] != seq:
        ends.append(seq)
    return np.diff([0, *ends]).tolist()


def run_masked(engine: StepEngine, input_ids: Tensor, recurrence: Recirculation,
               mask: Tensor, *, progress: bool = False) -> RunResult:
    """``engine.run(input_ids, recurrence, mask=mask)`` (``[B, T]`` ids and mask), exactly,
    on the sparse schedule of :func:`sparse_chunks` (module docstring). Valid for
    :class:`Recirculation`, which acts only after the first pass and only where masked."""
    if not isinstance(recurrence, Recirculation):
        raise TypeError("run_masked's chunked schedule is exact only for Recirculation; got "
                        f"{type(recurrence).__name__}")
    return engine.run(input_ids, recurrence, mask=mask, block_size=sparse_chunks(mask),
                      progress=progress)


def control_rng(seed: int, window_index: int, tag: str) -> np.random.Generator:
    """The generator of the random control for ``tag`` in window ``window_index``."""
    return np.random.default_rng([seed, window_index, zlib.crc32(tag.encode())])


def count_matched_control(tag_mask: np.ndarray, candidates: np.ndarray,
                          rng: np.random.Generator) -> np.ndarray:
    """``[T]`` bool: ``tag_mask.sum()`` positions drawn uniformly without replacement from
    ``candidates`` (``[T]`` bool; it must hold every position of ``tag_mask``)."""
    tag_mask, candidates = np.asarray(tag_mask, bool), np.asarray(candidates, bool)
    if (tag_mask & ~candidates).any():
        raise ValueError("every position of tag_mask must be a candidate")
    out = np.zeros_like(tag_mask)
    out[rng.choice(np.flatnonzero(candidates), size=int(tag_mask.sum()), replace=False)] = True
    return out


# ------------------------------------------------------------------ statistics
def pct_change_from_sums(base_sum, rec_sum, count):
    """``100 * (exp(mean NLL_rec - mean NLL_base) - 1)`` from sums of log-probs and the
    token count (arrays broadcast; NaN where ``count == 0``)."""
    base_sum, rec_sum, count = map(np.asarray, (base_sum, rec_sum, count))
    with np.errstate(invalid="ignore", divide="ignore"):
        return 100.0 * np.expm1((base_sum - rec_sum) / count)


def bootstrap_samples(base_sum: np.ndarray, rec_sum: np.ndarray, count: np.ndarray, *,
                      n_boot: int = 1000, seed: int = 0) -> np.ndarray:
    """``[n_boot, G]`` :func:`pct_change_from_sums` of resampled windows.

    ``base_sum, rec_sum, count`` are ``[W, G]`` per-window sums for ``G`` statistics; all
    ``G`` use the same resamples, the window indices drawn as in
    :func:`probekit.analysis.perplexity.bootstrap_ci` (so equal seeds give equal resamples).
    NaN where a resample holds no token of a statistic.
    """
    base_sum, rec_sum, count = (np.asarray(a, float) for a in (base_sum, rec_sum, count))
    n_windows = base_sum.shape[0]
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.integers(0, n_windows, n_windows) for _ in range(n_boot)])
    return pct_change_from_sums(base_sum[idx].sum(1), rec_sum[idx].sum(1), count[idx].sum(1))


def percentile_interval(samples: np.ndarray, level: float = 0.95) -> dict:
    """``{"ci_low", "ci_high", "dropped"}`` (each ``[G]``) of ``[n_boot, G]`` samples;
    NaN samples (resamples without a token of the tag) are left out and counted."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN column -> NaN interval
        lo, hi = np.nanquantile(samples, [(1 - level) / 2, (1 + level) / 2], axis=0)
    return {"ci_low": lo, "ci_high": hi, "dropped": np.isnan(samples).sum(0)}


def window_bootstrap(base_sum: np.ndarray, rec_sum: np.ndarray, count: np.ndarray, *,
                     n_boot: int = 1000, level: float = 0.95, seed: int = 0) -> dict:
    """Point estimate and percentile interval over windows of :func:`pct_change_from_sums`
    for ``[W, G]`` per-window sums: ``{"change", "ci_low", "ci_high", "dropped"}``,
    each ``[G]``. Fewer than two windows give no interval (NaN)."""
    change = pct_change_from_sums(np.sum(base_sum, 0), np.sum(rec_sum, 0), np.sum(count, 0))
    if len(base_sum) < 2:
        nan = np.full(change.shape, np.nan)
        return {"change": change, "ci_low": nan, "ci_high": nan,
                "dropped": np.zeros(change.shape, int)}
    samples = bootstrap_samples(base_sum, rec_sum, count, n_boot=n_boot, seed=seed)
    return {"change": change, **percentile_interval(samples, level)}


def tag_changes(base: np.ndarray, rec: np.ndarray, tags: Sequence[WindowTags],
                tag_names: Sequence[str], **bootstrap) -> list[dict]:
    """Part 1: per tag, the net % change in perplexity of the predicted tokens of that tag.

    ``base``, ``rec``: ``[W, T-1]`` log-probs (entry ``t`` scores token ``t+1``);
    ``tags``: per window. Row ``"all"`` is every predicted token. Keyword arguments go to
    :func:`window_bootstrap`.
    """
    names = ["all", *tag_names]
    base, rec = np.asarray(base, np.float64), np.asarray(rec, np.float64)
    # [W, T-1, G]: does the PREDICTED token x[t+1] carry the tag
    has = np.stack([np.stack([np.ones(len(wt.universal) - 1, bool)]
                             + [wt.has(g)[1:] for g in tag_names], -1) for wt in tags])
    s_base = (base[..., None] * has).sum(1)
    s_rec = (rec[..., None] * has).sum(1)
    count = has.sum(1)
    stats = window_bootstrap(s_base, s_rec, count, **bootstrap)
    rows = []
    for j, name in enumerate(names):
        n = int(count[:, j].sum())
        rows.append({
            "tag": name, "n_tokens": n, "n_windows": int((count[:, j] > 0).sum()),
            "ppl_base": math.exp(-s_base[:, j].sum() / n) if n else None,
            "ppl_rec": math.exp(-s_rec[:, j].sum() / n) if n else None,
            **{k: _num(v[j]) for k, v in stats.items()},
        })
    return rows


def selective_changes(base: np.ndarray, tag_lp: np.ndarray, random_lp: np.ndarray,
                      n_recirculated: int, tag: str, *, n_boot: int = 1000,
                      level: float = 0.95, seed: int = 0) -> dict:
    """Part 2 for one tag: % change over all predicted tokens (``[W, T-1]`` log-probs)
    with the tag's positions and with the count-matched random positions recirculated,
    and their paired difference (tag minus random, in percentage points)."""
    base, tag_lp, random_lp = (np.asarray(a, np.float64) for a in (base, tag_lp, random_lp))
    s_base = np.repeat(base.sum(1)[:, None], 2, 1)
    s_rec = np.stack([tag_lp.sum(1), random_lp.sum(1)], 1)
    count = np.full(s_base.shape, base.shape[1])
    change = pct_change_from_sums(s_base.sum(0), s_rec.sum(0), count.sum(0))
    if len(base) >= 2:
        samples = bootstrap_samples(s_base, s_rec, count, n_boot=n_boot, seed=seed)
        samples = np.concatenate([samples, samples[:, :1] - samples[:, 1:]], 1)
        ci = percentile_interval(samples, level)
        lo, hi = ci["ci_low"], ci["ci_high"]
    else:
        lo = hi = np.full(3, np.nan)
    return {"tag": tag, "n_recirculated": int(n_recirculated),
            "tag_change": _num(change[0]), "tag_ci_low": _num(lo[0]),
            "tag_ci_high": _num(hi[0]), "random_change": _num(change[1]),
            "random_ci_low": _num(lo[1]), "random_ci_high": _num(hi[1]),
            "difference": _num(change[0] - change[1]), "difference_ci_low": _num(lo[2]),
            "difference_ci_high": _num(hi[2])}


def _num(x) -> float | int | None:
    x = x.item() if hasattr(x, "item") else x
    return None if isinstance(x, float) and math.isnan(x) else x


# ------------------------------------------------------------------------ plots
def plot_tag_changes(rows: Sequence[dict], title: str, *, min_tokens: int = 20):
    """Bar plot of Part 1: tags sorted by % change, bootstrap intervals as error bars.
    Tags with fewer than ``min_tokens`` predicted tokens are named under the plot but not
    drawn (a handful of tokens gives a huge, meaningless bar)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    everything = next((r for r in rows if r["tag"] == "all"), None)
    rare = [r for r in rows if 0 < r["n_tokens"] < min_tokens and r["tag"] != "all"]
    rows = sorted((r for r in rows if r["n_tokens"] >= min_tokens and r["tag"] != "all"),
                  key=lambda r: r["change"])
    fig, ax = plt.subplots(figsize=(max(5.0, 0.6 * len(rows) + 1.5), 3.8))
    x = np.arange(len(rows))
    change = np.array([r["change"] for r in rows])
    ax.bar(x, change, color=["tab:blue" if c < 0 else "tab:red" for c in change],
           hatch=["//" if r["tag"] in NUMBER_TAGS else "" for r in rows], edgecolor="white")
    _error_bars(ax, x, rows, "change", "ci_low", "ci_high")
    ax.axhline(0, color="black", lw=0.8)
    if everything and everything["change"] is not None:
        ax.axhline(everything["change"], color="gray", ls="--", lw=1,
                   label=f"all tokens ({everything['change']:+.2f}%)")
        ax.legend(fontsize=8)
    ax.set_xticks(x, [f"{r['tag']}\n{r['n_tokens']}" for r in rows], fontsize=8)
    ax.set_ylabel("% change in perplexity\n(negative = recirculation helps)")
    label = "tag of the predicted token (count of tokens)"
    if rare:
        label += (f"\nnot shown (< {min_tokens} tokens): "
                  + ", ".join(f"{r['tag']} ({r['n_tokens']})" for r in rare))
    ax.set_xlabel(label)
    ax.set_title(title, fontsize=9)
    return fig


def plot_selective(rows: Sequence[dict], title: str):
    """Bar plot of Part 2, as paper Fig. C.3: blue = the tag's positions recirculated,
    grey = a count-matched random set; bootstrap intervals as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(rows) + 1.5), 3.8))
    x = np.arange(len(rows))
    w = 0.38
    for off, key, color, label in ((-w / 2, "tag", "tab:blue", "positions of the tag"),
                                   (w / 2, "random", "tab:gray", "count-matched random")):
        ax.bar(x + off, [r[f"{key}_change"] for r in rows], w, color=color, label=label)
        _error_bars(ax, x + off, rows, f"{key}_change", f"{key}_ci_low", f"{key}_ci_high")
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(x, [f"{r['tag']}\n{r['n_recirculated']}" for r in rows], fontsize=8)
    ax.set_ylabel("% change in perplexity (all tokens)\n(negative = helps)")
    ax.set_xlabel("recirculated tag (count of recirculated positions)")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    return fig


def _error_bars(ax, x, rows, mid, lo, hi) -> None:
    y = np.array([r[mid] for r in rows], float)
    low = np.array([np.nan if r[lo] is None else r[lo] for r in rows], float)
    high = np.array([np.nan if r[hi] is None else r[hi] for r in rows], float)
    ok = ~(np.isnan(low) | np.isnan(high))
    if ok.any():
        ax.errorbar(np.asarray(x)[ok], y[ok], yerr=[y[ok] - low[ok], high[ok] - y[ok]],
                    fmt="none", ecolor="black", capsize=3, lw=1)


# ---------------------------------------------------------------------------- CLI
def add_cli(sub) -> None:
    from probekit.analysis.perplexity import add_corpus_args, add_recirculation_args
    from probekit.commands.main import add_model_args, add_run_args

    p = sub.add_parser("pos-attribution",
                       help="which parts of speech recirculation helps (paper Fig. 9c, C.3)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_recirculation_args(p)
    add_corpus_args(p, windows=8, window_tokens=128)
    p.add_argument("--selective", default=",".join(DEFAULT_SELECTIVE),
                   help="tags to recirculate selectively against a count-matched random set: "
                        "a comma-separated list, all, or none (default %(default)s; each tag "
                        "costs two recirculated runs)")
    p.add_argument("--noun-number", action="store_true",
                   help="also report singular (NOUN.sg) and plural (NOUN.pl) nouns")
    p.add_argument("--bootstrap", type=int, default=1000,
                   help="bootstrap resamples over windows (default %(default)s)")
    p.add_argument("--confidence", type=float, default=0.95,
                   help="confidence level of the intervals (default %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random controls and the bootstrap")
    add_run_args(p)
    p.set_defaults(func=run_cli)


ANALYSIS = ("selective", "noun_number", "bootstrap", "confidence")


def _part_key(tag: str) -> str:
    return {".": "PUNCT"}.get(tag, tag)


def run_cli(args) -> int:
    from probekit.analysis.perplexity import corpus_windows_from_args, recirculation_from_args
    from probekit.core.models import load_model
    from probekit.data.corpora import load_corpus
    from probekit.data.postag import ensure_tagger
    from probekit.runs import RunDir

    # Validate everything cheap, and the tagger, before loading the model.
    rec = recirculation_from_args(args)
    selective = parse_tags(args.selective, noun_number=args.noun_number)
    if args.bootstrap < 1:
        raise ValueError(f"--bootstrap must be >= 1; got {args.bootstrap}")
    if not 0 < args.confidence < 1:
        raise ValueError(f"--confidence must lie in (0, 1); got {args.confidence}")
    ensure_tagger()  # a missing textblob-aptagger raises an error that names the fix
    model = load_model(args.model)
    rec.check(model.n_blocks)
    windows = corpus_windows_from_args(args, model)
    documents = load_corpus(args.corpus, text_file=args.text_file)
    engine = StepEngine(model, args.backend)
    # The run's identity is what a window's parts depend on. The number of windows, the
    # tags analysed, the noun split and the intervals only choose which parts are made
    # and read (summary.json records them), so a later call with more windows or tags
    # reuses every finished part. make_windows's order is prefix-stable, and each part's
    # tokens are checked against its window below.
    config = {k: v for k, v in vars(args).items()
              if k not in ("func", "no_progress", "fresh", "run_dir", "threads", "batch_size",
                           "windows", *ANALYSIS)}
    config["model_hash"] = model.content_hash
    run = RunDir.open("pos-attribution", config, model=model, path=args.run_dir,
                      fresh=args.fresh)
    progress = not args.no_progress
    print(f"model {model.name} ({model.n_blocks} blocks, hash {model.content_hash}); {rec}")
    print(f"{len(windows)} windows x {args.window_tokens} tokens; selective: "
          f"{', '.join(selective) or 'none'}; run dir {run.path}")

    ids_all = torch.tensor([w.input_ids for w in windows])
    for i in range(len(windows)):
        if run.has_part(f"window-{i:05d}") and not np.array_equal(
                run.load_part(f"window-{i:05d}")["input_ids"], ids_all[i].numpy()):
            raise ValueError(f"{run.path} holds window {i} with other tokens (a changed "
                             "corpus or tokenizer?): pass --fresh or another --run-dir")
    tags = [window_tags(w, documents[w.doc_index].text) for w in windows]
    units = []  # (tag or None for Part 1, windows of one batch), only windows not yet done
    for tag in (None, *selective):
        prefix = "window" if tag is None else f"selective-{_part_key(tag)}"
        todo = [i for i in range(len(windows)) if not run.has_part(f"{prefix}-{i:05d}")]
        units += [(tag, prefix, todo[b:b + args.batch_size])
                  for b in range(0, len(todo), args.batch_size)]
    for tag, prefix, rows in tqdm(units, desc="pos-attribution", unit="batch",
                                  disable=not progress):
        ids = ids_all[rows]
        if tag is None:
            base = engine.forward(ids).log_probs.numpy()
            recd = engine.run(ids, rec, progress=progress).log_probs.numpy()
            for j, i in enumerate(rows):
                run.save_part(f"window-{i:05d}", input_ids=ids[j].numpy(), base=base[j],
                              rec=recd[j], universal=tags[i].universal, fine=tags[i].fine)
            continue
        mask = np.stack([tags[i].has(tag) for i in rows])
        control = np.stack([count_matched_control(tags[i].has(tag), tags[i].tagged,
                                                  control_rng(args.seed, i, tag)) for i in rows])
        tag_lp = run_masked(engine, ids, rec, torch.from_numpy(mask), progress=progress)
        rand_lp = run_masked(engine, ids, rec, torch.from_numpy(control), progress=progress)
        for j, i in enumerate(rows):
            run.save_part(f"{prefix}-{i:05d}", mask=mask[j], control=control[j],
                          tag=tag_lp.log_probs[j].numpy(), random=rand_lp.log_probs[j].numpy())

    summary = summarise(run, windows, tags, selective, args)
    summary["recurrence"] = repr(rec)
    title = (f"{model.name}, {rec!r}\n{len(windows)} windows x {args.window_tokens} tokens "
             f"({args.corpus if args.text_file is None else args.text_file}), "
             f"{100 * args.confidence:.0f}% bootstrap CI over windows")
    fig = plot_tag_changes(summary["per_tag"], title)
    print(f"wrote {run.save_figure(fig, 'pos_attribution.png')}")
    if summary["selective"]:
        fig = plot_selective(summary["selective"], title)
        print(f"wrote {run.save_figure(fig, 'pos_selective.png')}")
    print(f"wrote {run.write_json('summary.json', summary)}")
    return 0


def summarise(run, windows, tags: Sequence[WindowTags], selective: Sequence[str], args) -> dict:
    """Read the parts back, compute both tables, print them; returns the summary dict."""
    parts = [run.load_part(f"window-{i:05d}") for i in range(len(windows))]
    base = np.stack([p["base"] for p in parts])
    recd = np.stack([p["rec"] for p in parts])
    boot = {"n_boot": args.bootstrap, "level": args.confidence, "seed": args.seed}
    present = {g for wt in tags for g in wt.universal[1:] if g}
    names = [g for g in UNIVERSAL_TAGS if g in present]
    if args.noun_number:
        names += list(NUMBER_TAGS)
    per_tag = tag_changes(base, recd, tags, names, **boot)

    pct = f"{100 * args.confidence:.0f}% CI"
    print("\nNet change in perplexity of the predicted tokens of each tag, all positions "
          f"recirculated\n{'tag':<8} {'tokens':>7} {'ppl base':>9} {'ppl rec':>9} "
          f"{'change':>8}  {pct}")
    for r in sorted(per_tag, key=lambda r: (r["tag"] != "all", r["change"] or 0)):
        if r["n_tokens"]:
            print(f"{r['tag']:<8} {r['n_tokens']:>7} {r['ppl_base']:>9.3f} {r['ppl_rec']:>9.3f} "
                  f"{r['change']:>+7.2f}%  {_ci(r['ci_low'], r['ci_high'])}")

    sel_rows = []
    for tag in selective:
        sp = [run.load_part(f"selective-{_part_key(tag)}-{i:05d}") for i in range(len(windows))]
        n = int(sum(p["mask"].sum() for p in sp))
        assert n == int(sum(p["control"].sum() for p in sp))  # count-matched by construction
        sel_rows.append(selective_changes(base, np.stack([p["tag"] for p in sp]),
                                          np.stack([p["random"] for p in sp]), n, tag, **boot))
    if sel_rows:
        print(f"\nSelective recirculation: % change in perplexity over all tokens\n"
              f"{'tag':<8} {'recirc':>7} {'tag positions':>28} {'random positions':>28} "
              f"{'tag - random':>28}")
        for r in sel_rows:
            cells = [f"{r[f'{k}_change' if k != 'difference' else k]:>+7.2f}"
                     f"{'%' if k != 'difference' else ' '} "
                     f"{_ci(r[f'{k}_ci_low'], r[f'{k}_ci_high']):>19}"
                     for k in ("tag", "random", "difference")]
            print(f"{r['tag']:<8} {r['n_recirculated']:>7} " + " ".join(cells))
    return {
        "n_windows": len(windows), "window_tokens": args.window_tokens,
        "windows": [{"doc": w.doc_title, "start_token": w.start_token} for w in windows],
        "tag_of": {"per_tag": "the predicted token x[t+1]",
                   "selective": "the recirculated position's own token x[t]"},
        "interval": f"{pct}, percentile bootstrap over windows, {args.bootstrap} resamples, "
                    f"seed {args.seed}",
        "analysis": {k: getattr(args, k) for k in ("windows", "batch_size", *ANALYSIS)},
        "per_tag": per_tag, "selective": sel_rows,
    }


def _ci(lo, hi) -> str:
    return "n/a" if lo is None or hi is None else f"[{lo:+.2f}, {hi:+.2f}]"
