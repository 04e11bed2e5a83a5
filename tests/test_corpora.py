"""Corpus loading and token windows (probekit/data/corpora.py)."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json

import pytest

from probekit.data import corpora
from probekit.data.corpora import Document, load_corpus, make_windows, wiki_articles


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("probekit-cache")
        mp.setenv("PROBEKIT_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def wiki(cache_dir) -> list[Document]:
    return load_corpus("wiki")


# ---------------------------------------------------------------- the wiki corpus


def test_wiki_corpus_size_and_order(wiki):
    assert 100 <= len(wiki) <= 110
    assert wiki[0].title == "Anarchism"
    assert len({doc.title for doc in wiki}) == len(wiki)
    words = sum(len(doc.text.split()) for doc in wiki)
    assert 400_000 < words < 500_000
    assert all(len(doc.text.split()) >= corpora.MIN_ARTICLE_WORDS for doc in wiki)


def test_wiki_text_is_readable_plain_text(wiki):
    for doc in wiki:
        for markup in ("[[", "]]", "{{", "}}", "'''", "''", "==", "<ref", "|alt=", "&nbsp;",
                       "#REDIRECT", "__TOC__", "\xa0"):
            assert markup not in doc.text, (doc.title, markup)
    anarchism = wiki[0].text
    assert anarchism.startswith("Anarchism is a political philosophy that advocates")
    assert "References" not in anarchism.split("\n\n")  # back matter is cut
    prose = " ".join(doc.text for doc in wiki)
    assert prose.count(". ") > 10_000 and prose.count(", ") > 10_000
    assert sum(c.isupper() for c in prose) > 50_000
    assert any(ch in prose for ch in "éüö")  # unicode survives


def test_wiki_cache_is_used_and_rebuilt_when_damaged(wiki, cache_dir):
    (cached,) = cache_dir.glob(f"wiki-v{corpora.WIKI_FORMAT}-*.json")
    assert [tuple(a) for a in json.loads(cached.read_text("utf-8"))] == [
        (doc.title, doc.text) for doc in wiki]
    cached.write_text("[not json", encoding="utf-8")
    assert wiki_articles() == [(doc.title, doc.text) for doc in wiki]
    assert json.loads(cached.read_text("utf-8"))  # rewritten
    assert not list(cache_dir.glob(".*.tmp"))


def test_clean_wiki_markup():
    raw = ("'''Foo''' is a [[bar|baz]] thing.<ref>cite</ref>{{tmpl|x}} It (  ) works.\n"
           "==History==\n* A listed sentence with five words.\nx\n"
           "[[File:a.jpg|thumb|a caption]]\n==See also==\nThe end is cut.")
    text = corpora.clean_wiki_markup(raw)
    assert text == "Foo is a baz thing. It works.\n\nHistory\n\nA listed sentence with five words."


# ---------------------------------------------------------------- text files


def test_text_file_is_one_document(tmp_path):
    path = tmp_path / "story.txt"
    path.write_text("Once upon a time. Ünïcode too.\n", encoding="utf-8")
    assert load_corpus(text_file=path) == [
        Document("story.txt", "Once upon a time. Ünïcode too.\n")]
    assert load_corpus("wiki", text_file=str(path))[0].title == "story.txt"


def test_text_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_corpus(text_file=tmp_path / "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="empty"):
        load_corpus(text_file=empty)
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match="UTF-8"):
        load_corpus(text_file=latin)
    with pytest.raises(ValueError, match="unknown corpus 'c4'.*wiki"):
        load_corpus("c4")


# ---------------------------------------------------------------- windows


def _doc_ids(tokenizer, doc):
    return tokenizer(doc.text, add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def docs(wiki) -> list[Document]:
    """A third of the wiki corpus: tokenising all of it takes seconds on 2 cores."""
    return wiki[:35]


@pytest.fixture(scope="module")
def wiki_ids(docs, smollm2_tokenizer) -> list[list[int]]:
    return smollm2_tokenizer([doc.text for doc in docs], add_special_tokens=False).input_ids


def test_windows_have_exact_length_and_bos(docs, wiki_ids, smollm2_tokenizer):
    tok = smollm2_tokenizer
    windows = make_windows(docs, tok, 64, 30)
    assert len(windows) == 30
    for w in windows:
        assert len(w.input_ids) == len(w.char_spans) == 64
        assert w.bos and w.input_ids[0] == tok.bos_token_id
        assert w.char_spans[0] == (w.text_start, w.text_start)
        ids = wiki_ids[w.doc_index]
        assert w.input_ids[1:] == ids[w.start_token:w.start_token + 63]
        assert w.doc_title == docs[w.doc_index].title


def test_windows_without_bos(docs, wiki_ids, smollm2_tokenizer):
    windows = make_windows(docs[:3], smollm2_tokenizer, 50, 6, bos=False)
    for w in windows:
        assert not w.bos and len(w.input_ids) == 50
        assert w.start_token % 50 == 0
        assert w.input_ids == wiki_ids[w.doc_index][w.start_token:w.start_token + 50]


def test_windows_are_deterministic_and_round_robin(docs, wiki_ids, smollm2_tokenizer):
    assert min(map(len, wiki_ids)) >= 2 * 31
    n = len(docs) + 10
    first = make_windows(docs, smollm2_tokenizer, 32, n)
    assert first == make_windows(docs, smollm2_tokenizer, 32, n)
    # round 0: the first window of every document, in document order; then round 1
    assert [(w.doc_index, w.start_token) for w in first] == (
        [(d, 0) for d in range(len(docs))] + [(d, 31) for d in range(10)])
    # a prefix of a longer request is the shorter request
    assert make_windows(docs, smollm2_tokenizer, 32, 7) == first[:7]
    every = make_windows(docs, smollm2_tokenizer, 512, None)
    assert len(every) == sum(len(ids) // 511 for ids in wiki_ids)


def test_only_full_windows_are_taken(smollm2_tokenizer):
    tok = smollm2_tokenizer
    docs = [Document(f"d{n}", " ".join(["word"] * n)) for n in (5, 23, 40, 9)]
    lengths = [len(_doc_ids(tok, d)) for d in docs]
    assert lengths == [5, 23, 40, 9]  # one token per word
    windows = make_windows(docs, tok, 11, None)  # 10 text tokens + BOS
    per_doc = [sum(w.doc_index == d for w in windows) for d in range(len(docs))]
    assert per_doc == [n // 10 for n in lengths]
    assert all(w.start_token + 10 <= lengths[w.doc_index] for w in windows)
    capped = make_windows(docs, tok, 11, None, max_per_document=1)
    assert [(w.doc_index, w.start_token) for w in capped] == [(1, 0), (2, 0)]


def test_char_spans_point_at_the_tokens(docs, smollm2_tokenizer):
    tok = smollm2_tokenizer
    for w in make_windows(docs, tok, 256, 40):
        doc = docs[w.doc_index]
        assert w.text == doc.text[w.text_start:w.text_start + len(w.text)]
        # contiguous: no gaps; byte tokens of one multi-byte character share it, so a
        # span may overlap the one before it
        end = w.text_start
        for start, stop in w.char_spans[1:]:
            assert start <= end <= max(stop, end)
            end = max(stop, end)
        assert end == w.text_start + len(w.text)
        pieces = [w.token_text(i) for i in range(1, len(w.input_ids))]
        for i, (token_id, piece) in enumerate(zip(w.input_ids[1:], pieces, strict=False), 1):
            start, end = w.char_spans[i]
            assert doc.text[start:end] == piece
            if "\ufffd" in tok.decode([token_id]):
                continue  # a byte piece of a multi-byte character
            assert tok.decode([token_id]) == piece
            # each token's text re-tokenises to that token (the whole window need not:
            # BPE merges may differ where the window cuts the document)
            assert tok(piece, add_special_tokens=False).input_ids == [token_id]


def test_windows_from_a_text_file(tmp_path, smollm2_tokenizer):
    path = tmp_path / "t.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 20, encoding="utf-8")
    windows = make_windows(load_corpus(text_file=path), smollm2_tokenizer, 32, 3)
    assert [w.start_token for w in windows] == [0, 31, 62]
    assert windows[0].text.startswith("The quick brown fox")


def test_window_errors(wiki, smollm2_tokenizer):
    tok = smollm2_tokenizer
    with pytest.raises(ValueError, match="at least 2"):
        make_windows(wiki, tok, 1, 4)
    with pytest.raises(ValueError, match="the maximum is 8192"):
        make_windows(wiki, tok, 10_000, 4, max_tokens=8192)
    with pytest.raises(ValueError, match="at least 1 window"):
        make_windows(wiki, tok, 64, 0)
    with pytest.raises(ValueError, match="max_per_document"):
        make_windows(wiki, tok, 64, 4, max_per_document=0)
    short = [Document("a", "one two three four"), Document("b", "five six")]
    with pytest.raises(ValueError, match=r"6 tokens in 2 document.*lower --window-tokens to at "
                                         r"most 5"):
        make_windows(short, tok, 8, 1)
    with pytest.raises(ValueError, match=r"only 1 full window\(s\) of 4 tokens"):
        make_windows(short, tok, 4, 5)
    with pytest.raises(ValueError, match="no documents"):
        make_windows([], tok, 8, 1)

    class SlowTokenizer:
        is_fast = False

    with pytest.raises(TypeError, match="fast"):
        make_windows(short, SlowTokenizer(), 3, 1)
