"""Text corpora and fixed-length token windows for perplexity, lag and PoS runs.

    from probekit.data.corpora import load_corpus, make_windows
    docs = load_corpus("wiki")                        # 106 English Wikipedia articles
    windows = make_windows(docs, tokenizer, 512, 64)  # 64 full windows of 512 tokens

Data source (offline, DESIGN.md "Data"): the English Wikipedia sample that ships
inside the ``gensim`` wheel as test data,
``gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2``.
Of its 206 pages, 99 are redirects and one is outside the article namespace; that
leaves 106 articles (all of them over ``MIN_ARTICLE_WORDS``).
They are parsed with gensim's own wiki utilities (``extract_pages`` walks the XML
dump, ``filter_wiki`` strips templates, references, links, tables and tags), then a
light clean-up of our own turns the result into readable running text, with case,
sentences and punctuation preserved (not gensim's lower-cased token lists):

- bold/italic quote runs (``''``, ``'''``) are dropped, headings ``==History==``
  become a plain ``History`` paragraph, list markers (``*``, ``#``, ``:``, ``;``)
  are dropped, and ``\\xa0`` becomes a space;
- the article stops at its first back-matter heading ("References", "See also",
  "External links", ...), since those are lists of citations, not prose;
- gallery and caption debris (``File:...|caption``, ``...|alt=...``) and short
  fragments left over from tables (fewer than 4 words and no final ``.!?:``) are
  dropped; empty parentheses and spaces before punctuation, left where templates were
  removed, are removed;
- articles with fewer than ``MIN_ARTICLE_WORDS`` words after clean-up are skipped.

Parsing takes seconds (mostly gensim's ``filter_wiki``), so the result is cached as JSON
(about 3 MB) under ``platformdirs.user_cache_dir("probekit")``
(``PROBEKIT_CACHE_DIR`` overrides), keyed by the dump's SHA-256 and
``WIKI_FORMAT``; a cached load is fast.

Windows (papers/recirculation.md, App. B.1/B.2): each document is tokenised on its
own with the model's tokenizer (no special tokens) and cut into consecutive
windows of exactly ``window_tokens`` tokens from its first token on; the partial
tail is dropped, so every window is fully filled with text. With ``bos=True`` and a
tokenizer that has a BOS token, position 0 holds that BOS and the window holds
``window_tokens - 1`` text tokens (``window_tokens`` in total). Windows are taken
round-robin across documents: window 0 of every document in order, then window 1
of every document, and so on, so a small ``n_windows`` samples many articles.
"""

from __future__ import annotations

import bz2
import hashlib
import importlib.util
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from probekit.paths import cache_dir
from probekit.runs import write_text

WIKI_DUMP = "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
WIKI_FORMAT = 1  # bump when the clean-up below changes, to invalidate caches
MIN_ARTICLE_WORDS = 50
CORPORA = ("wiki",)

_BACK_MATTER = {
    "references", "see also", "external links", "further reading", "notes",
    "bibliography", "footnotes", "sources", "citations", "works cited",
    "notes and references",
}
_HEADING = re.compile(r"^\s*(=+)\s*(.*?)\s*\1\s*$")
_LIST_MARKER = re.compile(r"^[*#:;]+\s*")
_EMPTY_PARENS = re.compile(r"\(\s*[,;:]*\s*\)")
_SPACE_BEFORE_PUNCT = re.compile(r"[ \t]+([,.;:!?)])")
_SPACES = re.compile(r"[ \t]+")


@dataclass(frozen=True)
class Document:
    """One text of a corpus."""

    title: str
    text: str


@dataclass(frozen=True)
class Window:
    """A fixed-length run of model tokens from one document.

    Args:
        input_ids: the token ids fed to the model, ``window_tokens`` of them; with
            ``bos`` true, ``input_ids[0]`` is the tokenizer's BOS token.
        doc_index: index of the document in the list given to ``make_windows``.
        doc_title: that document's title.
        start_token: offset of the first text token in the document's tokens.
        char_spans: per position, ``(start, end)`` character offsets of the token
            in the *document* text (for SmolLM2/GPT-2 style tokens the span
            includes the leading space). The BOS gets the empty span
            ``(text_start, text_start)``.
        text: the document text the window covers, ``doc.text[text_start:text_end]``.
        text_start: offset of ``text`` in the document text.
        bos: whether position 0 is a BOS token.
    """

    input_ids: list[int]
    doc_index: int
    doc_title: str
    start_token: int
    char_spans: list[tuple[int, int]]
    text: str
    text_start: int
    bos: bool

    def token_text(self, i: int) -> str:
        """The text of the token at position ``i`` ("" for the BOS)."""
        start, end = self.char_spans[i]
        return self.text[start - self.text_start:end - self.text_start]


def load_corpus(corpus: str = "wiki", text_file: str | Path | None = None) -> list[Document]:
    """Load a corpus as a list of documents.

    ``text_file``, when given, takes precedence: the UTF-8 file becomes one document
    titled by its file name. Otherwise ``corpus`` names a built-in corpus
    (``CORPORA``).
    """
    if text_file is not None:
        return [_read_text_file(Path(text_file))]
    if corpus == "wiki":
        return [Document(title, text) for title, text in wiki_articles()]
    raise ValueError(
        f"unknown corpus {corpus!r}: choose one of {', '.join(CORPORA)}, "
        "or pass a UTF-8 text file (--text-file)"
    )


def _read_text_file(path: Path) -> Document:
    if not path.is_file():
        raise FileNotFoundError(f"text file {str(path)!r} does not exist: pass the path of a "
                                "UTF-8 text file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"text file {str(path)!r} is not valid UTF-8 ({err}): re-encode it "
                         "as UTF-8") from None
    if not text.strip():
        raise ValueError(f"text file {str(path)!r} is empty: give a file with some text in it")
    return Document(path.name, text)


def wiki_articles() -> list[tuple[str, str]]:
    """(title, plain text) of the gensim English Wikipedia sample, in dump order."""
    dump = _wiki_dump_path()
    key = hashlib.sha256(dump.read_bytes()).hexdigest()[:16]
    cache = cache_dir() / f"wiki-v{WIKI_FORMAT}-{key}.json"
    if cache.is_file():
        try:
            return [(title, text) for title, text in json.loads(cache.read_text("utf-8"))]
        except (ValueError, TypeError):
            pass  # a damaged cache is rebuilt below
    articles = _parse_wiki_dump(dump)
    write_text(cache, json.dumps(articles, ensure_ascii=False))
    return articles


def _wiki_dump_path() -> Path:
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the wiki corpus ships inside gensim: pip install gensim")
    path = Path(spec.submodule_search_locations[0]) / WIKI_DUMP
    if not path.is_file():
        raise FileNotFoundError(f"gensim's Wikipedia sample is missing ({path}): reinstall "
                                "gensim from its wheel (pip install --force-reinstall gensim)")
    return path


def _parse_wiki_dump(dump: Path) -> list[tuple[str, str]]:
    from gensim.corpora.wikicorpus import extract_pages

    articles = []
    with bz2.open(dump) as f:
        for title, raw, _page_id in extract_pages(f, filter_namespaces=("0",)):
            if not raw.strip() or raw.lstrip().lower().startswith("#redirect"):
                continue
            text = clean_wiki_markup(raw)
            if len(text.split()) >= MIN_ARTICLE_WORDS:
                articles.append((title, text))
    return articles


def clean_wiki_markup(raw: str) -> str:
    """Wiki markup -> plain paragraphs separated by blank lines (see module docstring)."""
    from gensim.corpora.wikicorpus import filter_wiki

    text = filter_wiki(raw).replace("\xa0", " ")
    text = re.sub(r"'{2,}", "", text)
    text = re.sub(r"__[A-Z]+__", "", text)
    paragraphs = []
    for line in text.splitlines():
        heading = _HEADING.match(line)
        if heading:
            if heading.group(2).lower() in _BACK_MATTER:
                break
            line, is_heading = heading.group(2), True
        else:
            line, is_heading = _LIST_MARKER.sub("", line.strip()), False
            if line.startswith(("File:", "Image:")) or "|alt=" in line:
                continue
        line = _EMPTY_PARENS.sub("", line)
        line = _SPACE_BEFORE_PUNCT.sub(r"\1", line)
        line = _SPACES.sub(" ", line).strip()
        if not line:
            continue
        if is_heading or len(line.split()) >= 4 or line.endswith((".", "!", "?", ":")):
            paragraphs.append(line)
    return "\n\n".join(paragraphs)


def make_windows(
    documents: Sequence[Document],
    tokenizer: Any,
    window_tokens: int,
    n_windows: int | None,
    *,
    bos: bool = True,
    max_per_document: int | None = None,
    max_tokens: int | None = None,
) -> list[Window]:
    """Cut documents into full windows of exactly ``window_tokens`` model tokens.

    Args:
        documents: the corpus, e.g. ``load_corpus()``.
        tokenizer: a Hugging Face *fast* tokenizer (character offsets are needed).
        window_tokens: tokens per window, the BOS included when one is prepended.
        n_windows: how many windows to return (round-robin over documents, see the
            module docstring); ``None`` returns every full window.
        bos: prepend ``tokenizer.bos_token_id`` as position 0 when the tokenizer
            has one; a tokenizer without a BOS gets none.
        max_per_document: at most this many windows from any one document.
        max_tokens: the model's context length; ``window_tokens`` may not exceed it.

    Returns:
        Windows in round-robin order: window 0 of documents 0, 1, ..., then window 1.
    """
    if window_tokens < 2:
        raise ValueError(f"window_tokens={window_tokens}: a window needs at least 2 tokens "
                         "(one prediction); raise --window-tokens")
    if max_tokens is not None and window_tokens > max_tokens:
        raise ValueError(f"window_tokens={window_tokens} exceeds the model's context length: "
                         f"the maximum is {max_tokens}; lower --window-tokens")
    if n_windows is not None and n_windows < 1:
        raise ValueError(f"n_windows={n_windows}: ask for at least 1 window (--windows)")
    if max_per_document is not None and max_per_document < 1:
        raise ValueError(f"max_per_document={max_per_document}: must be at least 1")
    if not documents:
        raise ValueError("no documents to cut into windows: load a corpus first")
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError("make_windows needs a fast (Rust) Hugging Face tokenizer for "
                        "character offsets: load it with use_fast=True")

    bos_id = tokenizer.bos_token_id if bos else None
    body = window_tokens - (bos_id is not None)
    encoded = tokenizer([doc.text for doc in documents], add_special_tokens=False,
                        return_offsets_mapping=True)
    per_doc = []  # per document: the start offsets (in tokens) of its full windows
    for ids in encoded["input_ids"]:
        starts = list(range(0, len(ids) - body + 1, body))
        per_doc.append(starts[:max_per_document] if max_per_document else starts)

    order = [(d, starts[k]) for k in range(max(map(len, per_doc)))
             for d, starts in enumerate(per_doc) if k < len(starts)]
    if not order:
        lengths = [len(ids) for ids in encoded["input_ids"]]
        raise ValueError(
            f"no full window of {window_tokens} tokens: the corpus has {sum(lengths)} tokens "
            f"in {len(documents)} document(s), the longest has {max(lengths)}; lower "
            f"--window-tokens to at most {max(lengths) + (bos_id is not None)}"
        )
    if n_windows is not None:
        if n_windows > len(order):
            raise ValueError(
                f"asked for {n_windows} windows but the corpus has only {len(order)} full "
                f"window(s) of {window_tokens} tokens: lower --windows (or --window-tokens)"
            )
        order = order[:n_windows]

    windows = []
    for d, start in order:
        ids = encoded["input_ids"][d][start:start + body]
        spans = [tuple(span) for span in encoded["offset_mapping"][d][start:start + body]]
        # min/max, not first/last: byte-level tokens of one character share its span
        text_start, text_end = min(s for s, _ in spans), max(e for _, e in spans)
        if bos_id is not None:
            ids, spans = [bos_id, *ids], [(text_start, text_start), *spans]
        doc = documents[d]
        windows.append(Window(
            input_ids=list(ids), doc_index=d, doc_title=doc.title, start_token=start,
            char_spans=spans, text=doc.text[text_start:text_end], text_start=text_start,
            bos=bos_id is not None,
        ))
    return windows
