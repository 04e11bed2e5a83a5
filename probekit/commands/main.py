"""The ``probekit`` command: picks a command module and runs it.

Each command lives in its own module of :mod:`probekit.commands` with a ``Config``
dataclass (tyro makes its flags) and ``run(config)``. Modules are imported only when
their command is asked for, so ``probekit --help`` answers without loading torch.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import warnings

#: command words -> module in probekit.commands
COMMANDS = {
    ("perplexity",): "perplexity",
    ("lag-analysis",): "lag_analysis",
    ("sweep",): "sweep",
    ("pos-attribution",): "pos_attribution",
    ("run", "state-tracking"): "state_tracking",
    ("train-feedback",): "train_feedback",
    ("feedback-stability",): "feedback_stability",
    ("setup",): "setup",
}
SUMMARY = {
    "perplexity": "baseline vs recirculated perplexity on a corpus",
    "lag-analysis": "benefit of recirculating one token at each later lag (Fig. 9)",
    "sweep": "perplexity change over (source, destination) pairs, alphas, norms; looping",
    "pos-attribution": "perplexity change by part of speech; selective recirculation",
    "run state-tracking": "probe and patch task state per depth under prefill regimes (Fig. 7)",
    "train-feedback": "train a latent-feedback gate or a from-scratch organism",
    "feedback-stability": "stability of the learned feedback over many passes (Fig. 3)",
    "setup": "prepare offline assets (the part-of-speech tagger)",
}


def usage() -> str:
    width = max(len(c) for c in SUMMARY)
    rows = "\n".join(f"  {c:<{width}}  {s}" for c, s in SUMMARY.items())
    return ("usage: probekit COMMAND [--help] [OPTIONS]\n\n"
            "Mechanistic interpretability of vertical recurrence in transformers.\n\n"
            f"commands:\n{rows}\n\nGuides: docs/ (one page per command).")


def find_command(argv: list[str]) -> tuple[str, str, list[str]]:
    """``(command words, module name, remaining argv)``; UsageError if none matches."""
    from probekit.commands.common import UsageError

    for words, module in COMMANDS.items():
        if tuple(argv[: len(words)]) == words:
            return " ".join(words), module, argv[len(words):]
    got = " ".join(argv[:2]) or "nothing"
    raise UsageError(f"unknown command {got!r}; choose one of: {', '.join(SUMMARY)}")


@contextlib.contextmanager
def one_line_warnings():
    """Show warnings (a damaged part being recomputed, a run waiting for a lock) as one
    clean line each, without file names and source lines."""
    saved = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        print(f"probekit: warning: {message}", file=sys.stderr)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = saved


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("MPLBACKEND", "Agg")  # figures go to files; no display needed
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv == ["run"] or argv[:2] in (["run", "-h"], ["run", "--help"]):
        print("usage: probekit run EXPERIMENT [OPTIONS]\n\nexperiments:\n  state-tracking")
        return 0 if len(argv) > 1 else 2
    name = argv[0]
    try:
        from probekit.commands.common import parse

        with one_line_warnings():
            name, module_name, rest = find_command(argv)
            module = importlib.import_module(f"probekit.commands.{module_name}")
            config = parse(module.Config, rest, prog=f"probekit {name}")
            return module.run(config) or 0
    except KeyboardInterrupt:
        print(f"\nprobekit {name}: interrupted; rerun the same command to resume",
              file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, LookupError) as e:
        # Bad input: one clear line, no traceback (PROBEKIT_DEBUG=1 shows it).
        if os.environ.get("PROBEKIT_DEBUG"):
            raise
        print(f"probekit {name}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
