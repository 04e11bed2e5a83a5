"""Print run.sh's per-module table (markdown) from its scratch folders.

Usage: python summarise.py WORK NAME...   (run.sh calls it). "Detected" counts killed
and timed-out mutants (a mutant that makes the tests hang is caught), as mutmut's own
score does. The "after" columns appear once ``run.sh --recheck`` has re-tested the
survivors with the current tests.
"""

import json
import sys
from pathlib import Path

UNDETECTED = ("survived", "no tests", "suspicious", "skipped", "not checked", "segfault")


def still_alive(folder: Path) -> int | None:
    recheck = folder / "recheck.txt"
    if not recheck.exists():
        return None
    statuses = [line.rsplit(": ", 1)[-1].strip() for line in recheck.read_text().splitlines()
                if line.strip()]
    return sum(s in UNDETECTED for s in statuses)


def main(work: Path, names: list[str]) -> None:
    print("| module | mutants | killed | survived | timeout | no tests | detected | time "
          "| survived after | detected after |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    sums = dict(total=0, killed=0, survived=0, timeout=0, no_tests=0, after=0)
    any_after = False
    for name in names:
        folder = work / name
        s = json.loads((folder / "stats.json").read_text())
        seconds = (folder / "seconds").read_text().strip()
        detected = s["killed"] + s["timeout"]
        alive = still_alive(folder)
        any_after |= alive is not None
        after = s["total"] - (alive if alive is not None else s["total"] - detected)
        for key in ("total", "killed", "survived", "timeout", "no_tests"):
            sums[key] += s[key]
        sums["after"] += after
        after_cols = (f"{alive} | {after / s['total']:.1%}" if alive is not None else "| ")
        print(f"| {name} | {s['total']} | {s['killed']} | {s['survived']} | {s['timeout']} "
              f"| {s['no_tests']} | {detected / s['total']:.1%} | {seconds} s | {after_cols} |")
    total = sums["total"]
    detected = sums["killed"] + sums["timeout"]
    after_cols = (f"{total - sums['after']} | **{sums['after'] / total:.1%}**" if any_after
                  else "| ")
    print(f"| **all** | {total} | {sums['killed']} | {sums['survived']} | {sums['timeout']} "
          f"| {sums['no_tests']} | **{detected / total:.1%}** | | {after_cols} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
