"""``probekit run EXPERIMENT``: the experiments, one sub-command each.

Each module in ``EXPERIMENTS`` defines ``add_experiment_cli(subparsers)``, which adds its
parser (e.g. ``state-tracking``) to the sub-parsers of ``run`` and sets ``func``, as
:mod:`probekit.commands.main` does for top-level commands::

    probekit run state-tracking --recurrence full
"""

from __future__ import annotations

import importlib

EXPERIMENTS = (
    "probekit.analysis.state_tracking",
)


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("run", help="run an experiment (state-tracking, ...)",
                              description=__doc__)
    sub = p.add_subparsers(dest="experiment", required=True, metavar="EXPERIMENT")
    for name in EXPERIMENTS:
        importlib.import_module(name).add_experiment_cli(sub)
