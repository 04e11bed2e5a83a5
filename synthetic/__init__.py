"""Synthetic state-tracking tasks of the latent-feedback paper (App. F, Sec. 4.4).

Every input ends at a shared colon whose next token would be the label word; a probe
at that colon measures how much of the task state each residual depth holds
(``probekit.analysis.probing``). Usage::

    from synthetic import make_task
    data = make_task("completion", tokenizer)          # Dataset
    sweep = make_task("register-sweep", tokenizer)     # {m: Dataset}
    data.texts, data.labels, data.groups, data.pairs

Modules: ``dataset`` (data model, validator, token-exact padding), ``completion``,
``memory``, ``registers`` (and its sweeps), ``tasks`` (the registry).
"""

from synthetic.completion import completion_dataset
from synthetic.dataset import (
    DISTRACTOR_COUNTS,
    Dataset,
    Example,
    label_token_ids,
    n_tokens,
    pad_to_length,
    validate,
)
from synthetic.memory import memory_dataset
from synthetic.registers import overwrite_sweep, register_sweep, registers_dataset
from synthetic.tasks import TASKS, make_task

__all__ = [
    "DISTRACTOR_COUNTS",
    "TASKS",
    "Dataset",
    "Example",
    "completion_dataset",
    "label_token_ids",
    "make_task",
    "memory_dataset",
    "n_tokens",
    "overwrite_sweep",
    "pad_to_length",
    "register_sweep",
    "registers_dataset",
    "validate",
]
