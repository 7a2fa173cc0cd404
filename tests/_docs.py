"""The fenced blocks of the README and the documentation, as the tests read them.

docs/contributing.md ("Writing documentation") is the convention: an untitled ``sh``
block runs in the page's shell session, a ``json`` block right after it is that block's
output, an untitled ``python`` block runs in the page's Python session, a titled block
(``title="…"``) is a file a dedicated test proves, and ``text`` is not run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
EXAMPLES = ROOT / "examples"
#: The server the examples are written against (`make serve`); tests replace it.
DOCS_URL = "http://127.0.0.1:8787"

_FENCE = re.compile(r"^```([^\s`]*)([^\n]*)\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
_TITLE = re.compile(r'title="([^"]*)"')


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository: README.md, docs/cli.md, ...
    line: int
    language: str
    title: str | None
    body: str

    def __str__(self) -> str:
        title = f" {self.title!r}" if self.title else ""
        return f"{self.page}:{self.line} ({self.language}{title})"


def pages() -> list[Path]:
    """The README and every page of the documentation."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def page_name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of ``path`` that start at the beginning of a line, in order."""
    text = path.read_text(encoding="utf-8")
    found = []
    for match in _FENCE.finditer(text):
        title = _TITLE.search(match.group(2))
        found.append(
            Block(
                page=page_name(path),
                line=text.count("\n", 0, match.start()) + 1,
                language=match.group(1),
                title=title.group(1) if title else None,
                body=match.group(3),
            )
        )
    return found


def all_blocks() -> list[Block]:
    return [block for path in pages() for block in blocks(path)]


def titled(title: str) -> list[Block]:
    """Every block with this title, wherever it is shown."""
    return [block for block in all_blocks() if block.title == title]
