"""nnsight 0.8 backend: every embed, block range and readout is one nnsight trace.

The Hugging Face model is wrapped once in nnsight's
``TransformersModel(hf_model, tokenizer=..., task="text-generation")``; its envoy tree
(``model.model.layers[b]``, ``model.lm_head``, ... in Llama's spelling) is what traces
and users read and edit. nnsight runs the model's own forward and lets code written
inside a ``with model.trace(...)`` block wait at modules in execution order; it cannot
reach back into a location the forward already passed, so each pass of a chunk (the
engine's pass 0 and every ``rerun``) is its own trace:

    embed(ids)        trace(ids): read the token embedding's output, stop
    run_blocks(a, z)  trace of model(inputs_embeds=x, attention_mask=<causal mask>,
                      position_ids=positions, past_key_values=<probekit KVCache>):
                      blocks 0..a-1 .skip()ped (their output is x, passed through),
                      blocks a..z-1 run and write their keys/values into the cache,
                      the engine's captures and edits act on layers[b].output,
                      then the trace stops (no final norm, no unembedding)
    unembed(top)      trace of model(inputs_embeds=top) with every block skipped:
                      read the forward's logits

The causal mask is built here as a 4D additive tensor (query ``i`` of a chunk at ``c0``
sees keys ``0 .. c0 + i``; with sliding-window blocks, Gemma 3, one mask per layer type),
which Hugging Face's forward takes as given, so the engine's own
:class:`probekit.core.kv_cache.KVCache` can stand in for a ``transformers.Cache``. The
blocks and the embedding are found by module, not by path, so any decoder-only family
whose forward takes ``inputs_embeds`` and such a mask runs (a learned absolute position
embedding, GPT-2's, is added by the forward before block 0, as the lens backend does).

User interventions
------------------
``fwd_hooks`` of :meth:`probekit.StepEngine.run` take, besides TransformerLens-style
residual hooks (``blocks.{b}.hook_resid_pre`` / ``hook_resid_post``, ``fn(act, hook)``),
nnsight interventions ``("nnsight", fn)`` (:func:`intervention`). ``fn(model, step)``
is called inside every block-range trace, in its own ``tracer.invoke()`` (so it reads
and writes modules in its own order, over the whole batch), before the engine's
captures and edits at each location: ``model`` is the ``TransformersModel`` envoy,
``step`` a :class:`TraceStep` (``pass_index``, ``positions``, ``blocks``). Touch only
blocks in ``step.blocks``; the others do not run in that trace.

Sessions and remote execution
-----------------------------
The engine's per-token loop is ordinary Python around these traces, so
``with session(engine): result = nnsight.save(engine.run(...))`` runs a whole
recurrent run as ONE nnsight session, which is the unit NDIF executes remotely
(docs/nnsight.md says what a remote run needs and what is not supported yet).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from probekit.core.backends.base import Backend, Edit
from probekit.core.kv_cache import KVCache

#: The ``fwd_hooks`` name that marks an nnsight intervention: ``("nnsight", fn)``.
NNSIGHT = "nnsight"

_RESID_HOOK = re.compile(r"blocks\.(\d+)\.hook_resid_(pre|post)")


@dataclass(frozen=True)
class TraceStep:
    """What an nnsight intervention sees of the trace it runs in.

    Attributes:
        pass_index: 0 for a chunk's first pass, 1, 2, ... for its recurrent passes, counted
            per chunk: ``engine.state.pass_index`` inside :meth:`probekit.StepEngine.run`
            (a direct :meth:`~probekit.StepEngine.run_blocks` call is a chunk of its own:
            its ``pass_index=`` is in ``engine.state``, not here).
        positions: ``[pos]`` absolute positions of the chunk.
        blocks: the blocks this trace runs; only their modules can be read or edited.
    """

    pass_index: int
    positions: Tensor
    blocks: range


def intervention(fn: Callable[[Any, TraceStep], None]) -> tuple[str, Callable]:
    """``fwd_hooks`` entry running ``fn(model, step)`` in every block-range trace."""
    return (NNSIGHT, fn)


@dataclass
class _Chunk:
    """Position data of one chunk (``prepare_positions``), shared by all its passes."""

    positions: Tensor
    position_ids: Tensor  # [1, pos]
    mask: Tensor | dict[str, Tensor]  # [1, 1, pos, c0 + pos] additive (one per layer type)
    passes: int = 0  # block-range traces run for this chunk so far


@dataclass(frozen=True)
class _HookPoint:
    """Stands in for TransformerLens' ``HookPoint`` argument: hooks read ``hook.name``."""

    name: str


class NNsightBackend(Backend):
    name = "nnsight"

    def __init__(self, model) -> None:
        from nnsight.modeling.transformers import TransformersModel

        hf = model.hf_model
        if getattr(hf, "_probekit_bridge", None) is not None:
            raise ValueError(
                "this model was booted by the lens backend (TransformerLens wraps it in "
                "place); load it again with load_model() for the nnsight backend"
            )
        lm = getattr(hf, "_probekit_nnsight", None)
        if lm is None:
            # nnsight sets the tokenizer's padding side and pad token: give it a copy so
            # the shared tokenizer stays as probekit loaded it.
            lm = TransformersModel(hf, tokenizer=copy.deepcopy(model.tokenizer),
                                   task="text-generation")
            # One envoy tree per HF model: nnsight instruments the modules in place.
            object.__setattr__(hf, "_probekit_nnsight", lm)
            # A remote session pickles the engine, which holds the HF model: tag every
            # module with the id nnsight's envoys give it when pickled, so the server
            # resolves them to its own copy and no weights travel.
            for envoy in lm.modules():
                envoy._module.__dict__.setdefault("_persistent_id", f"Module:{envoy.path}")
        self.lm = lm
        self.hf = hf
        cfg = hf.config
        self.n_blocks = cfg.num_hidden_layers
        self.d_model = cfg.hidden_size
        self.n_ctx = cfg.max_position_embeddings
        self.vocab_size = cfg.vocab_size
        self.dtype = next(hf.parameters()).dtype
        # The envoys of the token embedding and the block list, found by module rather
        # than spelled (model.model.layers in Llama/Gemma, model.transformer.h in GPT-2).
        names = {id(m): n for n, m in hf.named_modules()}
        layers = next(m for m in hf.base_model.children()
                      if isinstance(m, torch.nn.ModuleList) and len(m) == self.n_blocks)
        self._embed = lm.get(names[id(hf.get_input_embeddings())])
        self.layers = lm.get(names[id(layers)])
        # Per-layer-type sliding windows (Gemma 3): the forward takes one mask per type.
        types = getattr(cfg, "layer_types", None)
        self._window = (getattr(cfg, "sliding_window", None)
                        if types and "sliding_attention" in types else None)
        self._interventions: list[Callable] = []
        self._resid_hooks: dict[tuple[int, str], list[tuple[str, Callable]]] = {}

    # ------------------------------------------------------------------ traces
    def _forward(self, resid: Tensor, *, chunk: _Chunk | None, cache: KVCache | None):
        """What every block-range and readout trace runs: the model's own forward."""
        if chunk is None:
            return self.hf(inputs_embeds=resid, use_cache=False)
        return self.hf(inputs_embeds=resid, attention_mask=chunk.mask,
                       position_ids=chunk.position_ids, past_key_values=cache,
                       use_cache=True)

    def embed(self, input_ids: Tensor) -> Tensor:
        out = {}
        with self.lm.trace(input_ids) as tracer:
            out["embeds"] = self._embed.output
            tracer.stop()
        return out["embeds"]

    def prepare_positions(self, positions: Tensor) -> _Chunk:
        q, kv = len(positions), int(positions[-1]) + 1
        query = torch.arange(kv - q, kv)[:, None]
        key = torch.arange(kv)[None, :]
        mask = self._additive(key <= query)
        if self._window is not None:  # query p sees keys p-w+1 .. p in a sliding block
            band = self._additive((key <= query) & (key > query - self._window))
            mask = {"full_attention": mask, "sliding_attention": band}
        return _Chunk(positions, positions[None].to(self.hf.device), mask)

    def _additive(self, seen: Tensor) -> Tensor:
        """``[q, kv]`` bool -> ``[1, 1, q, kv]`` additive mask, which HF takes as given."""
        mask = torch.zeros(seen.shape, dtype=self.dtype).masked_fill(
            ~seen, torch.finfo(self.dtype).min)
        return mask[None, None].to(self.hf.device)

    def run_block(self, block: int, resid: Tensor, pos: _Chunk, cache: KVCache) -> Tensor:
        return self.run_blocks(block, block + 1, resid, pos, cache)[0]

    def run_blocks(
        self,
        start: int,
        stop: int,
        resid: Tensor,
        pos: _Chunk,
        cache: KVCache,
        capture: Iterable[int] = (),
        edits: Mapping[int, Edit] | None = None,
    ) -> tuple[Tensor, dict[int, Tensor]]:
        if start >= stop:
            return resid, {}
        for b in range(start, stop):  # the masks cover every cached key: no windowing
            if getattr(cache, "windows", None) and cache.windows[b] is not None:
                cache.set_window(b, None)
        step = TraceStep(pos.passes, pos.positions, range(start, stop))
        pos.passes += 1
        capture, edits, out = set(capture), edits or {}, {}
        if not self._interventions:
            with self.lm.trace(resid, fn=self._forward, chunk=pos, cache=cache) as tracer:
                self._blocks(tracer, step.blocks, resid, capture, edits, out)
            return out["top"], out["captured"]
        from nnsight.intervention.interleaver import OutOfOrderError

        try:
            with self.lm.trace(fn=self._forward) as tracer:
                # The user's invokes come first: at a shared location they act before the
                # engine's captures and edits, as a TransformerLens hook does in a block.
                for fn in self._interventions:
                    with tracer.invoke():
                        fn(self.lm, step)
                with tracer.invoke(resid, chunk=pos, cache=cache):
                    self._blocks(tracer, step.blocks, resid, capture, edits, out)
        except OutOfOrderError as e:
            raise RuntimeError(
                f"an nnsight intervention asked for a location this trace never reached "
                f"({e}); the trace runs blocks {start}..{stop - 1} (step.blocks), in order"
            ) from e
        return out["top"], out["captured"]

    def _blocks(self, tracer, blocks: range, resid: Tensor, capture: set[int],
                edits: Mapping[int, Edit], out: dict) -> None:
        """The engine's side of a block-range trace (runs inside it, module by module)."""
        layers = self.layers
        for b in range(blocks.start):
            layers[b].skip(resid)  # below the range: the input passes through unchanged
        captured = {}
        x = resid
        for b in blocks:
            hooks = self._resid_hooks.get((b, "pre"))
            if hooks:
                layers[b].input = _fire(hooks, layers[b].input)
            x = layers[b].output
            hooks = self._resid_hooks.get((b, "post"))
            if hooks:
                x = _fire(hooks, x)
                layers[b].output = x
            if b in capture:
                captured[b] = x
            if b in edits:
                x = edits[b](x)
                layers[b].output = x
        out["top"], out["captured"] = x, captured
        tracer.stop()  # nothing above the range runs: no final norm, no unembedding

    def unembed(self, resid: Tensor) -> Tensor:
        x = resid if resid.ndim == 3 else resid.reshape(-1, *resid.shape[-2:])
        out = {}
        with self.lm.trace(x, fn=self._forward, chunk=None, cache=None):
            for layer in self.layers:
                layer.skip(x)
            # the forward's own logits: final norm, unembedding, any soft-capping
            out["logits"] = self.lm.output.logits
        return out["logits"].reshape(*resid.shape[:-1], -1)

    # ------------------------------------------------------------------- hooks
    @contextmanager
    def hooks(self, fwd_hooks: Iterable[tuple[Any, Callable]]):
        interventions, resid_hooks = self._parse(list(fwd_hooks))
        saved = self._interventions, self._resid_hooks
        merged = {k: list(v) for k, v in self._resid_hooks.items()}
        for key, hs in resid_hooks.items():
            merged.setdefault(key, []).extend(hs)
        self._interventions = self._interventions + interventions
        self._resid_hooks = merged
        try:
            yield
        finally:
            self._interventions, self._resid_hooks = saved

    def _parse(self, fwd_hooks: list) -> tuple[list[Callable], dict]:
        """Split ``fwd_hooks`` into nnsight interventions and residual hooks (by block)."""
        names = [f"blocks.{b}.hook_resid_{k}" for b in range(self.n_blocks)
                 for k in ("pre", "post")]
        interventions, resid_hooks = [], {}
        for item in fwd_hooks:
            if not (isinstance(item, tuple) and len(item) == 2 and callable(item[1])):
                raise ValueError(f"fwd_hooks entries must be (name, fn) pairs; got {item!r}")
            name, fn = item
            if name == NNSIGHT:
                interventions.append(fn)
                continue
            chosen = [n for n in names if name(n)] if callable(name) else [name]
            for n in chosen:
                m = _RESID_HOOK.fullmatch(n) if isinstance(n, str) else None
                if m is None or int(m.group(1)) >= self.n_blocks:
                    raise ValueError(
                        f"the nnsight backend takes the hooks blocks.{{b}}.hook_resid_pre/"
                        f"post (b < {self.n_blocks}) and ('nnsight', fn) interventions; got "
                        f"{n!r}: read or edit other activations with an nnsight intervention"
                    )
                resid_hooks.setdefault((int(m.group(1)), m.group(2)), []).append((n, fn))
        return interventions, resid_hooks


def _fire(hooks: list[tuple[str, Callable]], act: Tensor) -> Tensor:
    """Apply TransformerLens-style hooks in order; a hook returning None keeps ``act``."""
    for name, fn in hooks:
        new = fn(act, hook=_HookPoint(name))
        act = act if new is None else new
    return act


def nnsight_model(engine):
    """The ``TransformersModel`` envoy an nnsight-backed :class:`probekit.StepEngine` runs."""
    backend = engine.backend
    if not isinstance(backend, NNsightBackend):
        raise ValueError(f"the engine runs the {backend.name!r} backend; build it with "
                         "StepEngine(model, backend='nnsight')")
    return backend.lm


def session(engine, **kwargs):
    """``with session(engine):`` — one nnsight session around whole engine runs.

    ``kwargs`` go to ``TransformersModel.session`` (``remote=True`` sends the session to
    NDIF, ``remote="local"`` runs nnsight's serialize/deserialize dry run here). Values
    leave the session only when saved: ``result = nnsight.save(engine.run(...))``."""
    lm = nnsight_model(engine)
    if kwargs.get("remote"):
        import nnsight

        # The server has no probekit: ship its code by value with the session.
        nnsight.register("probekit")
    return lm.session(**kwargs)
