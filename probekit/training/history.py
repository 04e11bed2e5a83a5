"""When a training first solved each task, read from its history (``history.json``).

The organism's seeds differ widely in when they leave the plateau at chance on
completion, and on some recipes that step goes with how they do in Fig. 7a
(docs/latent-feedback.md, "The model organism"), so Fig. 7a's JSON reports it per seed
beside the probes.
"""

from __future__ import annotations

from typing import Any

#: Validation task accuracy that counts as solved (chance is 0.5).
SOLVED = 0.9


def solved_at(history: list[dict[str, Any]],
              threshold: float = SOLVED) -> dict[str, list[int | None]]:
    """For each validated task, by pass count (1 = no feedback, 2, 3, ...), the first
    step whose validation accuracy reached ``threshold``, or None if none did.

    Validation runs every ``eval_every`` steps (250 for organisms) and at the last step,
    so a step here is at most that late.
    """
    out: dict[str, list[int | None]] = {}
    for entry in history:
        for task, by_pass in entry.get("val_task_accuracy", {}).items():
            first = out.setdefault(task, [None] * len(by_pass))
            for i, acc in enumerate(by_pass):
                if first[i] is None and acc >= threshold:
                    first[i] = entry["step"]
    return out
