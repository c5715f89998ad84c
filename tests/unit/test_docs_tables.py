"""The docs stay in step with the code: every module is named in its docs page's file table, every
relative link in README.md and docs/*.md resolves, and the README stays a front door.

Which page names which modules (``PAGES``): a package folder maps to the docs pages whose tables
name its modules; the most specific folder wins (``services/gym_gateway/envs/swe`` -> docs/swe.md,
the rest of the gateway -> docs/gym_gateway.md). A module is named when the first cell of a table
row on one of its pages holds its path relative to that folder in backticks (``backends/base.py``;
a cell may name several). Every ``*.py`` file counts but an ``__init__.py`` that holds only a
docstring. The other way round, every ``*.py`` a first cell names must exist under one of the
page's folders: a row left behind by a moved module is drift too.

To document a new module: add a row to its page's table. A new package: add it to ``PAGES``.
A folder that does not exist (yet) is skipped, so ``shared_torch`` is checked once it is there.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

# package folder -> glob of the docs pages whose tables name its modules
PAGES: dict[str, str] = {
    "services/trainer": "docs/trainer*.md",
    "services/generator": "docs/generator.md",
    "services/gym_gateway": "docs/gym_gateway.md",
    "services/gym_gateway/envs/swe": "docs/swe.md",
    "shared": "docs/shared.md",
    "shared_torch": "docs/shared.md",
    "streamrl": "docs/cli.md",
}
# where modules live: every one of them must fall under a folder of PAGES
CODE = ("services", "shared", "shared_torch", "streamrl")

README_MAX_LINES = 250
DOC_MAX_LINES = 450
FRONT_DOOR = "bash scripts/demo.sh\nbash scripts/test.sh\n"

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`[^`]*`")
TABLE_PY = re.compile(r"`([^`\s]+\.py)`")
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def prose_lines(path: Path) -> Iterator[str]:
    """The lines of a markdown file outside fenced code blocks."""
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield line


def table_names(path: Path) -> set[str]:
    """Every ``*.py`` in backticks in the first cell of a table row of ``path``."""
    names: set[str] = set()
    for line in prose_lines(path):
        row = line.strip()
        if row.startswith("|"):
            names.update(TABLE_PY.findall(row.strip("|").split("|")[0]))
    return names


def slugs(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a markdown file."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in prose_lines(path):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m[1].lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def is_docstring_only(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return all(isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) for s in body)


def modules(folder: str) -> Iterator[Path]:
    for path in sorted((ROOT / folder).rglob("*.py")):
        if path.name == "__init__.py" and is_docstring_only(path):
            continue
        yield path


def page_of(module: Path) -> tuple[str, str]:
    """The most specific folder of ``PAGES`` holding ``module``, and its pages' glob."""
    rel = module.relative_to(ROOT).as_posix()
    folders = [f for f in PAGES if rel.startswith(f + "/")]
    if not folders:
        raise AssertionError(f"{rel} is under no folder of PAGES: add its package and docs page there")
    folder = max(folders, key=len)
    return folder, PAGES[folder]


def pages(glob: str) -> list[Path]:
    found = sorted(ROOT.glob(glob))
    assert found, f"no docs page matches {glob}"
    return found


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_module_is_named_in_its_docs_table():
    missing = []
    for top in CODE:
        if not (ROOT / top).is_dir():
            continue
        for module in modules(top):
            folder, glob = page_of(module)
            named = set().union(*(table_names(p) for p in pages(glob)))
            rel = module.relative_to(ROOT / folder).as_posix()
            if rel not in named:
                missing.append(f"{module.relative_to(ROOT)}: no row names `{rel}` in {glob}")
    assert not missing, "modules missing from their docs tables:\n" + "\n".join(missing)


def test_every_module_a_table_names_exists():
    folders_of: dict[Path, list[str]] = {}
    for folder, glob in PAGES.items():
        for page in pages(glob):
            folders_of.setdefault(page, []).append(folder)
    stale = [
        f"{page.relative_to(ROOT)}: `{name}` is no module of {' or '.join(folders)}"
        for page, folders in folders_of.items()
        for name in sorted(table_names(page))
        if not any((ROOT / f / name).is_file() for f in folders)
    ]
    assert not stale, "docs tables name modules that do not exist:\n" + "\n".join(stale)


def test_every_relative_link_resolves():
    broken = []
    for md in markdown_files():
        prose = CODE_SPAN.sub("", "\n".join(prose_lines(md)))  # a link's text may wrap
        for target in LINK.findall(prose):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            where = f"{md.relative_to(ROOT)}: ({target})"
            if not dest.exists():
                broken.append(f"{where}: {path} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in slugs(dest):
                broken.append(f"{where}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    first_block = re.search(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
    assert first_block and first_block[1] == FRONT_DOOR, "the README's first code block is the two commands"
    lines = text.count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; the rest belongs in docs/"
    pinned = COMMIT.findall(text)
    assert not pinned, f"README.md pins figures to commits {pinned}: they rot with every commit"


def test_no_docs_page_is_over_the_hard_stop():
    long = [f"{p.relative_to(ROOT)}: {n}" for p in markdown_files() if (n := p.read_text().count("\n")) > DOC_MAX_LINES]
    assert not long, f"pages over {DOC_MAX_LINES} lines (split them along a real boundary):\n" + "\n".join(long)
