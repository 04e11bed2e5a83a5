"""What every command shares: flag groups, one-line errors, and running a command.

A command is a module with a frozen ``Config`` dataclass and ``run(config) -> int``.
tyro generates the command's parser from ``Config``: each field is one flag (its
docstring the help, its type the parsing, ``__post_init__`` the validation), and the
same dataclass is the run identity (:func:`probekit.runs.identity`; fields made with
:func:`probekit.runs.not_identity` stay out of it). The flag groups below are nested
into a command's ``Config`` without a prefix (``--model``, not ``--model-flags.model``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal

import tyro

from probekit.runs import not_identity
from probekit.validation import check_fields

#: Nest a flag group without a prefix: ``flags: Flat[ModelFlags] = ModelFlags()``.
FLAT = tyro.conf.arg(name="")


class UsageError(ValueError):
    """Bad command-line input: printed as one line, exit status 2."""


@dataclasses.dataclass(frozen=True)
class ModelFlags:
    """Which model, how it runs."""

    model: str = "smollm2-135m"
    """smollm2-135m (default) or gemma3-270m (offline), tiny / tiny-<n> / tiny-<family>, a
    local Hugging Face folder or .gguf file, or a hub name when a hub is reachable"""
    backend: Literal["lens", "nnsight"] = "lens"
    """execution backend"""
    threads: int | None = not_identity(None)
    """torch CPU threads (default: torch's choice)"""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.threads is not None and self.threads < 1:
            raise UsageError(f"--threads must be >= 1; got {self.threads}")


@dataclasses.dataclass(frozen=True)
class RunFlags:
    """Where results go, and whether to show progress."""

    run_dir: Path | None = not_identity(None)
    """run folder (default runs/<command>-<identity hash>; rerunning the same command
    resumes it)"""
    fresh: bool = not_identity(False)
    """forget finished parts of an earlier run with the same identity"""
    progress: bool = not_identity(True)
    """show progress bars (--no-progress hides them)"""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.run_dir is None:
            return
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise UsageError(f"--run-dir {self.run_dir} is a file; give a folder")
        # the folder is made later, with its parents: none of them may be a file
        above = next((p for p in self.run_dir.parents if p.exists()), None)
        if above is not None and not above.is_dir():
            raise UsageError(f"--run-dir {self.run_dir}: {above} is a file; give a folder")


@dataclasses.dataclass(frozen=True)
class RecirculationFlags:
    """One recirculation path and its options (SEMANTICS.md "Recirculation")."""

    source: int | None = None
    """source block s (default: round(2L/3) of the model's L blocks; docs/architecture.md)"""
    destination: int | None = None
    """destination block d, 0 <= d < s (default: round(L/3))"""
    alpha: float = 0.1
    """mix weight in [0, 1]"""
    beta: float | None = None
    """destination weight in [0, 1] (default 1 - alpha, the convex mix)"""
    norm: Literal["ratio", "none"] = "ratio"
    """rescale the source to the destination's norm (ratio) or not (none)"""
    ramp: int = 0
    """alpha_t = min(t / ramp, 1) * alpha (0: no ramp)"""
    iterations: int = 1
    """recurrent passes per position (1 is the paper's method)"""

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("source", "destination"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise UsageError(f"--{name} must be a block index >= 0; got {v}")
        if self.source is not None and self.destination is not None \
                and self.source <= self.destination:
            raise UsageError(f"--source ({self.source}) must be a deeper block than "
                             f"--destination ({self.destination})")
        if not 0.0 <= self.alpha <= 1.0:
            raise UsageError(f"--alpha must lie in [0, 1]; got {self.alpha}")
        if self.beta is not None and not 0.0 <= self.beta <= 1.0:
            raise UsageError(f"--beta must lie in [0, 1] (or be left out for 1 - alpha); "
                             f"got {self.beta}")
        if self.ramp < 0:
            raise UsageError(f"--ramp must be >= 0 (0 = no ramp); got {self.ramp}")
        if self.iterations < 1:
            raise UsageError(f"--iterations must be >= 1; got {self.iterations}")

    def pair(self, n_blocks: int) -> tuple[int, int]:
        """``(source, destination)``: the flags, or the model-relative rule
        (:func:`probekit.mechanisms.recirculation.default_pair`) for those not given."""
        from probekit.mechanisms.recirculation import default_pair

        s, d = self.source, self.destination
        for name, v in (("source", s), ("destination", d)):  # the flags given come first
            if v is not None and v > n_blocks - 1:
                raise UsageError(f"--{name} {v} is out of range: this model has {n_blocks} "
                                 f"blocks, numbered 0..{n_blocks - 1}")
        if d is not None and s is None and d + 1 > n_blocks - 1:
            raise UsageError(f"--destination {d} leaves no deeper block for the source on this "
                             f"{n_blocks}-block model; give a smaller --destination")
        ds, dd = default_pair(n_blocks)
        if s is None and d is None:
            return ds, dd
        if s is None:
            return max(d + 1, ds), d
        return s, min(dd, s - 1) if d is None else d

    def build(self, n_blocks: int):
        """The :class:`probekit.Recirculation` these flags describe on an ``n_blocks`` model."""
        from probekit.mechanisms.recirculation import Recirculation

        s, d = self.pair(n_blocks)
        return Recirculation(s, d, self.alpha, self.beta, norm=self.norm, ramp=self.ramp,
                             iterations=self.iterations)


@dataclasses.dataclass(frozen=True)
class CorpusFlags:
    """Which text, cut into how many windows of how many tokens."""

    corpus: Literal["wiki"] = "wiki"
    """built-in corpus: the Wikipedia sample shipped in gensim"""
    text_file: Path | None = None
    """a UTF-8 text file to use instead of --corpus"""
    windows: int = 8
    """number of windows"""
    window_tokens: int = 256
    """tokens per window"""
    batch_size: int = 8
    """windows per batch"""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.text_file is not None:
            if not self.text_file.exists():
                raise UsageError(f"--text-file {self.text_file} does not exist")
            if not self.text_file.is_file():
                raise UsageError(f"--text-file {self.text_file} is a folder; give a text file")
        for name in ("windows", "window_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1; "
                                 f"got {getattr(self, name)}")

    def load(self, model, *, bos: bool | None = None):
        """The windows (:func:`probekit.data.corpora.make_windows`) in ``model``'s tokens.
        ``bos`` (default): start each window as the model's tokenizer starts a text, with
        its BOS token (Gemma, which degrades badly without one) or without (SmolLM2, tiny)."""
        from probekit.data.corpora import load_corpus, make_windows

        if bos is None:
            tok = model.tokenizer
            bos = tok.bos_token_id is not None and tok("a").input_ids[:1] == [tok.bos_token_id]
        docs = load_corpus(self.corpus, text_file=self.text_file)
        return make_windows(docs, model.tokenizer, self.window_tokens, self.windows, bos=bos,
                            max_tokens=model.n_ctx)


def _one_line(event) -> str:
    """A tyro parse failure as one line naming the flag."""
    arg = getattr(event, "argument", None)
    name = getattr(getattr(arg, "lowered", None), "name_or_flags", None)
    flag = name[0] if name else None
    kind = type(event).__name__
    if kind == "InstantiationFailure":
        msg = str(event.message).strip().splitlines()[0]
        return f"{flag}: {msg}" if flag and flag not in msg else msg
    if kind == "InvalidChoice":
        return f"{flag}: {event.value!r} is not one of {', '.join(event.choices)}"
    if kind == "UnrecognizedArgs":
        return f"unrecognized arguments: {' '.join(event.tokens)} (see --help)"
    if kind == "MissingArgs":
        names = [a.arg.lowered.name_or_flags[0] for a in event.missing_arguments]
        return f"missing {', '.join(names)}"
    if kind == "BadValue":
        return f"{flag}: {'expects no value' if event.reason == 'fixed' else 'too few values'}"
    return f"{kind} (see --help)"


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """Turn tyro's boxed parse errors into :class:`UsageError` (one line, exit 2)."""
    from tyro import _errors  # tyro's documented (if young) parse-error hook

    def hook(event):
        raise UsageError(_one_line(event))

    with _errors.on_parse_error(hook):
        yield


def parse(config_type: type, argv: list[str], prog: str, description: str | None = None):
    """``config_type`` built from ``argv`` by tyro; :class:`UsageError` on bad input."""
    with one_line_errors():
        return tyro.cli(config_type, args=argv, prog=prog, description=description)


def set_threads(flags: ModelFlags) -> None:
    if flags.threads:
        import torch

        torch.set_num_threads(flags.threads)


def script_error(prog: str, message: str) -> int:
    """Print an experiment script's one-line error (``prog: error: message``) to stderr;
    the exit status to return (2, as for a bad command flag)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def regimes_problem(words) -> str | None:
    """An experiment script's one-line problem with its ``--regimes`` words (each must be a
    regime the engine runs), or None."""
    from probekit.mechanisms.regimes import Regime

    if not words:
        return "--regimes needs at least one regime (none, last-<k>, full or passes=<n>)"
    for word in words:
        try:
            Regime.parse(word)
        except ValueError as e:
            return f"--regimes: {e}"
    return None


def organisms_problem(checkpoints) -> str | None:
    """An experiment script's one-line problem with its organism checkpoint folders (at
    least one, each holding a ``config.json``), or None."""
    if not checkpoints:
        return "give at least one organism checkpoint folder"
    for ck in checkpoints:
        if not (Path(ck) / "config.json").is_file():
            return (f"{ck} is not an organism checkpoint (no config.json); give a folder "
                    f"that organism_checkpoint.py printed")
    return None


def say(*lines: str) -> None:
    """Print to stdout (commands print; the library never does)."""
    print(*lines, sep="\n", file=sys.stdout, flush=True)


__all__ = ["FLAT", "Annotated", "CorpusFlags", "ModelFlags", "RecirculationFlags", "RunFlags",
           "UsageError", "parse", "say", "script_error", "set_threads"]
