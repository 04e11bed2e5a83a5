"""The ``probekit`` command. Each feature module registers its own sub-command.

A module in ``COMMANDS`` defines ``add_cli(subparsers)``, which adds a parser and sets
``func`` (called with the parsed namespace) as its default.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMANDS = (
    "probekit.analysis.perplexity",
    "probekit.analysis.pos_attribution",
    "probekit.analysis.lag",
    "probekit.analysis.sweep",
    "probekit.commands.run",
    "probekit.training.feedback",
    "probekit.analysis.stability",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="probekit",
        description="Mechanistic interpretability of vertical recurrence in transformers.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).add_cli(sub)
    return parser


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="smollm2-135m (default, offline), tiny, a local HF folder, a .gguf "
                        "file, or a hub name when a hub is reachable")
    p.add_argument("--backend", default="lens", choices=["lens"], help="execution backend")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice)")


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", default=None,
                   help="run folder (default runs/<command>-<config hash>; an existing one "
                        "with the same config is resumed)")
    p.add_argument("--fresh", action="store_true", help="ignore finished parts of an earlier run")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    try:
        return args.func(args) or 0
    except (ValueError, FileNotFoundError, LookupError) as e:
        # Bad input: one clear line, no traceback (PROBEKIT_DEBUG=1 shows it).
        if os.environ.get("PROBEKIT_DEBUG"):
            raise
        print(f"probekit {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
