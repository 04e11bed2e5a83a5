"""Compare two folders of summary JSON written by experiments/tiny_regression.sh.

    python experiments/compare_summaries.py /tmp/before /tmp/after

Prints every number that differs (timings, paths, dates and versions are skipped) and
exits 1 if any does: a refactor must leave every result identical.
"""

import json
import sys
from pathlib import Path

SKIP = {"seconds", "wall_seconds", "plots", "started", "versions", "argv", "run_dir", "path",
        "checkpoint", "elapsed", "elapsed_seconds", "time", "minutes"}


def walk(a, b, where, out):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k in SKIP or any(s in k for s in ("seconds", "_time")):
                continue
            if k not in a or k not in b:
                out.append(f"{where}.{k}: only in {'after' if k in b else 'before'}")
            else:
                walk(a[k], b[k], f"{where}.{k}", out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            walk(x, y, f"{where}[{i}]", out)
    elif a != b and not (a != a and b != b):  # NaN == NaN here
        out.append(f"{where}: {str(a)[:80]} != {str(b)[:80]}")


def main(before: str, after: str) -> int:
    bad = 0
    for f in sorted(Path(before).glob("*.json")):
        g = Path(after) / f.name
        if not g.exists():
            print(f"{f.name}: missing after")
            bad += 1
            continue
        diffs: list[str] = []
        walk(json.loads(f.read_text()), json.loads(g.read_text()), "", diffs)
        print(f"{f.name}: {'identical' if not diffs else f'{len(diffs)} differences'}")
        for d in diffs[:20]:
            print("   ", d)
        bad += bool(diffs)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
