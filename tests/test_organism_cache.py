"""Trained organisms on demand (probekit.training.organism_cache): trained once, sealed,
verified on every use, retrained when damaged, resumed when interrupted, deterministic."""

from __future__ import annotations

import json
import platform
import sys
import warnings
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
import torch

from probekit.core import model_cache
from probekit.training import organism_cache
from probekit.training.config import DataConfig, OrganismConfig, TrainConfig
from probekit.training.organism_cache import (
    LONG_RANGE,
    Recipe,
    data_constants,
    organism_folder,
    sealed,
    trained_organism,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:transformers")


def small(steps: int = 12, seed: int = 0, **train) -> Recipe:
    """A recipe that trains in seconds (a 2-block, 32-wide organism, a few steps)."""
    return Recipe(
        train=TrainConfig(mode="organism", steps=steps, feedback_start=4, batch_size=8,
                          batch_tokens=512, warmup=2, eval_every=0, save_every=4, seed=seed,
                          **train),
        data=DataConfig(n_examples=96),
        shape=OrganismConfig(n_blocks=2, d_model=32, n_heads=2, d_mlp=64, n_ctx=1280))


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PROBEKIT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def weights(ckpt) -> bytes:
    return (ckpt / "organism" / "model.safetensors").read_bytes()


def test_trained_once_sealed_then_reused_without_training(monkeypatch):
    recipe = small()
    ckpt = trained_organism(recipe, progress=False)
    rec = sealed(recipe)
    assert ckpt == organism_folder(recipe) / "checkpoint"
    assert rec is not None and rec["steps"] == 12
    assert set(rec["task_accuracy"]) == {"completion", "memory"}
    assert "checkpoint/organism/model.safetensors" in rec["files"]
    assert "checkpoint/model.safetensors" in rec["files"]
    # what varies across machines (docs/latent-feedback.md), so a seal says where it ran
    assert rec["machine"] == {"arch": platform.machine(),
                              "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    assert rec["versions"]["torch"] == metadata.version("torch")

    def no_training(*a, **k):
        raise AssertionError("a sealed organism must not be trained again")

    monkeypatch.setattr(organism_cache, "train_organism", no_training)
    assert trained_organism(recipe, progress=False) == ckpt


def test_one_thread_training_is_deterministic(cache, tmp_path, monkeypatch):
    first = weights(trained_organism(small(), progress=False))
    monkeypatch.setenv("PROBEKIT_CACHE_DIR", str(tmp_path / "other"))
    torch.set_num_threads(2)  # the caller's setting does not reach training
    try:
        again = weights(trained_organism(small(), progress=False))
        assert torch.get_num_threads() == 2  # and is restored afterwards
    finally:
        torch.set_num_threads(1)
    assert again == first
    other_seed = weights(trained_organism(small(seed=1), progress=False))
    assert other_seed != first


def test_a_damaged_organism_is_trained_again_with_one_warning():
    recipe = small()
    ckpt = trained_organism(recipe, progress=False)
    good = weights(ckpt)
    path = ckpt / "organism" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    assert sealed(recipe) is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert trained_organism(recipe, progress=False) == ckpt
    lines = [str(w.message) for w in caught if "organism" in str(w.message)]
    assert lines == [f"the trained organism {organism_folder(recipe)} is broken "
                     f"(checkpoint/organism/model.safetensors does not match its recorded "
                     f"sha256); training it again"]
    assert weights(ckpt) == good and sealed(recipe) is not None


def test_an_interrupted_training_resumes_to_the_uninterrupted_result(cache, tmp_path,
                                                                       monkeypatch):
    full = small(steps=12)
    expected = weights(trained_organism(full, progress=False))
    monkeypatch.setenv("PROBEKIT_CACHE_DIR", str(tmp_path / "other"))
    from probekit.training import train as train_module

    real = train_module.save_checkpoint

    def save_then_stop(*args, **kw):  # Ctrl-C right after the step-8 checkpoint
        real(*args, **kw)
        if kw["step"] == 8:
            raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "save_checkpoint", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        trained_organism(full, progress=False)
    monkeypatch.setattr(train_module, "save_checkpoint", real)
    assert sealed(full) is None
    logged: list[str] = []
    ckpt = trained_organism(full, progress=False, log=logged.append)
    assert logged[0] == f"resuming from {ckpt} at step 8"
    assert weights(ckpt) == expected


def test_a_damaged_partial_training_starts_over():
    recipe = small(steps=12)
    ckpt = organism_folder(recipe) / "checkpoint"
    organism_cache.train_organism(small(steps=4), ckpt, progress=False)
    (ckpt / "config.json").write_text("{not json")
    with pytest.warns(UserWarning, match=r"config\.json is not valid JSON .*training the "
                                         r"organism from the start"):
        trained_organism(recipe, progress=False)
    assert json.loads((ckpt / "config.json").read_text())["step"] == 12


def test_the_recipe_key_follows_every_field_that_decides_the_weights():
    base = small()
    assert small().key() == base.key()
    assert small(seed=1).key() != base.key()
    assert small(steps=13).key() != base.key()
    assert small(lr=0.01).key() != base.key()
    assert small(feed="residual").key() != base.key()
    assert small(short_first=0).key() == base.key()
    assert small(short_first=5).key() != base.key()
    assert small(fixed_point=0.5, fixed_point_rows="all").key() == small(fixed_point=0.5).key()
    assert (small(fixed_point=0.5, fixed_point_rows="long").key()
            != small(fixed_point=0.5).key())
    assert small(close_pairs=0.0).key() == base.key()
    assert small(close_pairs=0.25).key() != base.key()
    assert (small(close_pairs=0.25, close_pairs_rows="all", close_pairs_batch="instead").key()
            == small(close_pairs=0.25).key())
    assert len({small(close_pairs=0.25, **kw).key() for kw in (
        {}, {"close_pairs_rows": "short"}, {"close_pairs_batch": "added"})}) == 3
    assert small(ema=0.0).key() == base.key()  # added later: older organisms keep theirs
    assert len({small(ema=0.99).key(), small(ema=0.999).key(), base.key()}) == 3
    assert organism_folder(small(seed=3)).name.startswith("seed3-")
    with pytest.raises(ValueError, match="an organism recipe trains in organism mode, not gate"):
        Recipe(train=TrainConfig(mode="gate"))


def test_register_row_constants_key_only_the_recipes_that_train_on_registers(monkeypatch):
    """Changing how register rows are drawn must retrain register organisms and leave
    every other recipe's cached organism (and its key) alone."""
    from synthetic import registers

    plain, mixed = Recipe.default(0), Recipe.default(0, tasks=("completion", "registers"))
    keys = plain.key(), mixed.key()
    monkeypatch.setattr(registers, "TRAINING_READ_RATE", 0.25)
    assert plain.key() == keys[0] and mixed.key() != keys[1]
    monkeypatch.undo()
    monkeypatch.setattr(registers, "TRAINING_DISTRACTOR_WEIGHTS", {0: 1, 50: 1})
    assert plain.key() == keys[0] and mixed.key() != keys[1]
    # the default recipe's key is the one its organisms have been cached under so far
    monkeypatch.undo()
    assert plain.key() == "fbbf51d681"


def test_copy_rows_key_only_the_recipes_that_use_them(monkeypatch):
    """--copy-rows enters a recipe's key (and its copy constants the data constants) only
    when set, so every earlier organism keeps its key."""
    from probekit.training import organism

    plain, copying = Recipe.default(0), Recipe.default(0, copy_rows=0.25)
    assert plain.key() == "fbbf51d681" and copying.key() != plain.key()
    assert "copy_lengths" not in data_constants(plain.data)
    assert data_constants(copying.data)["copy_lengths"] == (4, 8)
    before = copying.key()
    monkeypatch.setattr(organism, "COPY_LENGTHS", (2, 3))
    assert copying.key() != before and plain.key() == "fbbf51d681"


def test_recall_rows_key_only_the_recipes_that_use_them(monkeypatch):
    """--recall-rows, like --copy-rows, enters a recipe's key (and its list lengths the
    data constants) only when set: Fig. 7a's organisms keep theirs."""
    from probekit.training import organism

    long_range = Recipe.long_range(0)
    recalling = Recipe.default(0, **{**LONG_RANGE, "recall_rows": 0.25})
    assert long_range.key() == "05b122b8a6" and recalling.key() != long_range.key()
    assert "recall_lengths" not in data_constants(long_range.data)
    assert data_constants(recalling.data)["recall_lengths"] == (4, 8)
    before = recalling.key()
    monkeypatch.setattr(organism, "RECALL_LENGTHS", (2, 3))
    assert recalling.key() != before and long_range.key() == "05b122b8a6"


def test_the_validation_lengths_key_only_the_recipes_that_tell_rows_apart_by_them(monkeypatch):
    """--short-first's rows are those no longer than the validation rows and
    --fixed-point-rows long's those longer, so the probe sets' null-update counts enter
    the key of a recipe with either, and only of such."""
    from probekit.training import organism

    plain, short = Recipe.default(0), Recipe.default(0, short_first=100)
    long = Recipe.default(0, fixed_point=0.5, fixed_point_rows="long")
    before = short.key(), long.key()
    monkeypatch.setattr(organism, "PROBE_DISTRACTORS", (0, 16))
    assert short.key() != before[0] and long.key() != before[1]
    assert plain.key() == "fbbf51d681"


def test_copy_from_keys_only_the_recipes_that_change_it():
    """--copy-from 10 is the copy rows' original range, so those organisms keep their
    keys; another range is another organism."""
    copying = Recipe.default(0, copy_rows=0.25)
    assert Recipe.default(0, copy_rows=0.25, copy_from=10).key() == copying.key()
    digits = Recipe.default(0, copy_rows=0.25, copy_from=0)
    assert digits.key() not in (copying.key(), "fbbf51d681") and digits.data.copy_from == 0


def test_the_default_recipe_takes_a_shape_that_keys_its_organisms():
    """Recipe.default(shape=...) (organism_checkpoint.py --d-model ...) trains that shape;
    the default shape keeps the default key."""
    wide = Recipe.default(0, tasks=("registers",), shape=OrganismConfig(d_model=256, n_heads=8))
    narrow = Recipe.default(0, tasks=("registers",))
    assert wide.shape.d_model == 256 and narrow.shape == OrganismConfig()
    assert wide.key() != narrow.key()
    assert Recipe.default(0, shape=OrganismConfig()).key() == "fbbf51d681"


def test_the_default_recipe_takes_a_row_count_that_keys_its_organisms():
    """Recipe.default(n_examples=...) (organism_checkpoint.py --n-examples) trains on that
    many task rows; the default count keeps the default key; fewer rows than a batch are
    refused with the flag's message before anything trains."""
    more = Recipe.default(0, n_examples=48000)
    assert more.data.n_examples == 48000 and more.key() != "fbbf51d681"
    assert Recipe.default(0, n_examples=24000).key() == "fbbf51d681"
    with pytest.raises(ValueError) as err:
        Recipe.default(0, n_examples=63)
    assert str(err.value) == "--n-examples must be >= --batch-size (64); got 63"


def test_ahead_loss_keys_only_the_recipes_that_use_it():
    """organism_checkpoint.py --ahead-loss W is a TrainConfig override: 0 keeps the default
    key (and every cached organism); any other weight is another organism."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
    from organism_checkpoint import Args, recipe_of

    assert recipe_of(Args(seed=0, ahead_loss=0.0)).key() == "fbbf51d681"
    ahead = recipe_of(Args(seed=0, ahead_loss=1.0))
    assert ahead.train.ahead_loss == 1.0 and ahead.key() != "fbbf51d681"
    assert recipe_of(Args(seed=0)).train.ahead_loss == 0.0


def test_seal_records_every_file_and_problem_finds_a_missing_one(tmp_path):
    folder = tmp_path / "f"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("a")
    (folder / "sub" / "b.bin").write_bytes(np.arange(4, dtype=np.uint8).tobytes())
    (folder / ".lock").write_text("1")
    model_cache.seal(folder, {"note": 1})
    rec = model_cache.record(folder)
    assert sorted(rec["files"]) == ["a.txt", "sub/b.bin"] and rec["note"] == 1
    assert model_cache.problem(folder) is None
    (folder / "sub" / "b.bin").unlink()
    assert model_cache.problem(folder) == "sub/b.bin is missing"


def test_the_folder_lock_is_released_once_the_organism_is_sealed():
    """A process waiting for the same organism gets the lock when training ends, not when
    the training process exits."""
    import fcntl

    from probekit import runs

    recipe = small()
    trained_organism(recipe, progress=False)
    folder = organism_folder(recipe)
    assert str(folder.resolve()) not in runs._HELD
    with open(folder / ".lock", "a+") as f:  # another open file: as another process would
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if still held
        fcntl.flock(f, fcntl.LOCK_UN)


def test_a_save_interrupted_between_its_files_is_not_resumed(monkeypatch):
    """A kill after the organism's new weights are written but before config.json would
    otherwise resume at the old step with the new weights: the step in every file gives
    it away, and the cache trains from the start instead, ending where an uninterrupted
    training ends."""
    from probekit.training import checkpoint as ck_module

    recipe = small(steps=12)
    expected = weights(trained_organism(recipe, progress=False))
    folder = organism_folder(recipe)
    import shutil

    shutil.rmtree(folder)
    real = ck_module.write_json

    def crash_before_config(path, obj):
        if path.name == "config.json" and obj["step"] == 8:
            raise KeyboardInterrupt  # the organism and gate of step 8 are already on disk
        real(path, obj)

    monkeypatch.setattr(ck_module, "write_json", crash_before_config)
    with pytest.raises(KeyboardInterrupt):
        trained_organism(recipe, progress=False)
    monkeypatch.setattr(ck_module, "write_json", real)
    ckpt = folder / "checkpoint"
    with pytest.raises(ValueError, match=r"checkpoint/model\.safetensors holds step 8 but .*"
                                         r"config\.json says step 4 \(saving was interrupted\)"):
        ck_module.check_checkpoint(ckpt)
    with pytest.warns(UserWarning, match="training the organism from the start"):
        assert trained_organism(recipe, progress=False) == ckpt
    assert weights(ckpt) == expected
