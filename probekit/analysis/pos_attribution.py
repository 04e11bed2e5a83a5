"""Part-of-speech attribution: which tokens does recirculation help? (paper Sec. 4.4.4)

Two experiments on the same windows (SEMANTICS.md "Part-of-speech attribution";
``papers/recirculation.md`` Sec. 4.4.4, Fig. 9c, App. C.4, Fig. C.3). The command is
``probekit pos-attribution`` (:mod:`probekit.commands.pos_attribution`).

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
window are correlated) by :func:`probekit.analysis.stats.window_bootstrap`. Every
statistic of a run uses the same resamples (same seed), so "tag minus random" is a
paired difference. A resample that holds no token of a rare tag is left out of that
tag's interval; the count of such resamples is reported.

**Exact sparse schedule.** A selective run recirculates few positions, so it need not
step token by token: :func:`probekit.mechanisms.regimes.exact_chunks` cuts the window
into chunks that each end at a recirculated position (of any row of the batch) and the
engine runs each chunk's first pass in parallel. This is exact, not the blockwise
approximation: positions before the last one in a chunk do not recirculate, so their
first-pass keys/values are final, the last position's first pass sees exactly them, and
its second pass recomputes the others' keys/values unchanged (:class:`Recirculation`
leaves inactive positions at ``z'_d = z_d``). A test pins equality with the
token-by-token run.

Tags come from :mod:`probekit.data.postag` (``nltk.pos_tag`` through the offline
textblob-aptagger conversion), tagging whole paragraphs around each window so sentences
cut by the window's edges are tagged in context. Universal tagset (Petrov et al. 2012);
the rows ``NOUN.sg`` (NN, NNP) and ``NOUN.pl`` (NNS, NNPS) split the nouns (the paper's
singular/plural finding).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from probekit.analysis.stats import window_bootstrap
from probekit.core.engine import StepEngine
from probekit.data.postag import NOUN_PLURAL, NOUN_SINGULAR
from probekit.mechanisms.recirculation import Recirculation
from probekit.mechanisms.regimes import exact_chunks

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


def reported_tags(tags: Sequence[WindowTags], *, noun_number: bool) -> list[str]:
    """Part 1's rows: the universal tags some predicted token carries (in tagset order),
    then ``NOUN.sg``/``NOUN.pl`` with ``noun_number``."""
    present = {g for wt in tags for g in wt.universal[1:] if g}
    return [g for g in UNIVERSAL_TAGS if g in present] + list(NUMBER_TAGS if noun_number else ())


# ------------------------------------------------------------------ the runs
@torch.no_grad()
def score_windows(engine: StepEngine, input_ids: Tensor, recirculation: Recirculation, *,
                  progress: bool = False) -> dict[str, np.ndarray]:
    """Part 1's two runs of ``[B, T]`` windows: ``{"base", "rec"}``, each ``[B, T-1]``
    log-probs (entry ``t`` scores ``x[t+1]``): the plain model in one parallel forward,
    and every position recirculated, token by token."""
    base = engine.forward(input_ids).log_probs.numpy()
    recd = engine.run(input_ids, recirculation, progress=progress).log_probs.numpy()
    return {"base": base, "rec": recd}


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


@torch.no_grad()
def score_selective(engine: StepEngine, input_ids: Tensor, recirculation: Recirculation,
                    tags: Sequence[WindowTags], window_indices: Sequence[int], tag: str, *,
                    seed: int = 0, progress: bool = False) -> dict[str, np.ndarray]:
    """Part 2 for one tag on ``[B, T]`` windows (``tags`` and ``window_indices``: per row):
    ``{"mask", "control"}`` (``[B, T]`` bool: the tag's positions and the count-matched
    random set) and ``{"tag", "random"}`` (``[B, T-1]`` log-probs with each recirculated),
    both runs on the exact sparse schedule (module docstring)."""
    if not isinstance(recirculation, Recirculation):
        raise TypeError("the selective runs' chunked schedule is exact only for Recirculation; "
                        f"got {type(recirculation).__name__}")
    mask = np.stack([wt.has(tag) for wt in tags])
    control = np.stack([count_matched_control(wt.has(tag), wt.tagged, control_rng(seed, i, tag))
                        for wt, i in zip(tags, window_indices, strict=True)])
    out = {"mask": mask, "control": control}
    for name, m in (("tag", mask), ("random", control)):
        out[name] = engine.run(input_ids, recirculation, mask=torch.from_numpy(m),
                               block_size=exact_chunks(m), progress=progress).log_probs.numpy()
    return out


# ------------------------------------------------------------------ statistics
def tag_changes(base: np.ndarray, rec: np.ndarray, tags: Sequence[WindowTags],
                tag_names: Sequence[str], **bootstrap) -> list[dict]:
    """Part 1: per tag, the net % change in perplexity of the predicted tokens of that tag.

    ``base``, ``rec``: ``[W, T-1]`` log-probs (entry ``t`` scores token ``t+1``);
    ``tags``: per window. Row ``"all"`` is every predicted token. Keyword arguments go to
    :func:`probekit.analysis.stats.window_bootstrap`.
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
    st = window_bootstrap(s_base, s_rec, count, n_boot=n_boot, level=level, seed=seed,
                          paired=[(0, 1)])
    change, lo, hi = st["change"], st["ci_low"], st["ci_high"]
    return {"tag": tag, "n_recirculated": int(n_recirculated),
            "tag_change": _num(change[0]), "tag_ci_low": _num(lo[0]),
            "tag_ci_high": _num(hi[0]), "random_change": _num(change[1]),
            "random_ci_low": _num(lo[1]), "random_ci_high": _num(hi[1]),
            "difference": _num(change[2]), "difference_ci_low": _num(lo[2]),
            "difference_ci_high": _num(hi[2])}


def _num(x) -> float | int | None:
    x = x.item() if hasattr(x, "item") else x
    return None if isinstance(x, float) and math.isnan(x) else x
