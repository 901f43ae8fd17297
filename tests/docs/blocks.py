"""The code blocks of the README and the docs pages, and how each is run by the tests.

A fenced block is one of:
- ``bash``: shell commands, run by the tests (``set -euo pipefail``) in the page's own
  temporary directory, which holds copies of ``configs/``, ``tools/`` and ``examples/``;
- ``python``: a script, run the same way with the environment's Python;
- a file: any block whose first line is ``# <relative path>`` ending in .py, .yaml or .json;
  it is written to that path in the page's directory (later blocks use it) and, where the
  repository has that file, it must be the file's whole text;
- ``yaml``: a piece of a config; merged over ``configs/digits_single.yaml``, it must pass the
  config's checks, so that a renamed key breaks a test;
- anything else (``text`` output, MyST directives): not run.

A ``bash``, ``python`` or ``yaml`` block that cannot run in the tests says why on its first
line, visibly: ``# not tested: needs a SLURM cluster``. Blocks of a page run in order, each
starting in the page's directory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])
PAGES = [p for p in PAGES if "_generated" not in p.parts]
RUN = ("bash", "python")
# other names people give shell and Python blocks: refused, so that none escapes the tests
NOT_RUN_ALIASES = ("sh", "shell", "console", "zsh", "py", "python3", "pycon", "ipython")
FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
FILE_LINE = re.compile(r"^# (?P<path>[\w./-]+\.(?:py|yaml|yml|json))$")
NOT_TESTED = re.compile(r"^# not tested: (?P<why>\S.*)$")


@dataclass(frozen=True)
class Block:
    """One fenced block: the page, the line its fence opens on, its language and text."""

    page: Path
    line: int
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    @property
    def first_line(self) -> str:
        return self.text.split("\n", 1)[0]

    @property
    def file(self) -> str | None:
        """The relative path this block is the text of, if it is a file block."""
        match = FILE_LINE.match(self.first_line)
        return match.group("path") if match else None

    @property
    def not_tested(self) -> str | None:
        """Why this block is not run, as its first line says; None when it runs."""
        match = NOT_TESTED.match(self.first_line)
        return match.group("why") if match else None

    @property
    def runs(self) -> bool:
        return self.lang in RUN and self.file is None and self.not_tested is None

    @property
    def is_config(self) -> bool:
        """A piece of a config the tests check (see the module's docstring)."""
        return self.lang == "yaml" and self.file is None and self.not_tested is None


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a Markdown page, in order (nested fences are not followed)."""
    found: list[Block] = []
    lines = page.read_text(encoding="utf-8").split("\n")
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i].lstrip())
        if not match:
            i += 1
            continue
        indent = len(lines[i]) - len(lines[i].lstrip())
        fence, info = match.group("fence"), match.group("info").strip()
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not (lines[j].strip().startswith(fence)
                                       and lines[j].strip().strip(fence[0]) == ""):
            body.append(lines[j][indent:] if lines[j][:indent].isspace() else lines[j])
            j += 1
        lang = info.split()[0] if info else ""
        found.append(Block(page, i + 1, lang, "\n".join(body) + "\n"))
        i = j + 1
    return found


def runnable_pages() -> list[Path]:
    """The pages with at least one block the tests run or write."""
    return [page for page in PAGES
            if any(b.runs or (b.file and b.lang in (*RUN, "yaml", "json"))
                   for b in blocks(page))]
