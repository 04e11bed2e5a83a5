"""Verified model caches (probekit/core/model_cache.py): faults are injected into a cache
folder in a temporary cache root; every one is detected, reported in one line and
repaired, and the repaired load equals a fresh one."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from probekit.core import model_cache
from probekit.core.models import load_model


@pytest.fixture()
def tiny_parts():
    m = load_model("tiny")
    return m.hf_model, m.tokenizer


def _cache(folder, parts, built):
    def build():
        built.append(1)
        return parts

    def load(f):
        return LlamaForCausalLM.from_pretrained(f), AutoTokenizer.from_pretrained(f)

    return model_cache.load_or_build(folder, load=load, build=build, save=lambda p: p,
                                     what="model cache")


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values(), strict=True))


def test_first_load_builds_and_records_then_reuses(tmp_path, tiny_parts):
    built: list[int] = []
    folder = tmp_path / "m"
    _cache(folder, tiny_parts, built)
    assert built == [1] and model_cache.problem(folder) is None
    rec = model_cache.record(folder)
    assert rec["files"]["model.safetensors"]["bytes"] == \
        (folder / "model.safetensors").stat().st_size
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a sound cache loads silently
        model, _ = _cache(folder, tiny_parts, built)
    assert built == [1] and _same(model, tiny_parts[0])


@pytest.mark.parametrize("fault, reason", [
    ("delete", r"model\.safetensors is missing"),
    ("truncate", r"model\.safetensors has \d+ bytes, \d+ were written"),
    ("flip", r"model\.safetensors does not match its recorded sha256"),
    ("no-record", r"no valid probekit-cache\.json"),
    ("garbage-record", r"no valid probekit-cache\.json"),
])
def test_broken_cache_is_reported_and_rebuilt(tmp_path, tiny_parts, fault, reason):
    built: list[int] = []
    folder = tmp_path / "m"
    _cache(folder, tiny_parts, built)
    weights = folder / "model.safetensors"
    if fault == "delete":
        weights.unlink()
    elif fault == "truncate":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif fault == "flip":
        data = bytearray(weights.read_bytes())
        data[-10] ^= 0xFF  # inside the last tensor: still loads, silently different
        weights.write_bytes(bytes(data))
    elif fault == "no-record":
        (folder / model_cache.RECORD).unlink()
    else:
        (folder / model_cache.RECORD).write_text("{")
    with pytest.warns(UserWarning, match=rf"the model cache .*/m is broken \({reason}"):
        model, _ = _cache(folder, tiny_parts, built)
    assert built == [1, 1]
    assert model_cache.problem(folder) is None  # repaired in place
    assert _same(model, tiny_parts[0])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no debris


def test_size_only_check_then_unreadable_file_is_rebuilt(tmp_path, tiny_parts):
    built: list[int] = []
    folder = tmp_path / "m"
    _cache(folder, tiny_parts, built)
    weights = folder / "model.safetensors"
    weights.write_bytes(b"\0" * weights.stat().st_size)  # right size, garbage
    rec = model_cache.record(folder)

    def load(f):
        return LlamaForCausalLM.from_pretrained(f), AutoTokenizer.from_pretrained(f)

    with pytest.warns(UserWarning, match=r"broken \(unreadable \("):
        model_cache.load_or_build(folder, load=load, build=lambda: tiny_parts,
                                  save=lambda p: p, what="model cache", hashes=False)
    assert model_cache.record(folder)["files"] == rec["files"]


def test_a_load_that_contradicts_the_record_is_rebuilt_with_its_reason(tmp_path, tiny_parts):
    """How the default model's cache catches a changed byte when only sizes are checked
    up front: its load compares the weights' content hash with the recorded one."""
    folder = tmp_path / "m"
    model_cache.write(folder, tiny_parts, {"content_hash": "recorded"})

    def load(f):
        raise model_cache.Mismatch("its weights hash to other, not the recorded recorded")

    with pytest.warns(UserWarning, match=r"is broken \(its weights hash to other, not the "
                                         r"recorded recorded\); rebuilding it"):
        model_cache.load_or_build(folder, load=load, build=lambda: tiny_parts,
                                  save=lambda p: p, what="model cache", hashes=False)
