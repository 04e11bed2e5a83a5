"""Backends: how the step engine executes a model (see :mod:`.base` for the interface).

Each concrete backend registers itself in :data:`BACKENDS` under its ``--backend`` name;
neither the engine nor the base class imports a concrete backend. A new backend is a new
module here plus one line below.
"""

from __future__ import annotations

from collections.abc import Callable

from probekit.core.backends.base import Backend, Edit

#: ``--backend`` name -> factory ``f(loaded_model) -> Backend``.
BACKENDS: dict[str, Callable[..., Backend]] = {}


def register_backend(name: str, factory: Callable[..., Backend]) -> None:
    """Make ``factory`` available as ``StepEngine(model, backend=name)`` / ``--backend name``."""
    BACKENDS[name] = factory


def make_backend(model, name: str = "lens") -> Backend:
    """Build the backend ``name`` around a :class:`probekit.LoadedModel`."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {sorted(BACKENDS)}")
    return BACKENDS[name](model)


def _lens(model) -> Backend:
    from probekit.core.backends.lens import LensBackend  # imports TransformerLens: lazily

    return LensBackend(model)


def _nnsight(model) -> Backend:
    from probekit.core.backends.nnsight import NNsightBackend  # imports nnsight: lazily

    return NNsightBackend(model)


register_backend("lens", _lens)
register_backend("nnsight", _nnsight)

__all__ = ["BACKENDS", "Backend", "Edit", "make_backend", "register_backend"]
