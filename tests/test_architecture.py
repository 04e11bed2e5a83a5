"""The package's shape (DESIGN.md "Layout", issue 8), checked statically from the source.

- no import cycles among probekit's modules;
- imports point down the layers: core <- mechanisms <- analysis <- training <- commands;
- nothing outside ``probekit/core/`` reaches into an engine's backend or writes its state;
- the library layers never print and never parse flags;
- no module is longer than ``MAX_LINES``.

Every import counts, also one inside a function: a lazy import still ties two modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "probekit"
MAX_LINES = 450
LAYERS = ["core", "mechanisms", "analysis", "training", "commands"]  # bottom to top
LIBRARY = ["core", "mechanisms", "analysis", "training", "data"]


def _modules() -> dict[str, Path]:
    """``probekit.x.y`` -> file, for every module of the package."""
    out = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


MODULES = _modules()
TREES = {name: ast.parse(f.read_text(), filename=str(f)) for name, f in MODULES.items()}


def _imported(name: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The probekit modules an import statement of module ``name`` reaches."""
    if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: climb from the module's package
            package = name.split(".")
            if MODULES[name].name != "__init__.py":
                package = package[:-1]
            package = package[: len(package) - node.level + 1]
            base = ".".join(package + ([base] if base else []))
        targets = [base] + [f"{base}.{a.name}" for a in node.names]
    hits = []
    for t in targets:
        while t and t not in MODULES:  # `from probekit.core import engine` -> the module
            t = t.rpartition(".")[0]
        if t and t != name:
            hits.append(t)
    return hits


def _related(a: str, b: str) -> bool:
    """A package and a module inside it (``__init__`` re-exports are no cycle)."""
    return (a + ".").startswith(b + ".") or (b + ".").startswith(a + ".")


def _graph() -> dict[str, set[str]]:
    graph = {name: set() for name in MODULES}
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name].update(t for t in _imported(name, node) if not _related(name, t))
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _layer(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS + LIBRARY else None


def _by_line(report: str) -> tuple[str, int]:
    """Sort key of ``"probekit.x:12 ..."`` reports: module, then line number."""
    where = report.split()[0]
    module, _, line = where.partition(":")
    return module, int(line) if line.isdigit() else 0


# ------------------------------------------------------------------------ tests
def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_imports_resolve_to_modules():
    relative = ast.parse("from .kv_cache import KVCache").body[0]
    assert set(_imported("probekit.core.engine", relative)) == {"probekit.core.kv_cache"}
    up = ast.parse("from ..core import engine").body[0]
    assert set(_imported("probekit.mechanisms.recirculation", up)) == {
        "probekit.core", "probekit.core.engine"}
    absolute = ast.parse("import probekit.core.engine, torch").body[0]
    assert _imported("probekit.analysis.lag", absolute) == ["probekit.core.engine"]


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_imports_point_down_the_layers():
    wrong = []
    for name, targets in _graph().items():
        here = _layer(name)
        if here not in LAYERS:
            continue
        for t in sorted(targets):
            there = _layer(t)
            if there in LAYERS and LAYERS.index(there) > LAYERS.index(here):
                wrong.append(f"{name} imports {t} ({here} -> {there})")
    assert not wrong, "imports pointing up:\n" + "\n".join(wrong)


def _engine_like(node: ast.AST) -> bool:
    """``engine``, ``self.engine``, ``tiny_engine``...: a name that says it is an engine."""
    name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")
    return name.endswith("engine")


def _engine_internals(trees: dict[str, ast.AST]) -> list[str]:
    """Uses of an engine's ``backend`` (or anything ``.backend.x``) and writes to an
    engine's ``state`` outside ``probekit/core``. Reading ``engine.state`` is the API a hook
    uses to learn which positions and pass are running, so it is allowed."""
    wrong = []
    for name, tree in trees.items():
        if _layer(name) == "core":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "backend" and (
                    _engine_like(node.value)):
                wrong.append(f"{name}:{node.lineno} reads an engine's .backend")
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                  and node.value.attr == "backend"):
                wrong.append(f"{name}:{node.lineno} reaches through .backend.{node.attr}")
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                       else [])
            for t in targets:
                while isinstance(t, (ast.Attribute, ast.Subscript)):
                    if isinstance(t, ast.Attribute) and t.attr == "state" and (
                            _engine_like(t.value)):
                        wrong.append(f"{name}:{node.lineno} writes an engine's .state")
                        break
                    t = t.value
    return wrong


@pytest.mark.parametrize("source,caught", [
    ("engine.backend.unembed(x)", True),
    ("self.engine.backend", True),
    ("n = model.backend.n_ctx", True),
    ("engine.state.pass_index = 1", True),
    ("engine.state = None", True),
    ("pos = engine.state.positions", False),  # hooks may read where the engine is
    ("self.state = h[:, -1]", False),  # a strategy's own state
    ("torch.backends.cudnn.enabled = False", False),
])
def test_the_engine_internals_check_catches(source, caught):
    assert bool(_engine_internals({"probekit.analysis.example": ast.parse(source)})) == caught
    assert not _engine_internals({"probekit.core.example": ast.parse(source)})


def test_only_core_touches_the_engine_backend_or_writes_its_state():
    wrong = _engine_internals(TREES)
    assert not wrong, "engine internals used outside probekit/core:\n" + "\n".join(
        sorted(wrong, key=_by_line))


def test_library_layers_never_print_nor_parse_flags():
    wrong = []
    for name, tree in TREES.items():
        if _layer(name) not in LIBRARY:
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "print"):
                wrong.append(f"{name}:{node.lineno} calls print(")
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [node.module or ""]
            else:
                continue
            for m in mods:
                if m.split(".")[0] in ("argparse", "tyro"):
                    wrong.append(f"{name}:{node.lineno} imports {m}")
    assert not wrong, "library modules that print or parse flags:\n" + "\n".join(
        sorted(wrong, key=_by_line))


def test_no_module_is_too_long():
    long = {name: n for name, f in MODULES.items()
            if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by idea): {long}"
