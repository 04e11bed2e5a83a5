"""Prefill mechanisms: how a batch is prefilled under a regime, one plug-in per mechanism.

The state-tracking pipeline (:mod:`probekit.analysis.state_tracking`, latent-feedback
paper Sec. 4.4, Fig. 7, App. F) probes the final token of prompts prefilled under a
:class:`~probekit.mechanisms.regimes.Regime` (``none``, ``last-k``, ``full``,
``passes=n``). What "the mechanism on" means is a plug-in, a :class:`Mechanism`
registered by name in :data:`MECHANISMS` (the ``--mechanism`` word):

- :class:`RecirculationMechanism`: training-free recirculation
  (:class:`probekit.mechanisms.recirculation.Recirculation`) on the regime's positions;
- :class:`LatentFeedbackMechanism`: a trained feedback gate
  (:func:`probekit.mechanisms.latent_feedback.prefill`), which also runs ``passes=n``.

Both turn a regime into one engine call with :func:`probekit.mechanisms.regimes.plan`.
Building one from flags or a checkpoint is the command's job
(:mod:`probekit.commands.state_tracking`); this module never reads files.

What the regimes mean for recirculation (SEMANTICS.md readout rule): the final token's
readout comes from its first pass, which depends only on *earlier* positions having
recirculated. So ``last-1`` equals ``none`` at the final token; ``last-k`` lets the
``k - 1`` tokens before it recirculate; and blocks ``0 .. d`` keep first-pass keys and
values, so the final token's residuals at depths ``0 .. d + 1`` are the same under every
regime. Latent feedback, by contrast, changes the model input (depth 0) itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from torch import Tensor

from probekit.core.engine import RunResult, StepEngine
from probekit.mechanisms.latent_feedback import FeedbackGate, check_gate, prefill
from probekit.mechanisms.recirculation import Recirculation
from probekit.mechanisms.regimes import Regime, plan

#: How each regime kind is written on the command line (for messages).
_SPELLING = {"none": "none", "last-k": "last-<k>", "full": "full", "passes": "passes=<n>"}


class Mechanism(ABC):
    """How to prefill a batch under a regime; the plug-in point of state tracking.

    A subclass sets ``name`` and ``kinds`` (the regime kinds it runs) and implements
    :meth:`run`. The contract :meth:`run` keeps, which capture and causal patching
    (:mod:`probekit.analysis.capture`, :mod:`probekit.analysis.causal`) rely on:

    - the final position's readout pass runs blocks ``0 .. L-1`` in order from its depth-0
      input, firing ``blocks.{b}.hook_resid_pre`` / ``hook_resid_post``, with
      ``engine.state.pass_index`` telling the pass (it is a :meth:`StepEngine.run`);
    - the returned ``RunResult.cache`` holds, at positions ``< T - 1``, exactly the
      keys/values that pass attended to (true of every engine run, since a position's
      keys/values are final once the next position starts);
    - ``RunResult.extras["pass_index"]`` is the readout pass (absent: 0).
    """

    name: ClassVar[str] = "mechanism"
    kinds: ClassVar[tuple[str, ...]] = ("none", "last-k", "full")

    @classmethod
    def check_regime(cls, regime: Regime) -> None:
        """Raise ValueError (saying what is accepted) unless this mechanism runs ``regime``."""
        if not isinstance(regime, Regime):
            raise TypeError(f"regime must be a Regime (Regime.parse('full')); got {regime!r}")
        if regime.kind not in cls.kinds:
            runs = ", ".join(_SPELLING[k] for k in cls.kinds)
            others = sorted(n for n, c in MECHANISMS.items() if regime.kind in c.kinds)
            hint = f" (--mechanism {' or '.join(others)} runs it)" if others else ""
            raise ValueError(f"--recurrence {regime}: the {cls.name} mechanism runs {runs}; "
                             f"not {_SPELLING[regime.kind]}{hint}")

    def check(self, n_blocks: int) -> None:
        """Raise ValueError if this mechanism cannot run on a model of ``n_blocks`` blocks."""
        return None  # any depth will do unless a subclass says otherwise

    def config(self) -> dict[str, Any]:
        """JSON-friendly parameters, recorded in run directories and results."""
        return {"mechanism": self.name}

    def notes(self) -> list[str]:
        """Facts that decide how to read this mechanism's curves (printed and saved)."""
        return []

    def final_input(self, engine: StepEngine, input_ids: Tensor, regime: Regime) -> Tensor | None:
        """The final token's depth-0 input ``[batch, d_model]`` if it is known without the
        run and the readout is the first pass; None (the default) captures through hooks.

        Given it, :func:`probekit.analysis.capture.capture_final` runs the mechanism without
        hooks (the backend's fast path) and then re-runs only the final position's blocks
        from this input on the run's cache, which by the contract is the readout pass."""
        return None

    @abstractmethod
    def run(self, engine: StepEngine, input_ids: Tensor, regime: Regime, *,
            fwd_hooks: Sequence[tuple[str, Callable]] = ()) -> RunResult:
        """Prefill ``input_ids`` ``[batch, T]`` under ``regime``; return the engine's result
        with its cache (``return_cache=True``)."""


#: ``--mechanism`` name -> :class:`Mechanism` subclass; add one with :func:`register`.
MECHANISMS: dict[str, type[Mechanism]] = {}


def register(cls: type[Mechanism]) -> type[Mechanism]:
    """Class decorator: make ``cls`` available as ``--mechanism <cls.name>``."""
    MECHANISMS[cls.name] = cls
    return cls


def mechanism_class(name: str) -> type[Mechanism]:
    """The class registered as ``name``; ValueError naming the choices otherwise."""
    if name not in MECHANISMS:
        raise ValueError(f"mechanism must be one of {sorted(MECHANISMS)}; got {name!r}")
    return MECHANISMS[name]


@register
class RecirculationMechanism(Mechanism):
    """Recirculation (:class:`~probekit.mechanisms.recirculation.Recirculation`) on the
    positions a regime selects.

    Args:
        source, destination: block indices ``0 <= destination < source <= L - 1``.
        alpha, beta: mixing weights (beta None: ``1 - alpha``).
        norm, ramp, iterations: as :class:`~probekit.mechanisms.recirculation.Recirculation`.
    """

    name = "recirculation"

    def __init__(self, source: int, destination: int, alpha: float = 0.1,
                 beta: float | None = None, *, norm: str = "ratio", ramp: int = 0,
                 iterations: int = 1) -> None:
        self.params = {"source": source, "destination": destination, "alpha": alpha,
                       "beta": beta, "norm": norm, "ramp": ramp, "iterations": iterations}
        self.recurrence()  # validate now: Recirculation raises ValueError on bad values

    def __repr__(self) -> str:
        return f"RecirculationMechanism({self.recurrence()!r})"

    def recurrence(self) -> Recirculation:
        """A fresh strategy object for one run."""
        p = self.params
        return Recirculation(p["source"], p["destination"], p["alpha"], p["beta"],
                             norm=p["norm"], ramp=p["ramp"], iterations=p["iterations"])

    def check(self, n_blocks: int) -> None:
        self.recurrence().check(n_blocks)

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

    def final_input(self, engine, input_ids, regime):
        # Recirculation never changes a model input, and it reads out on the first pass.
        return engine.embed(input_ids[:, -1:])[:, 0]

    def run(self, engine, input_ids, regime, *, fwd_hooks=()):
        self.check_regime(regime)
        _, lengths = engine.batch(input_ids)
        p = plan(regime, lengths)
        # capture reads residuals and the cache, never the run's logits: readout=False
        return engine.run(input_ids, None if p.off else self.recurrence(), mask=p.mask,
                          block_size=p.block_size, fwd_hooks=fwd_hooks, return_cache=True,
                          readout=False)


@register
class LatentFeedbackMechanism(Mechanism):
    """Latent feedback (a trained :class:`~probekit.mechanisms.latent_feedback.FeedbackGate`)
    on the positions a regime selects, ``passes=n`` included (readout: the last pass).

    Args:
        gate: the trained gate.
        model: the model the gate belongs to.
        checkpoint: where the gate came from (recorded in results).
        step: the checkpoint's training step (recorded in results).
    """

    name = "latent-feedback"
    kinds = ("none", "last-k", "full", "passes")

    def __init__(self, gate: FeedbackGate, model, *, checkpoint: str | None = None,
                 step: int | None = None) -> None:
        check_gate(gate, model)
        self.gate = gate
        self.model = model
        self.checkpoint = checkpoint
        self.step = step

    def __repr__(self) -> str:
        return f"LatentFeedbackMechanism(checkpoint={self.checkpoint!r}, step={self.step})"

    def check(self, n_blocks: int) -> None:
        if n_blocks != self.model.n_blocks:
            raise ValueError(
                f"the feedback gate belongs to a {self.model.n_blocks}-block model; this one "
                f"has {n_blocks} blocks"
            )

    def config(self) -> dict[str, Any]:
        return {"mechanism": self.name, "checkpoint": self.checkpoint, "step": self.step,
                "d_model": self.gate.d_model}

    def notes(self) -> list[str]:
        return [
            "latent feedback changes the model input (depth 0) itself: under none, depth 0 "
            "is the final token's embedding (identical for every example, so chance); under "
            "last-k / full it is the gate's fusion of the previous top state",
            f"h is read {'after' if self.gate.feed == 'normed' else 'before'} the final "
            "norm; the readout of passes=n is the last pass",
        ]

    def run(self, engine, input_ids, regime, *, fwd_hooks=()):
        self.check_regime(regime)
        return prefill(engine, input_ids, self.gate, regime, fwd_hooks=fwd_hooks,
                       return_cache=True, readout=False)
