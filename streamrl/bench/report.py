"""How a section's results become its part of BENCHMARKS.md, and where they are kept.

Every section measures into a `Results` struct of its own (the figures its tables and prose
print, ratios included, computed once when measured), stored as ``<results dir>/<section>.json``
and rendered by ``templates/<section>.md.jinja``. Templates only format and compare against
targets; they compute no figure, so ``streamrl bench --render`` reproduces the report from the
stored files exactly. `reflow` wraps the prose of a rendered section to ``WIDTH`` columns (table
rows stay whole). Called by `streamrl.bench.suite` and the section modules.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

if TYPE_CHECKING:
    import jinja2

TEMPLATES = Path(__file__).parent / "templates"
WIDTH = 100
GIB = 2**30
MIB = 2**20


class Results(msgspec.Struct, forbid_unknown_fields=True):
    """Base of every section's stored results: a misspelt key in a stored file is an error."""


R = TypeVar("R", bound=Results)


def save(path: Path, results: Results) -> None:
    """``results`` as indented JSON at ``path`` (made readable for review in a diff)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(results), indent=2) + b"\n")


def load(path: Path, kind: type[R]) -> R:
    """The results stored at ``path``, checked against ``kind``."""
    return msgspec.json.decode(path.read_bytes(), type=kind)


def fmt(value: float | int | None, spec: str = "") -> str:
    """``value`` formatted with ``spec``; ``n/a`` for a figure that was not measured."""
    return "n/a" if value is None else format(value, spec)


def times(value: float | None, spec: str = ".2f") -> str:
    """A ratio as ``1.90x``; ``n/a`` when it has no baseline."""
    return "n/a" if value is None else f"{value:{spec}}x"


@cache
def _environment() -> jinja2.Environment:
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,
        autoescape=False,  # markdown, not HTML
    )
    env.filters["fmt"] = fmt
    env.filters["x"] = times
    return env


def render(section: str, **context: Any) -> str:
    """``templates/<section>.md.jinja`` rendered with ``context``, its prose wrapped (`reflow`)."""
    return reflow(_environment().get_template(f"{section}.md.jinja").render(**context))


# -- wrapping ------------------------------------------------------------------------------------

_LIST_ITEM = "- "
# Words that would change the markdown if a wrapped line started with them: a list item, a
# heading, a quote, a table row, a numbered item, a setext underline.
_UNSAFE_START = re.compile(r"^([-+*>]$|[#>|=]|\d+[.)]$|-{2,})")


def reflow(text: str) -> str:
    """``text`` with each prose paragraph (and list item) wrapped to WIDTH columns; headings,
    table rows and blank lines as they are."""
    out: list[str] = []
    block: list[str] = []

    def flush() -> None:
        if block:
            out.extend(_wrap_block(block))
            block.clear()

    for line in text.splitlines():
        if not line.strip() or line.startswith(("|", "#")):
            flush()
            out.append(line)
        elif line.startswith(_LIST_ITEM):
            flush()
            block.append(line)
        else:
            block.append(line.strip())
    flush()
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def _wrap_block(lines: list[str]) -> list[str]:
    if lines[0].startswith(_LIST_ITEM):
        words = " ".join(lines)[len(_LIST_ITEM) :].split()
        return wrap_words(words, first=_LIST_ITEM, rest=" " * len(_LIST_ITEM))
    return wrap_words(" ".join(lines).split())


def wrap_words(words: list[str], *, first: str = "", rest: str = "", width: int = WIDTH) -> list[str]:
    """Greedy wrap of ``words`` after the prefix ``first`` (first line) or ``rest`` (the others; a
    word longer than a line stands alone). No line starts with a word markdown would read as
    syntax: the word before it moves down with it."""
    lines: list[list[str]] = [[]]
    for word in words:
        line = lines[-1]
        prefix = first if len(lines) == 1 else rest
        if line and len(prefix) + len(" ".join(line)) + 1 + len(word) > width:
            moved: list[str] = []
            while _UNSAFE_START.match(moved[0] if moved else word) and len(line) > 1:
                moved.insert(0, line.pop())
            lines.append(moved)
        lines[-1].append(word)
    return [(first if i == 0 else rest) + " ".join(ws) for i, ws in enumerate(lines)]
