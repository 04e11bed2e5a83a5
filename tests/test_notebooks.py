"""Every notebook in notebooks/ runs top to bottom in quick mode, and is stored with outputs.

The notebooks are executed with nbclient (the library under ``jupyter execute``): one
kernel per notebook, cells run in order, the first error raised as
``CellExecutionError`` with the cell and its traceback, and a per-cell timeout. A plain
pytest parametrization over ``notebooks/*.ipynb`` keeps a notebook a test like any other
(ids, ``-k``, markers); nbmake would add a pytest plugin for the same loop, and papermill
a parameter-injection layer that the notebooks do not need (their parameter cell reads
``PROBEKIT_NOTEBOOK_QUICK`` from the environment, which the kernel inherits here).

Executing a notebook loads the default model or trains an organism (30-90 s each on a
CPU), so those tests are marked ``slow`` (``pytest`` runs them; ``-m "not slow"`` skips
them). The checks of the stored files and of the harness itself are fast.
"""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
#: Seconds one cell may run (quick mode takes well under this on a loaded 2-core box).
CELL_TIMEOUT = int(os.environ.get("PROBEKIT_NOTEBOOK_TIMEOUT", "300"))
#: Stored notebooks stay small enough to read and diff (outputs are PNGs at 60-72 dpi).
MAX_BYTES = 300_000
EXPECTED = {"quickstart", "state_tracking", "lag_and_pos", "latent_feedback_organism",
            "nnsight_intervention"}


def execute(path: Path, *, timeout: int = CELL_TIMEOUT) -> nbformat.NotebookNode:
    """Run the notebook at ``path`` in quick mode from its own folder (as Jupyter does);
    raises ``CellExecutionError`` at the first failing cell."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    env = {**os.environ, "PROBEKIT_NOTEBOOK_QUICK": "1",
           "PYDEVD_DISABLE_FILE_VALIDATION": "1"}
    client.execute(env=env)
    return nb


def test_the_notebooks_are_all_there():
    assert EXPECTED <= {p.stem for p in NOTEBOOKS}


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_quick_mode(path: Path):
    nb = execute(path)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.output_type == "error"]
    assert not errors


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_stored_notebook_has_outputs(path: Path):
    """Committed notebooks read well without running: every code cell ran (in order, no
    errors), the figures are stored, the parameter cell reads the quick-mode switch."""
    assert path.stat().st_size < MAX_BYTES, f"{path.name} is over {MAX_BYTES // 1000} KB"
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    counts = [c.execution_count for c in code]
    assert None not in counts, f"{path.name}: cells not run: {counts}"
    assert counts == sorted(counts), f"{path.name}: cells run out of order: {counts}"
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name}: no figure"
    first = code[0]
    assert "parameters" in first.metadata.get("tags", [])
    assert 'os.environ.get("PROBEKIT_NOTEBOOK_QUICK", "1") == "1"' in first.source


def test_a_broken_cell_fails_the_run(tmp_path: Path):
    """The harness itself: an error in any cell fails the test, with the cell's error."""
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("import os\nQUICK = os.environ['PROBEKIT_NOTEBOOK_QUICK']"),
        nbformat.v4.new_code_cell("assert QUICK == '1'\nraise RuntimeError('deliberately broken')"),
        nbformat.v4.new_code_cell("print('never reached')"),
    ])
    path = tmp_path / "broken.ipynb"
    nbformat.write(nb, path)
    with pytest.raises(CellExecutionError, match="deliberately broken"):
        execute(path, timeout=60)
