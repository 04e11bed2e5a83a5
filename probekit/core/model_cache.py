"""Verified cache folders for models and tokenizers: written atomically, checked on every
load, rebuilt when broken.

A cache folder holds what ``save_pretrained`` wrote plus ``probekit-cache.json``: the
size and sha256 of every file, and for models the content hash of the weights. Loading
checks that record before reading anything (a missing, truncated or rewritten file is
caught by size and hash); a folder that fails, or has no record (written by an older
probekit or by an interrupted copy), is rebuilt from its source and atomically replaces
the broken one, with a one-line warning saying why.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

RECORD = "probekit-cache.json"


class Mismatch(ValueError):
    """Raised by a ``load`` function whose loaded object contradicts the folder's record
    (e.g. weights that hash to another content hash): the folder is rebuilt."""


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def write(folder: Path, objects: tuple, extra: dict[str, Any] | None = None) -> None:
    """``save_pretrained`` each object into ``folder``, with a record of every file's
    size and sha256 (and ``extra``), atomically: built in a hidden temporary sibling and
    renamed into place; a broken folder already there is moved aside first."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{folder.name}-", dir=folder.parent))
    try:
        for obj in objects:
            obj.save_pretrained(tmp)
        files = {p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
                 for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / RECORD).write_text(json.dumps({"files": files, **(extra or {})}, indent=1))
        if folder.exists():  # broken (the caller checked): move it aside, then replace
            aside = Path(tempfile.mkdtemp(prefix=f".broken-{folder.name}-", dir=folder.parent))
            os.rename(folder, aside / folder.name)
            shutil.rmtree(aside, ignore_errors=True)
        try:
            os.rename(tmp, folder)
        except OSError:
            if problem(folder) is not None:  # not a concurrent load that won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def seal(folder: Path, extra: dict[str, Any] | None = None) -> None:
    """Record the size and sha256 of every file under ``folder`` (recursively; hidden
    files left out) and ``extra``, for a folder built in place (e.g. a trained
    checkpoint) rather than by :func:`write`; :func:`problem` checks it."""
    files = {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size,
                                                "sha256": file_sha256(p)}
             for p in sorted(folder.rglob("*"))
             if p.is_file() and p.name != RECORD
             and not any(part.startswith(".") for part in p.relative_to(folder).parts)}
    tmp = folder / f".{RECORD}.tmp"
    tmp.write_text(json.dumps({"files": files, **(extra or {})}, indent=1))
    os.replace(tmp, folder / RECORD)


def record(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / RECORD).read_text())
    except (OSError, ValueError):
        return None


def problem(folder: Path, *, hashes: bool = True) -> str | None:
    """None if ``folder`` matches its record, else what is wrong (one phrase)."""
    if not folder.is_dir():
        return "missing"
    rec = record(folder)
    if rec is None or not isinstance(rec.get("files"), dict):
        return f"no valid {RECORD}"
    for name, want in rec["files"].items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != want["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, {want['bytes']} were written"
        if hashes and file_sha256(path) != want["sha256"]:
            return f"{name} does not match its recorded sha256"
    return None


def load_or_build(folder: Path, *, load: Callable[[Path], Any], build: Callable[[], Any],
                  save: Callable[[Any], tuple], extra: Callable[[Any], dict] | None = None,
                  what: str = "cache", hashes: bool = True, reload: bool = False):
    """The object cached in ``folder``: ``load(folder)`` if the folder is sound, else
    ``build()``, saved with ``write(folder, save(obj), extra(obj))`` and returned.

    ``hashes=False`` checks sizes only before loading (for large weight files whose
    content hash ``extra`` records and the caller compares after loading). ``reload``
    returns ``load(folder)`` after a build, so a first load and later ones give the same
    objects (e.g. a tokenizer read back from disk)."""
    reason = problem(folder, hashes=hashes)
    if reason is None:
        try:
            return load(folder)
        except Mismatch as e:
            reason = str(e)
        except Exception as e:  # a file that passed the size check but does not parse
            reason = f"unreadable ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    if reason != "missing":
        warnings.warn(f"the {what} {folder} is broken ({reason}); rebuilding it", stacklevel=3)
    obj = build()
    try:
        write(folder, save(obj), extra(obj) if extra else None)
    except OSError as e:  # a read-only or full disk costs speed next time, not this load
        warnings.warn(f"could not write the {what} {folder}: {e}", stacklevel=3)
        return obj
    return load(folder) if reload else obj
