"""Run directories: config, versions, model identity, finished parts, results.

Every long command writes one folder::

    runs/<command>-<config hash>/
        config.json      the full configuration (what the hash is computed from)
        manifest.json    package versions, model name/hash/source, argv, start time
        parts/<key>.npz  one file per finished unit of work (a window batch, a pair...)
        summary.json     the results, written last
        *.png            plots

The folder name is a hash of the config, so re-running an interrupted command with
the same arguments finds its folder and skips the parts already on disk; each part is
written atomically (temp file + rename), so a kill never leaves half a part.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

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


def config_hash(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:10]


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


class RunDir:
    """A run folder; use :meth:`open` to create or resume one."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    @classmethod
    def open(cls, command: str, config: dict, *, model=None, root: str | Path = "runs",
             path: str | Path | None = None, fresh: bool = False) -> RunDir:
        """Create ``root/<command>-<hash(config)>`` or resume it if it holds the same config.

        ``fresh=True`` forgets finished parts of an earlier run with this config."""
        path = Path(path) if path else Path(root) / f"{command}-{config_hash(config)}"
        run = cls(path)
        cfg_file = path / "config.json"
        if cfg_file.exists():
            old = json.loads(cfg_file.read_text())
            if json.loads(json.dumps(config, default=str)) != old:
                raise ValueError(
                    f"{path} holds a run with a different config; choose another --run-dir "
                    f"or delete it"
                )
            if fresh:
                for p in (path / "parts").glob("*.npz"):
                    p.unlink()
        write_json(cfg_file, config)
        manifest = {
            "command": command,
            "argv": sys.argv,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "versions": versions(),
        }
        if model is not None:
            manifest["model"] = {"name": model.name, "content_hash": model.content_hash,
                                 "source": model.source, "n_blocks": model.n_blocks,
                                 "d_model": model.d_model}
        write_json(path / "manifest.json", manifest)
        return run

    def part_path(self, key: str) -> Path:
        return self.path / "parts" / f"{key}.npz"

    def has_part(self, key: str) -> bool:
        return self.part_path(key).exists()

    def save_part(self, key: str, **arrays: Any) -> None:
        _atomic_write(self.part_path(key), lambda f: np.savez(f, **arrays))

    def load_part(self, key: str) -> dict[str, np.ndarray]:
        with np.load(self.part_path(key), allow_pickle=False) as z:
            return {k: z[k] for k in z.files}

    def write_json(self, name: str, obj: Any) -> Path:
        write_json(self.path / name, obj)
        return self.path / name

    def save_figure(self, fig, name: str) -> Path:
        out = self.path / name
        _atomic_write(out, lambda f: fig.savefig(f, format=out.suffix[1:] or "png", dpi=120,
                                                  bbox_inches="tight"))
        return out
