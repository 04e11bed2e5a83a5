"""Run directories: config, versions, model identity, finished parts, results.

Every long command writes one folder::

    runs/<command>-<config hash>/
        config.json      the full configuration (what the hash is computed from)
        manifest.json    package versions, machine (arch, torch CPU kernels), model
                         name/hash/source, argv, start time
        parts/<key>.npz  one file per finished unit of work (a window batch, a pair...)
        summary.json     the results, written last
        *.png            plots

The folder name is a hash of the run's **identity**: the command's config dataclass
(every field but those marked ``identity=False``, such as ``--threads`` or
``--run-dir``), the model's content hash, and a content hash of every input file the
run reads (``inputs=``: text files, checkpoints). Re-running an interrupted command
with the same arguments and inputs finds its folder; :meth:`RunDir.map`, the one
resumable loop, skips the units already on disk. Each part is written atomically
(temp file + rename) and records its unit key, so a kill never leaves half a part and a
part is never used for another unit: one that fails to load or holds another key is
recomputed, with a one-line warning.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from tqdm.auto import tqdm

from probekit.paths import RUNS_ROOT

U = TypeVar("U")

# Run folders this process has locked (path -> open lock file), held until it exits.
_HELD: dict[str, Any] = {}


@atexit.register
def _release() -> None:
    for f in _HELD.values():
        f.close()

PACKAGES = ("probekit-recurrence", "torch", "transformers", "transformer-lens", "nnsight",
            "numpy", "scikit-learn", "nltk", "gensim")


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for p in PACKAGES:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            out[p] = "not installed"
    return out


def machine() -> dict[str, str]:
    """What decides a float result beyond the inputs and ``versions()``: the processor
    architecture and the CPU kernels torch dispatches to (AVX2, AVX512, ...), whose
    summation orders differ in the last bits (docs/latent-feedback.md, "Cached, verified,
    deterministic")."""
    import torch  # here, not at the top: the run folder machinery needs no torch

    return {"arch": platform.machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def config_hash(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:10]


def not_identity(default: Any = dataclasses.MISSING, **kw) -> Any:
    """A dataclass field that does not change results (``--threads``, ``--run-dir``...):
    left out of the run identity (:func:`identity`)."""
    if default is not dataclasses.MISSING:
        kw["default"] = default
    return dataclasses.field(metadata={"identity": False}, **kw)


def added_later(default: Any, **kw) -> Any:
    """A dataclass field added after results were keyed by :func:`identity`: it enters the
    identity only when it differs from ``default``, so every earlier run, cached organism
    and recipe keeps its key."""
    return dataclasses.field(default=default, metadata={"identity": "unless-default"}, **kw)


def _in_identity(config: Any, f: dataclasses.Field) -> bool:
    rule = f.metadata.get("identity", True)
    if rule == "unless-default":
        return getattr(config, f.name) != f.default
    return rule


def identity(config: Any) -> Any:
    """The JSON-friendly identity of a config: dataclasses become dicts of their fields,
    recursively, without fields marked :func:`not_identity` (nor fields marked
    :func:`added_later` that hold their default)."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: identity(getattr(config, f.name)) for f in dataclasses.fields(config)
                if _in_identity(config, f)}
    if isinstance(config, Mapping):
        return {str(k): identity(v) for k, v in config.items()}
    if isinstance(config, (list, tuple)):
        return [identity(v) for v in config]
    if isinstance(config, Path):
        return str(config)
    return config


def file_hash(path: str | Path) -> str:
    """sha256 of a file's bytes, or of every file under a folder (relative names included),
    first 16 hex characters: how an input enters the run identity."""
    path = Path(path)
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        if path.is_dir():
            h.update(str(f.relative_to(path)).encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def _atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; results are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_text(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically: a kill never leaves half a file."""
    _atomic_write(Path(path), lambda f: f.write(text.encode("utf-8")))


def write_json(path: Path, obj: Any) -> None:
    _atomic_write(Path(path), lambda f: f.write(
        json.dumps(obj, indent=2, sort_keys=True, default=_jsonable).encode()))


def _jsonable(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o)}")


def _check_identity(cfg_file: Path, ident: dict) -> bool:
    """Whether ``cfg_file`` exists; ValueError if it is not JSON or holds another identity."""
    if not cfg_file.exists():
        return False
    try:
        old = json.loads(cfg_file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_file} is not valid JSON ({e}); delete the run folder "
                         f"or choose another --run-dir") from None
    if json.loads(json.dumps(ident, default=str)) != old:
        raise ValueError(f"{cfg_file.parent} holds a run with a different config or inputs; "
                         f"choose another --run-dir or delete it")
    return True


def lock_folder(path: Path) -> Any:
    """Hold an exclusive lock on the folder ``path`` for this process's life (the open
    lock file is returned). A second process asking for it waits here, with one warning
    line, then finds the first's results and reuses them."""
    import fcntl

    key = str(Path(path).resolve())
    if key in _HELD:  # this process holds it already (the folder opened twice)
        return _HELD[key]
    f = open(Path(path) / ".lock", "a+")  # noqa: SIM115 - held until the process exits
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        warnings.warn(f"another process (pid {holder}) is running in {path}; "
                      f"waiting for it to finish, then reusing its results", stacklevel=3)
        fcntl.flock(f, fcntl.LOCK_EX)
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    _HELD[key] = f
    return f


@contextlib.contextmanager
def holding(path: Path) -> Iterator[None]:
    """:func:`lock_folder` for the ``with`` block only: released at its end (unless this
    process already held the folder before it)."""
    import fcntl

    key = str(Path(path).resolve())
    held_before = key in _HELD
    f = lock_folder(path)
    try:
        yield
    finally:
        if not held_before:
            fcntl.flock(f, fcntl.LOCK_UN)
            f.close()
            _HELD.pop(key, None)


class RunDir:
    """A run folder; use :meth:`open` to create or resume one."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock_file = None

    def _lock(self) -> None:
        self._lock_file = lock_folder(self.path)

    @classmethod
    def open(cls, command: str, config: Any, *, model=None,
             inputs: Mapping[str, str | Path | None] | None = None,
             root: str | Path = RUNS_ROOT, path: str | Path | None = None,
             fresh: bool = False) -> RunDir:
        """Create ``root/<command>-<hash(identity)>`` or resume it if it holds this identity.

        Args:
            config: the command's config (a dataclass, or a plain dict).
            model: the :class:`probekit.LoadedModel`; its content hash enters the identity.
            inputs: files or folders the run reads, by name (None entries are skipped);
                their content hashes enter the identity, so editing one starts a new run.
            fresh: forget finished parts of an earlier run with this identity.
        """
        ident = {"config": identity(config)}
        if model is not None:
            ident["model_hash"] = model.content_hash
        if inputs:
            ident["inputs"] = {k: file_hash(v) for k, v in inputs.items() if v is not None}
        path = Path(path) if path else Path(root) / f"{command}-{config_hash(ident)}"
        if path.exists() and not path.is_dir():
            raise ValueError(f"--run-dir {path} is a file; give a folder")
        cfg_file = path / "config.json"
        _check_identity(cfg_file, ident)  # bad input: refused before anything is written
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot create the run folder {path} ({e.strerror}); choose "
                             f"another --run-dir") from None
        run = cls(path)
        run._lock()
        if _check_identity(cfg_file, ident):  # again: a run may have begun while we waited
            if fresh:
                for p in (path / "parts").glob("*"):
                    p.unlink()
        write_json(cfg_file, ident)
        manifest = {
            "command": command,
            "argv": sys.argv,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "versions": versions(),
            "machine": machine(),
        }
        if model is not None:
            manifest["model"] = {"name": model.name, "content_hash": model.content_hash,
                                 "source": model.source, "n_blocks": model.n_blocks,
                                 "d_model": model.d_model}
        write_json(path / "manifest.json", manifest)
        return run

    def map(self, units: Iterable[tuple[str, U]], compute: Callable[[U], Mapping[str, Any]],
            *, desc: str = "", progress: bool = True) -> dict[str, dict[str, np.ndarray]]:
        """The one resumable loop: ``{key: part}`` for every ``(key, unit)``, in order.

        A unit whose part is on disk (written by an earlier, possibly interrupted run) is
        loaded; any other is computed with ``compute(unit)`` (a mapping of arrays) and
        saved before the next starts, so a kill loses at most the unit in progress."""
        units = list(units)
        keys = [k for k, _ in units]
        if len(set(keys)) != len(keys):
            raise ValueError(f"unit keys must be unique; got {keys}")
        out: dict[str, dict[str, np.ndarray]] = {}
        bar = tqdm(units, desc=desc or self.path.name, unit="part", disable=not progress)
        for key, unit in bar:
            part = self._load_checked(key)
            if part is None:
                part = {k: np.asarray(v) for k, v in compute(unit).items()}
                self.save_part(key, **part)
            out[key] = part
        return out

    def _load_checked(self, key: str) -> dict[str, np.ndarray] | None:
        """The part of ``key`` if it is on disk, loads, and belongs to ``key``; else None
        (a damaged or foreign part is reported and recomputed)."""
        if not self.has_part(key):
            return None
        try:
            part = self.load_part(key, keep_unit=True)
        except Exception as e:  # a truncated or garbled file: any loader error
            warnings.warn(f"{self.part_path(key)} is damaged ({type(e).__name__}); "
                          f"recomputing it", stacklevel=3)
            return None
        if str(part.pop("__unit__", key)) != key:
            warnings.warn(f"{self.part_path(key)} belongs to another unit; recomputing it",
                          stacklevel=3)
            return None
        if self._recorded().get(key) != file_hash(self.part_path(key)):
            warnings.warn(f"{self.part_path(key)} does not match the checksum this run "
                          f"recorded for it; recomputing it", stacklevel=3)
            return None
        return part

    def _recorded(self) -> dict[str, str]:
        """``{key: sha}`` of the parts this run wrote (``parts/index.jsonl``, last wins)."""
        index = self.path / "parts" / "index.jsonl"
        out = {}
        if index.exists():
            for line in index.read_text().splitlines():
                try:
                    row = json.loads(line)
                    out[row["key"]] = row["sha256"]
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut by a kill: its part is simply recomputed
        return out

    def part_path(self, key: str) -> Path:
        return self.path / "parts" / f"{key}.npz"

    def has_part(self, key: str) -> bool:
        return self.part_path(key).exists()

    def save_part(self, key: str, **arrays: Any) -> None:
        """Write a part atomically, then record its key and checksum in the run's index
        (a part without a matching record is never reused)."""
        arrays = {"__unit__": np.array(key), **arrays}
        _atomic_write(self.part_path(key), lambda f: np.savez(f, **arrays))
        row = json.dumps({"key": key, "sha256": file_hash(self.part_path(key))})
        with open(self.path / "parts" / "index.jsonl", "a") as f:
            f.write(row + "\n")

    def load_part(self, key: str, *, keep_unit: bool = False) -> dict[str, np.ndarray]:
        # our own handle: np.load leaks the one it opens when the zip is unreadable
        with open(self.part_path(key), "rb") as f, np.load(f, allow_pickle=False) as z:
            part = {k: z[k] for k in z.files}
        if not keep_unit:
            part.pop("__unit__", None)
        return part

    def write_json(self, name: str, obj: Any) -> Path:
        write_json(self.path / name, obj)
        return self.path / name

    def save_figure(self, fig, name: str) -> Path:
        out = self.path / name
        _atomic_write(out, lambda f: fig.savefig(f, format=out.suffix[1:] or "png", dpi=120,
                                                  bbox_inches="tight"))
        return out
