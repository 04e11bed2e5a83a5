"""Which tests of one file kill each mutant that a ``run.sh --recheck`` killed.

Usage (after ``run.sh`` and ``run.sh --recheck``)::

    .venv/bin/python tests/mutation/attribute.py /tmp/probekit-mutation/engine \
        tests/test_formulas.py

For every mutant in ``survivors.txt`` (the full run's survivors) that is not in
``survivors-after.txt`` (still alive after the recheck), runs the tests of the given
file that reach the mutated function (mutmut's own coverage map) with that mutant
active, and prints ``mutant: failing tests``. Writes ``attribution.txt`` beside them.
"""

import contextlib
import json
import os
import sys
from pathlib import Path


class _Failures:
    def __init__(self) -> None:
        self.failed: list[str] = []

    def pytest_runtest_logreport(self, report) -> None:
        if report.failed:
            self.failed.append(report.nodeid.split("::", 1)[1])


def main(folder: Path, test_file: str) -> None:
    import pytest

    survivors = (folder / "survivors.txt").read_text().split()
    still = set((folder / "survivors-after.txt").read_text().split())
    stats = json.loads((folder / "mutants" / "mutmut-stats.json").read_text())
    covering = stats["tests_by_mangled_function_name"]
    os.chdir(folder / "mutants")
    sys.path.insert(0, str(Path.cwd()))
    lines = []
    for name in (m for m in survivors if m not in still):
        function = name.rsplit("__mutmut_", 1)[0]
        tests = sorted(t for t in covering.get(function, []) if t.startswith(test_file))
        failures = _Failures()
        os.environ["MUTANT_UNDER_TEST"] = name
        if tests:
            with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
                pytest.main(["-qq", "--tb=no", "-p", "no:cacheprovider", "-m", "not slow",
                             "--rootdir=.", "-o", "addopts=", *tests], plugins=[failures])
        line = f"{name}: {', '.join(failures.failed) or '(none of ' + test_file + ')'}"
        print(line, file=sys.__stdout__, flush=True)
        lines.append(line)
    os.environ.pop("MUTANT_UNDER_TEST", None)
    (folder / "attribution.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve(), sys.argv[2])
