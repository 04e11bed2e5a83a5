"""MkDocs hook: serve the repository's notebooks/ and figures/ in the site and keep the
docs' links to them working both on GitHub and in the built site.

The pages in docs/ are written to be read on GitHub too, so they link to repository files
relatively (``../figures/x.png``, ``../notebooks/quickstart.ipynb``). MkDocs only knows
files under docs/, so this hook

- adds ``notebooks/*.ipynb`` and ``figures/*`` to the site at the same relative paths
  (before mkdocs-jupyter turns notebooks into pages: hence the high event priority);
- rewrites a Markdown link whose target lies outside docs/ to the site's copy when the
  hook mounted it, and to plain text naming the file when it is another repository file
  (source code, SEMANTICS.md, ...): the site has no page for it;
- in rendered notebooks, rewrites links to ``../docs/<page>.md`` to that page's URL.

A link to a file that does not exist is left alone, so ``mkdocs build --strict`` still
fails on it (a notebook's broken link is reported by this hook, as a warning).
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.site")

ROOT = Path(__file__).resolve().parents[2]
MOUNTED = ("notebooks", "figures")
_MD_LINK = re.compile(r"(!?)\[([^\]\n]*)\]\(([^)\s]+)\)")
_HREF = re.compile(r'href="([^"#:]+\.md)(#[^"]*)?"')


@event_priority(100)
def on_files(files: Files, config) -> Files:
    for folder in MOUNTED:
        for path in sorted((ROOT / folder).glob("*")):
            if path.is_file() and not path.name.startswith("."):
                files.append(File(f"{folder}/{path.name}", str(ROOT), config["site_dir"],
                                  config["use_directory_urls"]))
    return files


def _repo_path(page_src: str, link: str) -> str:
    """The repository path a docs page's relative link points to."""
    return posixpath.normpath(posixpath.join("docs", posixpath.dirname(page_src), link))


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    if page.file.src_uri.endswith(".ipynb"):
        return markdown

    def fix(m: re.Match) -> str:
        bang, text, target = m.groups()
        link, _, anchor = target.partition("#")
        if not link or "://" in link or link.startswith(("/", "mailto:")):
            return m.group(0)
        repo = _repo_path(page.file.src_uri, link)
        if repo.startswith("docs/") or not (ROOT / repo).exists():
            return m.group(0)  # a docs page, or broken: MkDocs checks it
        top = repo.split("/", 1)[0]
        if top in MOUNTED:
            new = posixpath.relpath(repo, posixpath.dirname(page.file.src_uri) or ".")
            return f"{bang}[{text}]({new}{'#' + anchor if anchor else ''})"
        # another repository file: the site has no page for it; name it instead
        return text if repo in text else f"{text} (`{repo}`)"

    return _MD_LINK.sub(fix, markdown)


def on_page_content(html: str, page, config, files: Files) -> str:
    if not page.file.src_uri.endswith(".ipynb"):
        return html

    def fix(m: re.Match) -> str:
        link, anchor = m.group(1), m.group(2) or ""
        repo = posixpath.normpath(posixpath.join(posixpath.dirname(page.file.src_uri), link))
        target = files.get_file_from_path(repo.removeprefix("docs/"))
        if not repo.startswith("docs/") or target is None:
            log.warning("notebook %s links to %s, which is not a page of the site",
                        page.file.src_uri, link)
            return m.group(0)
        return f'href="{target.url_relative_to(page.file)}{anchor}"'

    return _HREF.sub(fix, html)
