"""The step engine: run a model position by position on a KV cache, with recurrences.

One loop, obvious state. For each chunk of ``block_size`` positions (``K = 1`` is
the exact token-by-token method; the default)::

        positions c0 .. c1-1                    cache: positions < c0 in every block
    ┌──────────────────────────────────────┐
    │ x = embed(tokens)                     │  recurrence.form_input  (latent feedback)
    │ pass 0: blocks 0 .. L-1  ──> logits    │  READOUT: log-probs come from pass 0 only
    │         (appends K/V at c0..c1-1)      │
    │ recurrence.after_first_pass(...)       │  may call rerun(start, resid, replace=):
    │   rerun: truncate blocks start..L-1    │    keys/values of c0..c1-1 in those blocks
    │          back to c0, run them again    │    are REPLACED by the new pass's for the
    │          (pass 1, 2, ...)              │    (row, position) pairs in `replace`; the
    └──────────────────────────────────────┘    others keep theirs; blocks below `start`
                                                keep pass-0 entries

``replace`` is how recirculation keeps first-pass keys/values at the positions that do
not recirculate when a chunk holds several positions (SEMANTICS.md): the pass runs the
whole chunk, but those pairs keep their entries and the others attend to them.

The engine owns the cache, positions, batching, padding, dtype and progress; a
recurrence (:class:`Recurrence`) owns only its maths and is called at fixed points.
Adding a recurrence never touches this file.

Batches are right-padded. Because attention is causal, a real position ``t < len``
only ever attends to positions ``<= t``, all real, so padding cannot leak into a
result; padded positions are computed and thrown away (their log-probs are NaN).

User hooks (``fwd_hooks``, TransformerLens names such as ``blocks.5.hook_resid_post``)
fire on every pass; inside a hook, ``engine.state`` tells which positions and which
pass (0 = first pass) is running.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from probekit.core.backends import Backend, Edit, make_backend
from probekit.core.kv_cache import KVCache

# Re-exported: mechanisms import the strategy interface and the scoring from here.
from probekit.core.recurrence import Recurrence, Rerun, Step
from probekit.core.scoring import chunk_bounds, score, score_chunk, target_log_probs

__all__ = ["EngineState", "Recurrence", "Rerun", "RunResult", "Step", "StepEngine",
           "chunk_bounds", "score", "target_log_probs"]


READ_BUDGET = 1 << 26  # logits unembedded at once when they are only scored (256 MB)


@dataclass
class EngineState:
    """Readable from inside hooks: where the engine is right now."""

    positions: Tensor | None = None
    pass_index: int = 0  # 0 = first pass (the readout); 1, 2, ... = recurrent passes


@dataclass
class RunResult:
    """The outcome of :meth:`StepEngine.run`.

    Attributes:
        input_ids: ``[batch, seq]`` right-padded tokens.
        lengths: ``[batch]`` real lengths.
        log_probs: ``[batch, seq-1]`` ``log p(x[t+1] | prediction at t)`` from the first
            pass, NaN where ``t+1`` is padding.
        logits: ``[batch, seq, vocab]`` first-pass logits if requested, else None.
        cache: the final KV cache if requested, else None.
    """

    input_ids: Tensor
    lengths: Tensor
    log_probs: Tensor
    logits: Tensor | None = None
    cache: KVCache | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    def sequence_log_probs(self, i: int) -> Tensor:
        """The ``lengths[i] - 1`` valid log-probs of sequence ``i``."""
        return self.log_probs[i, : int(self.lengths[i]) - 1]


class StepEngine:
    """Runs a model chunk by chunk with a KV cache and an optional recurrence.

    Args:
        model: a :class:`probekit.LoadedModel`.
        backend: ``"lens"`` (TransformerLens bridge), ``"nnsight"`` (nnsight traces) or a
            :class:`Backend` instance.
    """

    def __init__(self, model, backend: str | Backend = "lens") -> None:
        self.model = model
        self.backend = make_backend(model, backend) if isinstance(backend, str) else backend
        self.state = EngineState()
        pad = getattr(model.tokenizer, "pad_token_id", None)
        eos = getattr(model.tokenizer, "eos_token_id", None)
        self.pad_id = pad if pad is not None else (eos if eos is not None else 0)

    @property
    def n_blocks(self) -> int:
        return self.backend.n_blocks

    # ------------------------------------------------------------------ inputs
    def batch(self, input_ids: Tensor | Sequence[Sequence[int]]) -> tuple[Tensor, Tensor]:
        """Validate and right-pad ``input_ids`` -> (``[batch, seq]`` ids, ``[batch]`` lengths)."""
        if isinstance(input_ids, Tensor):
            if input_ids.dtype == torch.bool or input_ids.is_floating_point() \
                    or input_ids.is_complex():
                raise ValueError(f"input_ids must be integer token ids; got "
                                 f"{str(input_ids.dtype).removeprefix('torch.')}")
            if input_ids.ndim == 1:
                input_ids = input_ids[None]
            if input_ids.ndim != 2:
                raise ValueError(
                    f"input_ids must be [batch, seq]; got shape {tuple(input_ids.shape)}"
                )
            rows = [r for r in input_ids.tolist()]
        else:
            rows = [list(r) for r in input_ids]
            for t in (t for r in rows for t in r):
                if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                    raise ValueError(f"input_ids must be integer token ids; got {t!r}")
        if not rows or any(len(r) == 0 for r in rows):
            raise ValueError("empty input: every sequence needs at least one token")
        longest = max(len(r) for r in rows)
        if longest > self.backend.n_ctx:
            raise ValueError(
                f"sequence of {longest} tokens exceeds the model's context of "
                f"{self.backend.n_ctx} tokens; use shorter windows (--window-tokens)"
            )
        vocab = self.backend.vocab_size
        flat = [t for r in rows for t in r]
        if min(flat) < 0 or max(flat) >= vocab:
            raise ValueError(f"token ids must lie in [0, {vocab}); got {min(flat)}..{max(flat)}")
        ids = torch.full((len(rows), longest), self.pad_id, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
        return ids, lengths

    @staticmethod
    def active_mask(active: Tensor | None, lengths: Tensor, seq: int) -> Tensor:
        """``[batch, seq]`` bool: the user's mask (``[seq]`` or ``[batch, seq]``, default
        all) and-ed with "is a real token"."""
        batch = len(lengths)
        real = torch.arange(seq)[None, :] < lengths[:, None]
        if active is None:
            return real
        active = torch.as_tensor(active)
        if active.dtype != torch.bool:
            bad = (active.is_floating_point() or active.is_complex()
                   or bool(((active != 0) & (active != 1)).any()))
            if bad:
                shown = (str(active.dtype).removeprefix("torch.")
                         if active.is_floating_point() or active.is_complex()
                         else active[(active != 0) & (active != 1)][0].item())
                raise ValueError(f"mask must be boolean (or 0/1 integers); got {shown}")
            active = active.bool()
        if active.ndim == 1:
            active = active[None].expand(batch, -1)
        if active.ndim != 2 or active.shape[0] != batch or active.shape[1] != seq:
            raise ValueError(
                f"mask must be [seq] or [batch, seq] = {batch} x {seq}; "
                f"got {tuple(active.shape)}"
            )
        return active & real

    # --------------------------------------------------------------------- run
    @torch.no_grad()
    def run(
        self,
        input_ids: Tensor | Sequence[Sequence[int]],
        recurrence: Recurrence | None = None,
        *,
        mask: Tensor | None = None,
        block_size: int | Sequence[int] = 1,
        start: int = 0,
        cache: KVCache | None = None,
        fwd_hooks: Iterable[tuple[Any, Callable]] = (),
        temperature: float = 1.0,
        return_logits: bool = False,
        return_cache: bool = False,
        readout: bool | str = True,
        progress: bool = False,
    ) -> RunResult:
        """Run ``input_ids`` (a ``[batch, seq]`` tensor or ragged lists of ids).

        Args:
            recurrence: strategy applied at every chunk (None: the plain model).
            mask: which positions the recurrence acts on, ``[seq]`` or ``[batch, seq]``.
            block_size: positions per chunk; 1 is exact token-by-token, ``seq`` with no
                recurrence is one parallel forward. A sequence gives the sizes of the
                consecutive chunks (they must cover positions ``start .. seq-1``).
            start, cache: continue a run: positions ``< start`` are already in ``cache``
                (e.g. a baseline cache from ``return_cache=True``, see
                :meth:`KVCache.copy`); only positions ``>= start`` are run and scored.
            fwd_hooks: TransformerLens ``(name, fn)`` pairs active during the run.
            temperature: log-probs are ``log_softmax(logits / temperature)``.
            readout: ``True`` (default): logits and log-probs of each chunk come from its
                first pass (SEMANTICS.md's readout rule); ``"last"``: from the last pass
                the recurrence ran for the chunk (latent feedback's ``passes=n``);
                ``False``: no unembedding at all (capture-only runs; log-probs stay NaN).
        """
        recurrence = recurrence or Recurrence()
        if readout not in (True, False, "last"):
            raise ValueError(f"readout must be True, False or 'last'; got {readout!r}")
        if return_logits and readout is False:
            raise ValueError("return_logits needs a readout (readout=True or 'last')")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0; got {temperature}")
        # All validation happens before any state is created or changed.
        recurrence.check(self.n_blocks)
        ids, lengths = self.batch(input_ids)
        batch, seq = ids.shape
        active = self.active_mask(mask, lengths, seq)
        bounds = chunk_bounds(block_size, start, seq)
        L = self.n_blocks
        if cache is None:
            if start != 0:
                raise ValueError("start > 0 needs the cache holding positions < start")
            cache = KVCache(L, seq)
        elif any(n != start for n in cache.lengths) or cache.max_len < seq:
            raise ValueError(
                f"cache must hold exactly positions < start={start} in every block and room "
                f"for {seq}; it holds {sorted(set(cache.lengths))} of max_len {cache.max_len}"
            )

        recurrence.begin(batch, seq)
        log_probs = torch.full((batch, max(seq - 1, 0)), float("nan"))
        logits_out = torch.empty(batch, seq, self.backend.vocab_size) if return_logits else None
        capture = recurrence.capture_first

        bar = tqdm(bounds, desc="steps", unit="chunk", disable=not progress, leave=False)
        with self.backend.hooks(fwd_hooks), self._idle_after():
            for c0, c1 in bar:
                positions = torch.arange(c0, c1)
                step = Step(c0, positions, active[:, c0:c1], ids[:, c0:c1])
                pos = self.backend.prepare_positions(positions)
                self.state.positions, self.state.pass_index = positions, 0

                x = recurrence.form_input(step, self.backend.embed(step.input_ids))
                top, captured = self.backend.run_blocks(0, L, x, pos, cache, capture)
                self._last_top = top
                if readout is True:
                    self._read(top, ids, lengths, c0, c1, temperature, log_probs, logits_out)

                rerun = partial(self._rerun, cache, c0, pos, readout == "last")
                recurrence.after_first_pass(step, captured, top, rerun)
                if readout == "last":
                    self._read(self._last_top, ids, lengths, c0, c1, temperature, log_probs,
                               logits_out)
        return RunResult(ids, lengths, log_probs, logits_out, cache if return_cache else None)

    def _rerun(self, cache: KVCache, c0: int, pos: Any, keep_top: bool, start: int,
               resid: Tensor, capture: Iterable[int] = (),
               edits: Mapping[int, Edit] | None = None,
               replace: Tensor | None = None) -> dict[int, Tensor]:
        """Run blocks ``start .. L-1`` again for the chunk starting at ``c0``, replacing
        (not appending to) the keys/values of the chunk's pairs in ``replace`` (default
        all) in those blocks; the other pairs keep the entries they have."""
        if replace is not None and tuple(replace.shape) != tuple(resid.shape[:2]):
            raise ValueError(f"replace must be [batch, pos] = {tuple(resid.shape[:2])}; "
                             f"got {tuple(replace.shape)}")
        cache.truncate(range(start, self.n_blocks), c0)
        self.state.pass_index += 1
        keep = torch.zeros(resid.shape[:2], dtype=torch.bool) if replace is None else ~replace
        with cache.keeping(c0, keep):
            top, out = self.backend.run_blocks(start, self.n_blocks, resid, pos, cache,
                                               capture, edits)
        if keep_top:
            self._last_top = top
        return out

    def _read(self, top, ids, lengths, c0, c1, temperature, log_probs, logits_out) -> None:
        # Unembed at most READ_BUDGET logits at a time (a 262k vocabulary makes a whole
        # chunk's [batch, pos, vocab] logits gigabytes); every position is scored alone.
        step = c1 - c0 if logits_out is not None else max(
            1, min(c1 - c0, READ_BUDGET // (top.shape[0] * self.backend.vocab_size)))
        for a in range(c0, c1, step):
            logits = self.backend.unembed(top[:, a - c0 : a - c0 + step])
            score_chunk(logits, ids, lengths, a, min(c1, a + step), temperature, log_probs)
            if logits_out is not None:
                logits_out[:, c0:c1] = logits

    # ------------------------------------------------------- public operations
    # What analyses and mechanisms need below the level of a whole run; nothing outside
    # probekit.core touches ``self.backend`` or ``self.state`` directly.
    @property
    def n_ctx(self) -> int:
        return self.backend.n_ctx

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.hf_model.parameters()).dtype

    def embed(self, input_ids: Tensor) -> Tensor:
        """Token ids ``[batch, pos]`` -> the plain model input ``[batch, pos, d_model]``."""
        return self.backend.embed(input_ids)

    @torch.no_grad()
    def unembed(self, resid: Tensor) -> Tensor:
        """Float32 logits of top residuals ``[..., pos, d_model]`` (final norm, unembedding)."""
        return self.backend.unembed(resid.to(self.dtype)).float()

    def hooks(self, fwd_hooks: Iterable[tuple[Any, Callable]] = ()):
        """Context manager attaching TransformerLens ``(name, fn)`` hooks (none: fast path)."""
        return self.backend.hooks(fwd_hooks)

    @torch.no_grad()
    def run_blocks(self, start: int, stop: int, resid: Tensor, positions: Tensor,
                   cache: KVCache, *, capture: Iterable[int] = (), pass_index: int = 0,
                   edits: Mapping[int, Edit] | None = None) -> tuple[Tensor, dict[int, Tensor]]:
        """Run blocks ``start .. stop-1`` on ``resid`` ``[batch, pos, d_model]`` at absolute
        ``positions``, appending keys/values to ``cache``; hooks see ``pass_index``.
        Returns the last output and the outputs of blocks in ``capture``."""
        with self._idle_after():
            self.state.positions, self.state.pass_index = positions, pass_index
            pos = self.backend.prepare_positions(positions)
            return self.backend.run_blocks(start, stop, resid, pos, cache, capture, edits)

    @contextmanager
    def _idle_after(self) -> Iterator[None]:
        """Reset :attr:`state` when the block ends, also on an error inside a hook."""
        try:
            yield
        finally:
            self.state = EngineState()

    @torch.no_grad()
    def rerun_position(self, cache: KVCache, position: int, resid: Tensor, start: int = 0,
                       *, capture: Iterable[int] = ()) -> tuple[Tensor, dict[int, Tensor]]:
        """Run blocks ``start .. L-1`` for the single ``position`` from ``resid``
        ``[batch, d_model]`` (its input to block ``start``) on ``cache``, which must hold
        exactly positions ``< position``; the cache is left as it was. No hooks fire (the
        backend may take its fast path). Returns the top ``[batch, d_model]`` and the
        captured block outputs ``{b: [batch, d_model]}``.

        This is how causal patching and capture re-read one position (SEMANTICS.md: a
        position's readout depends only on the cache of earlier positions)."""
        L = self.n_blocks
        if not 0 <= start <= L:
            raise ValueError(f"start must lie in 0..{L}; got {start}")
        if any(n != position for n in cache.lengths):
            raise ValueError(f"the cache must hold exactly positions < {position}; it holds "
                             f"{sorted(set(cache.lengths))}")
        if start == L:
            return resid, {}
        with self.hooks(()):
            top, out = self.run_blocks(start, L, resid[:, None], torch.tensor([position]),
                                       cache, capture=capture)
        cache.truncate(range(start, L), position)
        return top[:, 0], {b: v[:, 0] for b, v in out.items()}

    def forward(self, input_ids, *, temperature: float = 1.0, **kw) -> RunResult:
        """The plain model in one parallel forward (same maths, one chunk)."""
        ids, _ = self.batch(input_ids)
        return self.run(input_ids, block_size=ids.shape[1], temperature=temperature, **kw)

    def run_with_cache(
        self,
        input_ids,
        recurrence: Recurrence | None = None,
        *,
        names: Sequence[str],
        pass_index: int = 0,
        **kw,
    ) -> tuple[RunResult, dict[str, Tensor]]:
        """Like :meth:`run`, also returning activations ``names`` of pass ``pass_index``
        as ``[batch, seq, ...]`` tensors (NaN at positions that had no such pass)."""
        store: dict[str, list[tuple[Tensor, Tensor]]] = {n: [] for n in names}

        def make_hook(name: str):
            def hook(act: Tensor, hook=None):
                if self.state.pass_index == pass_index:
                    store[name].append((self.state.positions.clone(), act.detach().clone()))
                return act
            return hook

        hooks = [(n, make_hook(n)) for n in names] + list(kw.pop("fwd_hooks", ()))
        result = self.run(input_ids, recurrence, fwd_hooks=hooks, **kw)
        batch, seq = result.input_ids.shape
        out = {}
        for n, parts in store.items():
            if not parts:
                raise ValueError(f"hook {n!r} never fired on pass {pass_index}")
            shape = parts[0][1].shape[2:]
            full = torch.full((batch, seq, *shape), float("nan"))
            for positions, act in parts:
                full[:, positions] = act.float()
            out[n] = full
        return result, out
