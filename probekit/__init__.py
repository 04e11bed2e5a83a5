"""probekit: mechanistic interpretability of vertical recurrence in transformers.

Quick start::

    import probekit
    model = probekit.load_model()                      # SmolLM2-135M, offline
    engine = probekit.StepEngine(model)                # TransformerLens backend
    rec = probekit.Recirculation(source=20, destination=10, alpha=0.1)
    result = engine.run(token_ids, rec)                # log-probs of every position
"""

from probekit.core.engine import Recurrence, RunResult, Step, StepEngine
from probekit.core.kv_cache import KVCache
from probekit.core.models import DEFAULT_MODEL, LoadedModel, ModelNotFoundError, load_model
from probekit.mechanisms.recirculation import Recirculation, RecirculationPath

__all__ = [
    "DEFAULT_MODEL",
    "KVCache",
    "LoadedModel",
    "ModelNotFoundError",
    "Recirculation",
    "RecirculationPath",
    "Recurrence",
    "RunResult",
    "Step",
    "StepEngine",
    "load_model",
]

__version__ = "0.1.0"
