"""Type checks of config dataclasses: a value of the wrong type is refused like a bad value.

From the command line tyro hands a config only values of the annotated types; from Python
anything can arrive (``windows=True``, ``ramp=2.5``, ``norm="x"``). :func:`check_fields`,
called first in every config's ``__post_init__``, refuses those with a ``ValueError`` naming
the flag, so no ``True`` becomes 1, no float is truncated and no comparison raises a
``TypeError`` later.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal


def flag(name: str) -> str:
    """The command-line flag of field ``name``."""
    return "--" + name.replace("_", "-")


def check_fields(config: Any, *, names: dict[str, str] | None = None) -> None:
    """Raise ValueError if a field of dataclass ``config`` does not hold a value of its
    annotated type. ``names`` maps a field to its flag where they differ
    (``{"n_examples": "--examples"}``)."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        want = _describe(value, hints[f.name])
        if want is not None:
            shown = (names or {}).get(f.name, flag(f.name))
            raise ValueError(f"{shown} must be {want}; got {value!r}")


def _describe(value: Any, annotation: Any) -> str | None:
    """None if ``value`` fits ``annotation``, else what would (for the message)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        wants = [_describe(value, a) for a in options]
        if any(w is None for w in wants):
            return None
        return " or ".join(w for w in wants if w) + (" (or left out)" if len(options) <
                                                       len(args) else "")
    if origin is typing.Annotated or hasattr(annotation, "__metadata__"):
        return _describe(value, args[0])
    if origin is Literal:
        return None if value in args and type(value) in {type(a) for a in args} \
            else "one of " + ", ".join(map(str, args))
    if origin in (tuple, list):
        if not isinstance(value, (tuple, list)):
            return "a list of values"
        inner = args[0] if args else Any
        bad = [_describe(v, inner) for v in value]
        return next((f"a list of {w.removeprefix('a ').removeprefix('an ')}"
                     for w in bad if w), None)
    if annotation is bool:
        return None if isinstance(value, bool) else "true or false"
    if annotation is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if annotation is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok and not math.isnan(value) else "a number"
    if annotation is str:
        return None if isinstance(value, str) else "a string"
    if annotation is Path:
        return None if isinstance(value, (str, Path)) else "a path"
    if dataclasses.is_dataclass(annotation):
        return None if isinstance(value, annotation) else f"a {annotation.__name__}"
    return None  # anything else (Any, a class of its own) is the field's own business
