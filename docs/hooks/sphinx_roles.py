"""Griffe extension: turn the docstrings' Sphinx roles into checked cross-references.

probekit's docstrings name other objects the Sphinx way (:class:`Regime`,
:func:`~probekit.runs.identity`, :meth:`RunDir.map`, :mod:`.base`). mkdocstrings renders
Markdown, where those would be dead text; this extension rewrites each role into an
mkdocs-autorefs reference, ``[`Regime`][probekit.mechanisms.regimes.Regime]``, resolving
short names in the scope of the docstring's object (its members, its module's names and
imports) the way Python would. A name that does not resolve becomes a reference to
itself, so ``mkdocs build --strict`` fails on it: a docstring that names a function that
was renamed or removed breaks the documentation build. It also splits Google-style entries
that document several names at once (``start, cache: ...``), which the parser would
otherwise report as one unknown parameter.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|obj|exc|const):`(~?)([^`<>]+)`")
PACKAGES = ("probekit", "synthetic")


def _module(obj: griffe.Object) -> griffe.Module:
    return obj if obj.is_module else obj.module


def _canonical(collection, path: str) -> str:
    """``path`` with re-exports followed to where the object is defined."""
    try:
        found = collection.get_member(path)
    except (KeyError, ValueError, AttributeError):
        return path
    try:
        return found.target_path if found.is_alias else found.path
    except Exception:  # an alias that does not resolve: keep the name, autorefs checks it
        return path


def _resolve(obj: griffe.Object, name: str, collection) -> str:
    if name.startswith("."):  # a module relative to the docstring's package
        module = _module(obj)
        package = module if module.is_init_module else module.parent
        return f"{package.path}{name}"
    if name.split(".", 1)[0] in PACKAGES:
        return _canonical(collection, name)
    head, _, rest = name.partition(".")
    scope: Any = obj
    while scope is not None:
        try:
            path = scope.resolve(head)
            break
        except Exception:  # griffe raises NameResolutionError (or a KeyError) when absent
            scope = scope.parent
    else:
        path = _in_a_class(obj, head)
        if path is None:
            return name
    return _canonical(collection, f"{path}.{rest}" if rest else path)


def _in_a_class(obj: griffe.Object, name: str) -> str | None:
    """A module docstring's short name for a method or attribute of one of its classes
    (:meth:`attention_mask` in kv_cache's docstring), when exactly one class has it."""
    module = _module(obj)
    found = [c.members[name].path for c in module.classes.values()
             if not c.is_alias and name in c.members]
    return found[0] if len(found) == 1 else None


#: ``a, b: text`` in an Args/Attributes section: one entry per name for the Google parser.
_SECTION = re.compile(r"^(\s*)(Args|Arguments|Parameters|Attributes|Other Parameters):\s*$")
_GROUPED = re.compile(r"^(\s+)(\w+(?:\s*,\s*\w+)+)(\s*\([^)]*\))?:(\s.*|)$")


def split_grouped(text: str) -> str:
    """Give each of ``a, b: description`` (several names sharing one entry, as in
    ``start, cache: ...``) its own entry with the shared description, so the Google-style
    parser sees every parameter and still checks each name against the signature."""
    lines, out, section = text.splitlines(), [], None
    i = 0
    while i < len(lines):
        line = lines[i]
        head = _SECTION.match(line)
        if head:
            section = len(head.group(1))
        elif line.strip() and section is not None and len(line) - len(line.lstrip()) <= section:
            section = None
        m = _GROUPED.match(line) if section is not None else None
        if m is None:
            out.append(line)
            i += 1
            continue
        indent = len(m.group(1))
        body = [line]
        i += 1
        while i < len(lines) and (not lines[i].strip()
                                  or len(lines[i]) - len(lines[i].lstrip()) > indent):
            body.append(lines[i])
            i += 1
        while body and not body[-1].strip():
            body.pop()
            i -= 1
        rest = body[1:]
        for name in (n.strip() for n in m.group(2).split(",")):
            out.append(f"{m.group(1)}{name}{m.group(3) or ''}:{m.group(4)}")
            out.extend(rest)
    return "\n".join(out)


class SphinxRoles(griffe.Extension):
    """Rewrite Sphinx roles in every docstring of a loaded package (see module docstring)."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader,
                   **kwargs: Any) -> None:
        collection = loader.modules_collection
        stack: list[griffe.Object] = [pkg]
        while stack:
            obj = stack.pop()
            if obj.docstring is not None:
                obj.docstring.value = split_grouped(ROLE.sub(
                    lambda m, obj=obj: self._reference(obj, m, collection),
                    obj.docstring.value))
            stack.extend(m for m in obj.members.values() if not m.is_alias)

    @staticmethod
    def _reference(obj: griffe.Object, m: re.Match, collection) -> str:
        short, name = m.group(1) == "~", m.group(2).strip()
        shown = name.rsplit(".", 1)[-1] if short else name
        return f"[`{shown}`][{_resolve(obj, name, collection)}]"
