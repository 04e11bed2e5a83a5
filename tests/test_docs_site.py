"""The documentation site builds in strict mode, and strict mode catches what it should.

The site is mkdocs-material + mkdocstrings (the API reference from the docstrings) +
mkdocs-jupyter (the notebooks with their stored outputs), configured in ``mkdocs.yml``;
``docs/hooks/site.py`` mounts notebooks/ and figures/ into it and
``docs/hooks/sphinx_roles.py`` turns the docstrings' Sphinx roles into checked
cross-references. The full build takes 10-30 s; the small builds below check, on a
throwaway project with the same settings, that a broken link and a docstring naming a
missing object each fail the build.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
HOOKS = ROOT / "docs" / "hooks"
BUILD_TIMEOUT = 300


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                           str(config), "-d", str(site)], cwd=config.parent, env=env,
                          capture_output=True, text=True, timeout=BUILD_TIMEOUT)


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = mkdocs_build(ROOT / "mkdocs.yml", out)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-4000:]}"
    return out


def test_every_docs_page_is_built(site: Path):
    pages = [p.relative_to(ROOT / "docs") for p in (ROOT / "docs").rglob("*.md")
             if "hooks" not in p.parts]
    for page in pages:
        html = "index.html" if page.stem == "index" else f"{page.stem}/index.html"
        assert (site / page.parent / html).is_file(), f"{page} was not built"


def test_api_reference_is_generated_with_working_cross_references(site: Path):
    core = (site / "api" / "core" / "index.html").read_text()
    assert 'id="probekit.core.engine.StepEngine"' in core
    assert 'id="probekit.core.engine.StepEngine.run"' in core
    top = (site / "api" / "index.html").read_text()
    assert 'id="probekit.load_model"' in top
    for page in (site / "api").rglob("index.html"):
        text = page.read_text()
        assert ":class:`" not in text and ":func:`" not in text, f"raw Sphinx role in {page}"
    # a docstring's :class:`~probekit.mechanisms.regimes.Regime` became a link
    analysis = (site / "api" / "analysis" / "index.html").read_text()
    assert 'href="../mechanisms/#probekit.mechanisms.regimes.Regime"' in analysis


def test_notebooks_are_rendered_with_their_outputs(site: Path):
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        html = (site / "notebooks" / nb.stem / "index.html").read_text()
        assert "data:image/png;base64," in html, f"{nb.name}: no figure in the page"
        assert not re.search(r'href="[^"]*\.md[#"]', html), f"{nb.name}: a link to a .md file"
        assert (site / "notebooks" / nb.stem / nb.name).is_file()  # downloadable source


def test_figures_linked_from_the_docs_are_in_the_site(site: Path):
    assert (site / "figures" / "state-tracking-completion.png").is_file()
    page = (site / "state-tracking" / "index.html").read_text()
    assert 'src="../figures/state-tracking-completion.png"' in page


# ---------------------------------------------------------------- strictness itself
def small_project(tmp_path: Path, pages: dict[str, str], *, api: bool = False) -> Path:
    """A throwaway site with mkdocs.yml's strictness and (``api``) its mkdocstrings setup."""
    real = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    for name, text in pages.items():
        (docs / name).write_text(textwrap.dedent(text))
    config = {"site_name": "t", "docs_dir": "docs", "strict": True,
              "validation": real["validation"], "plugins": ["search"]}
    if api:
        [mkdocstrings] = [p for p in real["plugins"] if isinstance(p, dict)
                          and "mkdocstrings" in p]
        python = mkdocstrings["mkdocstrings"]["handlers"]["python"]
        python["paths"] = [str(tmp_path)]
        python["options"]["extensions"] = [f"{HOOKS / 'sphinx_roles.py'}:SphinxRoles"]
        config["plugins"] = ["search", "autorefs", mkdocstrings]
    path = tmp_path / "mkdocs.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_broken_link_fails_the_build(tmp_path: Path):
    config = small_project(tmp_path, {"index.md": "# t\n\nSee [the guide](missing.md).\n"})
    done = mkdocs_build(config, tmp_path / "site")
    assert done.returncode != 0
    assert "missing.md" in done.stderr


def test_a_docstring_naming_a_missing_object_fails_the_build(tmp_path: Path):
    (tmp_path / "pkgx").mkdir()
    (tmp_path / "pkgx" / "__init__.py").write_text(
        '"""Calls :func:`helper` and :func:`~pkgx.sub.gone`."""\n\n'
        'def helper():\n    """Helps."""\n')
    (tmp_path / "pkgx" / "sub.py").write_text('"""Nothing here."""\n')
    config = small_project(tmp_path, {"index.md": "# API\n\n::: pkgx\n"}, api=True)
    done = mkdocs_build(config, tmp_path / "site")
    assert done.returncode != 0
    assert "pkgx.sub.gone" in done.stderr

    (tmp_path / "pkgx" / "sub.py").write_text('"""Now it is."""\n\ndef gone():\n    """Back."""\n')
    done = mkdocs_build(config, tmp_path / "site")
    assert done.returncode == 0, done.stderr[-2000:]
    html = (tmp_path / "site" / "index.html").read_text()
    assert 'href="#pkgx.helper"' in html and 'href="#pkgx.sub.gone"' in html


# ---------------------------------------------------------------- the hooks' rules
def test_links_out_of_docs_point_at_the_site_or_name_the_file():
    hook = load(HOOKS / "site.py", "site_hook")
    page = SimpleNamespace(file=SimpleNamespace(src_uri="commands/x.md"))
    text = ("![fig](../../figures/state-tracking-completion.png) "
            "[nb](../../notebooks/quickstart.ipynb#top) [code](../../probekit/runs.py) "
            "[gone](../../figures/no-such.png) [page](../state-tracking.md) [web](https://a.b)")
    out = hook.on_page_markdown(text, page, {}, None)
    assert "![fig](../figures/state-tracking-completion.png)" in out
    assert "[nb](../notebooks/quickstart.ipynb#top)" in out
    assert "code (`probekit/runs.py`)" in out
    assert "[gone](../../figures/no-such.png)" in out  # left for MkDocs to report
    assert "[page](../state-tracking.md)" in out and "[web](https://a.b)" in out


def test_grouped_google_entries_are_split():
    roles = load(HOOKS / "sphinx_roles.py", "sphinx_roles")
    doc = "Run.\n\nArgs:\n    x: one\n    start, cache: both\n        continued.\n    y: last\n"
    assert roles.split_grouped(doc).splitlines()[4:9] == [
        "    start: both", "        continued.", "    cache: both", "        continued.",
        "    y: last"]
    assert roles.split_grouped("Returns:\n    a, b: kept\n") == "Returns:\n    a, b: kept"
