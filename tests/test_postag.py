"""Offline PoS tagger setup, tagging and token-to-word alignment (probekit/data/postag.py)."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json
import pickle

import nltk
import pytest

from probekit.data import postag
from probekit.data.corpora import Document, make_windows
from probekit.data.postag import (
    TaggerNotFoundError,
    align_tokens,
    ensure_tagger,
    sentence_spans,
    tag_text,
    token_tags,
)

UNIVERSAL = {"VERB", "NOUN", "PRON", "ADJ", "ADV", "ADP", "CONJ", "DET", "NUM", "PRT", "X", "."}


@pytest.fixture(scope="module")
def nltk_root(tmp_path_factory):
    """The tagger set up in a temporary data dir, removed from nltk.data.path afterwards."""
    root = ensure_tagger(tmp_path_factory.mktemp("probekit-data"))
    yield root
    while str(root) in nltk.data.path:
        nltk.data.path.remove(str(root))


# ---------------------------------------------------------------- setup


def test_ensure_tagger_writes_nltk_layout(nltk_root):
    tagger_dir = nltk_root / "taggers" / "averaged_perceptron_tagger_eng"
    names = sorted(p.name for p in tagger_dir.iterdir())
    assert names == sorted(postag.TAGGER_FILES)
    classes = json.loads((tagger_dir / "averaged_perceptron_tagger_eng.classes.json").read_text())
    assert {"NN", "NNS", "VBD", "DT", "-LRB-"} <= set(classes) and len(classes) == 45
    tagdict = json.loads((tagger_dir / "averaged_perceptron_tagger_eng.tagdict.json").read_text())
    assert tagdict["the"] == "DT"
    assert nltk.data.path[0] == str(nltk_root)
    mapping = (nltk_root / "taggers" / "universal_tagset" / "en-ptb.map").read_text()
    rows = [line.split("\t") for line in mapping.splitlines()]
    assert all(len(row) == 2 and row[1] in UNIVERSAL for row in rows)
    assert {"NN": "NOUN", "VBD": "VERB", "JJ": "ADJ", "IN": "ADP", "CC": "CONJ",
            "RP": "PRT", "``": "."}.items() <= dict(rows).items()


def test_ensure_tagger_is_idempotent(nltk_root):
    files = sorted(p for p in nltk_root.rglob("*") if p.is_file())
    stamps = [p.stat().st_mtime_ns for p in files]
    assert ensure_tagger(nltk_root.parent) == nltk_root
    assert [p.stat().st_mtime_ns for p in files] == stamps
    assert nltk.data.path.count(str(nltk_root)) == 1
    assert not list(nltk_root.rglob(".*.tmp"))


def test_stock_pos_tag_works_offline(nltk_root):
    assert nltk.pos_tag(["The", "dogs", "run", "quickly"]) == [
        ("The", "DT"), ("dogs", "NNS"), ("run", "VBP"), ("quickly", "RB")]
    assert [tag for _, tag in nltk.pos_tag(["The", "dogs", "run", "quickly"],
                                           tagset="universal")] == ["DET", "NOUN", "VERB", "ADV"]
    # the doctest of nltk.pos_tag, with NLTK's own downloaded model
    words = ["John", "'s", "big", "idea", "is", "n't", "all", "that", "bad", "."]
    assert [tag for _, tag in nltk.pos_tag(words)] == [
        "NNP", "POS", "JJ", "NN", "VBZ", "RB", "PDT", "DT", "JJ", "."]


def test_every_tag_of_the_model_is_mapped(nltk_root):
    from nltk.tag import map_tag

    classes = postag._tagger().classes
    unmapped = {tag for tag in classes if map_tag("en-ptb", "universal", tag) == "X"}
    assert unmapped == {"FW", "LS", "SYM", "UH"}  # foreign word, list item, symbol, interjection


def test_missing_wheel_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setattr(postag, "_PICKLE_PACKAGE", "no_such_package_xyz")
    monkeypatch.setattr(postag, "_nltk_has", lambda resource: False)
    with pytest.raises(TaggerNotFoundError, match="pip install textblob-aptagger") as err:
        ensure_tagger(tmp_path)
    assert "nltk.download('averaged_perceptron_tagger_eng')" in str(err.value)
    assert isinstance(err.value, LookupError)


def test_unpickler_refuses_code(tmp_path):
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps((os.getcwd, {}, set()), protocol=2))
    with pytest.raises(pickle.UnpicklingError, match="unexpected global"):
        postag._load_pickle(path)


def test_setup_command_prints_where(tmp_path, capsys):
    from probekit.commands.main import main

    assert main(["setup", "--data-dir", str(tmp_path)]) == 0
    assert str(tmp_path / "nltk_data") in capsys.readouterr().out
    assert (tmp_path / "nltk_data" / postag.UNIVERSAL_MAP).is_file()
    nltk.data.path.remove(str(tmp_path / "nltk_data"))


# ---------------------------------------------------------------- text -> tagged words


def test_sentence_spans():
    text = ("Mr. Smith met Dr. Jones in the U.S. Army. J. R. R. Tolkien wrote, e.g. The Hobbit! "
            'Did he? "Yes." (It was 1937.) 3 copies\n\nHeading\nnext line.')
    assert [text[a:b] for a, b in sentence_spans(text)] == [
        "Mr. Smith met Dr. Jones in the U.S. Army.",
        "J. R. R. Tolkien wrote, e.g. The Hobbit!",
        "Did he?",
        '"Yes."',
        "(It was 1937.)",
        "3 copies",
        "Heading\nnext line.",
    ]
    assert sentence_spans("") == [] and sentence_spans(" \n\n ") == []


def test_tag_text_words_and_tags(nltk_root):
    text = ("I don't think it's 3.14 or 1,000 state-of-the-art \"tools\" (really). "
            "The dogs run quickly.")
    tagged = tag_text(text)
    assert all(w.word == text[w.start:w.end] for w in tagged)
    assert [w.word for w in tagged] == [
        "I", "do", "n't", "think", "it", "'s", "3.14", "or", "1,000", "state-of-the-art",
        '"', "tools", '"', "(", "really", ")", ".", "The", "dogs", "run", "quickly", "."]
    tags = {w.word: (w.penn, w.universal) for w in tagged}
    assert tags["n't"] == ("RB", "ADV")
    assert tags["3.14"] == ("CD", "NUM") and tags["1,000"] == ("CD", "NUM")
    assert tags["state-of-the-art"][1] == "ADJ"
    assert tags["("] == ("-LRB-", ".") and tags[")"] == ("-RRB-", ".")
    assert [w.penn for w in tagged[-5:]] == ["DT", "NNS", "VBP", "RB", "."]
    assert all(w.universal in UNIVERSAL for w in tagged)


def test_noun_number_tag():
    assert postag.noun_number_tag("NN", "NOUN") == postag.NOUN_SINGULAR == "NOUN.sg"
    assert postag.noun_number_tag("NNP", "NOUN") == "NOUN.sg"
    assert postag.noun_number_tag("NNS", "NOUN") == postag.NOUN_PLURAL == "NOUN.pl"
    assert postag.noun_number_tag("NNPS", "NOUN") == "NOUN.pl"
    assert postag.noun_number_tag("VBZ", "VERB") == "VERB"


# ---------------------------------------------------------------- alignment


def test_align_tokens_rules():
    words = [(0, 3), (4, 8), (8, 9), (11, 16)]  # "The dogs.  runs"
    tokens = [(0, 0), (0, 3), (3, 8), (8, 9), (9, 10), (10, 13), (13, 16)]
    # BOS, "The", " dogs" (leading space), ".", " " (white space), " ru", "ns"
    assert align_tokens(tokens, words) == [-1, 0, 1, 2, -1, 3, 3]
    # a token across two words goes to the larger overlap; a tie to the earlier word
    assert align_tokens([(2, 6), (1, 5), (6, 9)], [(0, 3), (3, 6), (6, 9)]) == [1, 0, 2]
    assert align_tokens([(5, 5), (3, 4)], []) == [-1, -1]


def _offsets(tokenizer, text):
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [tuple(span) for span in enc.offset_mapping]


def test_align_hard_cases_with_the_real_tokenizer(nltk_root, smollm2_tokenizer):
    text = ("Antidisestablishmentarianism isn't it's 3.14, or 1,000 state-of-the-art "
            "ideas.\n\nThey don't.")
    spans = _offsets(smollm2_tokenizer, text)
    words = tag_text(text)
    index = align_tokens(spans, [(w.start, w.end) for w in words])
    word_of = [words[i].word if i >= 0 else None for i in index]
    pieces = [text[a:b] for a, b in spans]
    by_word: dict[str, list[str]] = {}
    for piece, word in zip(pieces, word_of, strict=False):
        by_word.setdefault(word, []).append(piece)

    long_word = "Antidisestablishmentarianism"
    assert len(by_word[long_word]) > 2 and "".join(by_word[long_word]) == long_word
    assert "".join(by_word["3.14"]).strip() == "3.14"
    assert "".join(by_word["1,000"]).strip() == "1,000"
    assert "".join(by_word["state-of-the-art"]).strip() == "state-of-the-art"
    assert " ideas" in by_word["ideas"]  # SmolLM2's "Ġideas" carries the space
    # contractions: Treebank splits is|n't, it|'s, do|n't; each token goes to its larger part
    assert word_of[pieces.index(" isn")] == "is" and word_of[pieces.index("'t")] == "n't"
    assert word_of[pieces.index("'s")] == "'s"
    assert word_of[pieces.index(" don")] == "do"
    comma = text.index("3.14,") + 4  # the punctuation comma, not the one inside 1,000
    assert word_of[spans.index((comma, comma + 1))] == ","
    # white space belongs to no word
    assert all(w is None for p, w in zip(pieces, word_of, strict=False) if not p.strip())
    assert None not in [w for p, w in zip(pieces, word_of, strict=False) if p.strip()]


def test_token_tags_of_a_window(nltk_root, smollm2_tokenizer):
    doc = Document("t", "The dog sees two dogs. A cat runs quickly.")
    (window,) = make_windows([doc], smollm2_tokenizer, 12, 1)
    pieces = [window.token_text(i) for i in range(len(window.input_ids))]
    assert pieces == ["", "The", " dog", " sees", " two", " dogs", ".", " A", " cat", " runs",
                      " quickly", "."]
    assert token_tags(window) == [None, "DET", "NOUN", "VERB", "NUM", "NOUN", ".", "DET",
                                  "NOUN", "VERB", "ADV", "."]
    numbered = token_tags(window, noun_number=True)
    assert numbered[2] == "NOUN.sg" and numbered[5] == "NOUN.pl" and numbered[8] == "NOUN.sg"


def test_token_tags_on_wiki_windows(nltk_root, smollm2_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("PROBEKIT_CACHE_DIR", str(tmp_path))
    from probekit.data.corpora import load_corpus

    windows = make_windows(load_corpus()[:8], smollm2_tokenizer, 128, 8)
    for window in windows:
        tags = token_tags(window)
        assert len(tags) == len(window.input_ids) and tags[0] is None
        untagged = [window.token_text(i) for i, t in enumerate(tags[1:], 1) if t is None]
        assert all(not piece.strip() for piece in untagged)  # only white space is untagged
        assert set(tags[1:]) - {None} <= UNIVERSAL
        assert tags.count("NOUN") > 10
