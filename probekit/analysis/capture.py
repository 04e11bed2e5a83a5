"""Capture the final token's residual stream at every depth, under a prefill regime.

The state-tracking experiment of the full-bandwidth paper (latent-feedback paper,
Sec. 4.4, Fig. 7, App. F "Probe construction" and "Recurrent-suffix controls") reads
one vector per residual depth at the shared final token of every example::

    resid[i, r]   example i, residual depth r = 0 .. L   ->   [batch, L + 1, d_model]

Depth ``r < L`` is the input of block ``r`` (TransformerLens
``blocks.{r}.hook_resid_pre``; ``r = 0`` is the model input: the token embedding, or the
fused input under latent feedback); depth ``L`` is the output of the last block
(``blocks.{L-1}.hook_resid_post``). In a first pass with no edits the input of block
``r`` is the output of block ``r - 1``, so this is SEMANTICS.md's "depth ``r = b + 1`` is
the output of block ``b``". Only the final token's vectors are kept (hooks pick that
position out of every chunk), so memory is ``batch x (L + 1) x d_model`` whatever the
prompt length.

Two ways to read them, with the same result (a test compares them): hooks on every
depth during the run (general; any pass), or, when the mechanism knows the final token's
depth-0 input in advance and reads out on the first pass (recirculation:
:meth:`Mechanism.final_input`), a run with no hooks (the backend's fast block path) and
then one extra pass of the final position over the run's cache, which by the readout
rule below is exactly its readout pass.

Which pass: by default the **readout pass** of the final token, the pass its logits come
from (the first pass for recirculation; the last Jacobi pass for latent feedback's
``passes=n``). ``pass_index=p`` asks for the state as of pass ``p`` instead: each depth
reports the latest pass ``<= p`` that computed it. Recirculation's second pass starts
above block ``d``, so depths ``0 .. d`` of pass 1 are pass 0's and depth ``d + 1`` is the
mixed state ``z'_d`` the second pass started from; a regime with no second pass at the
final token (``none``) reports pass 0 everywhere.

A **mechanism** (:class:`Mechanism`) says how a batch is prefilled under a regime
name. Regimes (latent-feedback paper App. F; SEMANTICS.md "Latent feedback"):

=========  ===========================================================  ================
``none``   the plain model, one parallel forward                        1 forward
``last-k`` plain forward of positions ``< T - k``, then the final ``k``   ~``k + 1``
           positions token by token with the mechanism on                forwards
``full``   every position token by token with the mechanism on          ``T`` steps
=========  ===========================================================  ================

:class:`RecirculationMechanism` implements these for recirculation
(:mod:`probekit.mechanisms.recirculation`); the latent-feedback mechanism implements the same
interface (and adds ``passes=n``).

What the regimes mean for recirculation (SEMANTICS.md readout rule): the final token's
readout comes from its first pass, which depends only on *earlier* positions having
recirculated. So

- ``last-1`` equals ``none`` at the final token (to float rounding): the final
  position's own second pass cannot reach its own readout (a test pins this);
- ``last-k`` lets the ``k - 1`` tokens before the final one recirculate;
- blocks ``0 .. d`` keep first-pass keys/values everywhere, so the final token's
  residuals at depths ``0 .. d + 1`` are **the same under every regime** (up to float
  rounding: a parallel and a token-by-token run sum in different orders; a test pins
  this too). Recirculation can only change what the final token reads from depth
  ``d + 2`` up; it never changes its model input. Latent feedback, by contrast, changes
  depth 0 itself.

Causal patching (:mod:`probekit.analysis.causal`) re-runs only the final position from a patched
depth on the context the readout pass saw; :class:`Capture` carries that context (the
KV cache of positions ``< T - 1``).
"""

from __future__ import annotations

import importlib
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from probekit.core.engine import Recurrence, RunResult, StepEngine
from probekit.core.kv_cache import KVCache
from probekit.mechanisms.recirculation import Recirculation

_LAST_K = re.compile(r"last-(\d+)")


def parse_regime(name: str) -> tuple[str, int | None]:
    """``"none"`` / ``"full"`` / ``"last-<k>"`` -> ``(kind, k)``; ValueError otherwise."""
    name = name.strip()
    if name in ("none", "full"):
        return name, None
    if m := _LAST_K.fullmatch(name):
        k = int(m.group(1))
        if k >= 1:
            return "last-k", k
    raise ValueError(
        f"regime must be none, full or last-<k> with k >= 1 (e.g. last-2); got {name!r}"
    )


def expand_regimes(specs: Iterable[str], ks: Sequence[int] = (1, 2, 4)) -> list[str]:
    """Regime names from command-line words: ``["none,last-k", "full"]`` with ``ks=(1, 2)``
    -> ``["none", "last-1", "last-2", "full"]``; duplicates are dropped, order is kept.

    ``last-k`` stands for ``last-<k>`` for every ``k`` in ``ks``; ``last-3`` names one."""
    out: list[str] = []
    for spec in specs:
        for word in filter(None, (w.strip() for w in spec.split(","))):
            if word == "last-k":
                if not ks or any(not isinstance(k, int) or k < 1 for k in ks):
                    raise ValueError(f"--k must list integers >= 1 for last-k; got {list(ks)}")
                names = [f"last-{k}" for k in ks]
            else:
                names = [word]
            out += [n for n in names if n not in out]
    if not out:
        raise ValueError("give at least one regime: none, last-k (with --k), last-<k> or full")
    return out


def depth_hook_names(n_blocks: int) -> list[str]:
    """TransformerLens hook of each residual depth ``0 .. L`` (module docstring)."""
    return [f"blocks.{r}.hook_resid_pre" for r in range(n_blocks)] + [
        f"blocks.{n_blocks - 1}.hook_resid_post"
    ]


class Mechanism(ABC):
    """How to prefill a batch under a regime; plug-in point of the state-tracking pipeline.

    A subclass sets ``name`` and implements :meth:`run` (and :meth:`check_regime` for
    regimes beyond ``none``/``last-k``/``full``). The contract :meth:`run` must keep,
    which capture and causal patching rely on:

    - the final position's readout pass runs blocks ``0 .. L-1`` in order from its depth-0
      input, firing ``blocks.{b}.hook_resid_pre`` / ``hook_resid_post``, with
      ``engine.state.pass_index`` telling the pass (it is a :meth:`StepEngine.run`);
    - the returned ``RunResult.cache`` holds, at positions ``< T - 1``, exactly the
      keys/values that pass attended to (true of every engine run, since a position's
      keys/values are final once the next position starts);
    - ``RunResult.extras["pass_index"]`` is the readout pass (absent: 0).
    """

    name: str = "mechanism"

    def check_regime(self, regime: str) -> None:
        """Raise ValueError (saying what is accepted) if ``regime`` is not supported."""
        parse_regime(regime)

    def check(self, n_blocks: int) -> None:
        """Raise ValueError if this mechanism cannot run on a model of ``n_blocks`` blocks."""
        return None  # any depth will do unless a subclass says otherwise

    def config(self) -> dict[str, Any]:
        """JSON-friendly parameters, recorded in run directories and results."""
        return {"mechanism": self.name}

    def notes(self) -> list[str]:
        """Facts that decide how to read this mechanism's curves (printed and saved)."""
        return []

    def final_input(self, engine: StepEngine, input_ids: Tensor, regime: str) -> Tensor | None:
        """The final token's depth-0 input ``[batch, d_model]`` if it is known without the
        run and the readout is the first pass; None (the default) captures through hooks.

        Given it, :func:`capture_final` runs the mechanism without hooks (the backend's
        fast path) and then re-runs only the final position's blocks from this input on
        the run's cache, which by the contract above is the readout pass exactly."""
        return None

    @abstractmethod
    def run(
        self,
        engine: StepEngine,
        input_ids: Tensor,
        regime: str,
        *,
        fwd_hooks: Sequence[tuple[str, Callable]] = (),
    ) -> RunResult:
        """Prefill ``input_ids`` ``[batch, T]`` under ``regime``; return the engine's result
        with its cache (``return_cache=True``)."""


def regime_plan(regime: str, seq_len: int) -> tuple[Tensor | None, int | list[int]]:
    """``(mask, block_size)`` of one :meth:`StepEngine.run` for a regime on ``seq_len``
    tokens: ``none`` one chunk and no mask; ``full`` token by token; ``last-k`` one
    parallel chunk of the first ``T - k`` positions, then the last ``k`` one by one, the
    mask on those ``k`` only."""
    kind, k = parse_regime(regime)
    if kind == "none":
        return None, seq_len
    if kind == "full":
        return None, 1
    if k >= seq_len:
        raise ValueError(
            f"regime {regime} needs prompts longer than k={k} tokens; these have {seq_len}"
        )
    mask = torch.arange(seq_len) >= seq_len - k
    return mask, [seq_len - k] + [1] * k


class RecurrenceMechanism(Mechanism):
    """A mechanism given by one engine :class:`~probekit.core.engine.Recurrence` that acts on
    the positions a mask selects (:func:`regime_plan`); subclasses give :meth:`recurrence`."""

    @abstractmethod
    def recurrence(self):
        """A fresh strategy object for one run."""

    def check(self, n_blocks: int) -> None:
        self.recurrence().check(n_blocks)

    def final_input(self, engine, input_ids, regime):
        # Only if the strategy leaves inputs alone (recirculation does; latent feedback not).
        if type(self.recurrence()).form_input is not Recurrence.form_input:
            return None
        return engine.backend.embed(input_ids[:, -1:])[:, 0]

    def run(self, engine, input_ids, regime, *, fwd_hooks=()):
        mask, block_size = regime_plan(regime, input_ids.shape[1])
        rec = None if parse_regime(regime)[0] == "none" else self.recurrence()
        return engine.run(input_ids, rec, mask=mask, block_size=block_size,
                          fwd_hooks=fwd_hooks, return_cache=True)


#: Recirculation defaults for SmolLM2-135M (30 blocks): a mid-stack source mixed into a
#: block a third of the way up, alpha 0.1 (recirculation paper Sec. 4.1 uses 0.07-0.15).
DEFAULT_RECIRCULATION = {"source": 20, "destination": 10, "alpha": 0.1}


class RecirculationMechanism(RecurrenceMechanism):
    """Recirculation (:class:`probekit.Recirculation`) as a prefill mechanism.

    Args:
        source, destination: block indices ``0 <= destination < source <= L - 1``.
        alpha, beta: mixing weights (beta None: ``1 - alpha``).
        norm, ramp, iterations: as :class:`probekit.Recirculation`.
    """

    name = "recirculation"

    def __init__(self, source: int = DEFAULT_RECIRCULATION["source"],
                 destination: int = DEFAULT_RECIRCULATION["destination"],
                 alpha: float = DEFAULT_RECIRCULATION["alpha"], beta: float | None = None,
                 *, norm: str = "ratio", ramp: int = 0, iterations: int = 1) -> None:
        self.params = {"source": source, "destination": destination, "alpha": alpha,
                       "beta": beta, "norm": norm, "ramp": ramp, "iterations": iterations}
        self.recurrence()  # validate now: Recirculation raises ValueError on bad values

    @classmethod
    def from_args(cls, args, model=None) -> RecirculationMechanism:
        """From the flags of ``probekit.analysis.perplexity.add_recirculation_args``."""
        return cls(args.source, args.destination, args.alpha, args.beta, norm=args.norm,
                   ramp=args.ramp, iterations=args.iterations)

    def __repr__(self) -> str:
        return f"RecirculationMechanism({self.recurrence()!r})"

    def recurrence(self) -> Recirculation:
        p = self.params
        return Recirculation(p["source"], p["destination"], p["alpha"], p["beta"],
                             norm=p["norm"], ramp=p["ramp"], iterations=p["iterations"])

    def config(self) -> dict[str, Any]:
        return {"mechanism": self.name, **self.params}

    def notes(self) -> list[str]:
        d = self.params["destination"]
        return [
            (f"recirculation keeps first-pass keys/values in blocks 0..{d}, so the final "
             f"token's residuals at depths 0..{d + 1} are the same under every regime, so "
             f"the probe curves coincide there by construction (flip rates need not: a "
             f"patch there still runs through the recirculated blocks above {d})"),
            ("last-1 equals none at the final token: its own recirculation cannot reach "
             "its readout"),
        ]


#: ``--mechanism`` name -> ``"module:Class"`` of a :class:`Mechanism` with a
#: ``from_args(args, model)`` classmethod; optionally an ``add_args(parser)`` staticmethod
#: adding its flags and a ``load_model(args)`` classmethod when it brings its own model.
#: Loaded lazily, so a mechanism whose module is missing only fails when asked for.
MECHANISMS = {
    "recirculation": "probekit.analysis.capture:RecirculationMechanism",
    "latent-feedback": "probekit.mechanisms.latent_feedback:LatentFeedbackMechanism",
}


def mechanism_class(name: str) -> type[Mechanism]:
    """The class registered as ``name`` in :data:`MECHANISMS`; ValueError if unavailable."""
    if name not in MECHANISMS:
        raise ValueError(f"mechanism must be one of {sorted(MECHANISMS)}; got {name!r}")
    module, attr = MECHANISMS[name].split(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"mechanism {name!r} is not available in this install ({MECHANISMS[name]}: {e})"
        ) from e


@dataclass
class Capture:
    """Final-token residuals of one batch under one regime.

    Attributes:
        resid: ``[batch, L + 1, d_model]`` float32, depth 0 .. L (module docstring).
        cache: KV cache holding positions ``< T - 1`` as the final token's readout pass
            saw them (room for one more position): the context for causal patching.
        position: the final position ``T - 1``.
        pass_index: the pass asked for (each depth: the latest pass ``<=`` it).
        readout_top: ``[batch, d_model]`` depth ``L`` of the readout pass (its logits are
            ``unembed(readout_top)``); ``resid[:, L]`` when ``pass_index`` is the readout.
    """

    resid: Tensor
    cache: KVCache
    position: int
    pass_index: int
    readout_top: Tensor


@torch.no_grad()
def capture_final(
    engine: StepEngine,
    mechanism: Mechanism,
    input_ids: Tensor,
    regime: str,
    *,
    pass_index: int | None = None,
    fwd_hooks: Sequence[tuple[str, Callable]] = (),
) -> Capture:
    """Residual of the final token at every depth, for rows of equal length.

    Args:
        input_ids: ``[batch, T]``, every row a real prompt of ``T`` tokens (batch prompts
            by length; ``probekit.analysis.state_tracking`` does).
        pass_index: None for the readout pass, or a pass number: the state as of that
            pass (module docstring).
        fwd_hooks: extra TransformerLens hooks, run before the capturing ones.

    Raises:
        ValueError: for a bad regime, a bad ``pass_index``, or a ragged or empty batch.
    """
    input_ids = torch.as_tensor(input_ids)
    if input_ids.ndim != 2 or input_ids.shape[1] < 1 or input_ids.shape[0] < 1:
        raise ValueError(
            f"input_ids must be [batch, T] with equal-length rows (batch prompts by length); "
            f"got shape {tuple(input_ids.shape)}"
        )
    if pass_index is not None and (not isinstance(pass_index, int) or pass_index < 0):
        raise ValueError(f"pass_index must be None (readout pass) or an integer >= 0; "
                         f"got {pass_index!r}")
    mechanism.check_regime(regime)
    L = engine.n_blocks
    final = input_ids.shape[1] - 1
    if pass_index in (None, 0) and not fwd_hooks:
        x0 = mechanism.final_input(engine, input_ids, regime)
        if x0 is not None:
            return _capture_by_final_rerun(engine, mechanism, input_ids, regime, x0)
    names = depth_hook_names(L)
    # seen[pass][depth] = [batch, d_model] residual of the final token in that pass.
    seen: dict[int, dict[int, Tensor]] = {}

    def make_hook(depth: int):
        def hook(act: Tensor, hook=None) -> Tensor:
            positions = engine.state.positions
            if positions is not None and int(positions[0]) <= final <= int(positions[-1]):
                at = final - int(positions[0])
                seen.setdefault(engine.state.pass_index, {})[depth] = (
                    act[:, at].detach().float().clone()
                )
            return act
        return hook

    hooks = list(fwd_hooks) + [(n, make_hook(r)) for r, n in enumerate(names)]
    result = mechanism.run(engine, input_ids, regime, fwd_hooks=hooks)
    if result.cache is None:
        raise RuntimeError(f"{type(mechanism).__name__}.run must return its cache")
    readout = int(result.extras.get("pass_index", 0))
    want = readout if pass_index is None else pass_index

    def latest(r: int, upto: int) -> Tensor:
        # The latest pass <= upto that computed depth r (module docstring).
        got = [seen[p][r] for p in sorted(seen) if p <= upto and r in seen[p]]
        if not got:
            raise RuntimeError(f"depth {r} was never captured at the final token")
        return got[-1]

    resid = torch.stack([latest(r, want) for r in range(L + 1)], 1)
    result.cache.truncate(range(L), final)
    return Capture(resid, result.cache, final, want, latest(L, readout))


def _capture_by_final_rerun(engine: StepEngine, mechanism: Mechanism, input_ids: Tensor,
                            regime: str, x0: Tensor) -> Capture:
    """Run with no hooks attached, then the final position's blocks once more from ``x0``
    on the cache of positions ``< T - 1`` (``run_blocks`` hands back every block output)."""
    L, final = engine.n_blocks, input_ids.shape[1] - 1
    result = mechanism.run(engine, input_ids, regime)
    if result.cache is None:
        raise RuntimeError(f"{type(mechanism).__name__}.run must return its cache")
    cache = result.cache
    cache.truncate(range(L), final)
    pos = engine.backend.prepare_positions(torch.tensor([final]))
    # An empty hooks() context is a run with no hook attached: the backend may use its
    # fast block path (probekit.core.backends.lens).
    with engine.backend.hooks(()):
        _, out = engine.backend.run_blocks(0, L, x0[:, None], pos, cache, capture=range(L))
    cache.truncate(range(L), final)
    resid = torch.stack([x0.float()] + [out[b][:, 0].float() for b in range(L)], 1)
    return Capture(resid, cache, final, 0, resid[:, L].clone())
