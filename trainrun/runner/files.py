"""Writing files that a crash never leaves half-written: the run directory's small files
(``checkpoints/last``, ``config.yaml``) and the sweep's (its manifest, statuses, summaries)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

TMP_PREFIX = ".tmp-"  # what a write in progress is called; a crash may leave one behind


def fsync_dir(path: Path) -> None:
    """Make a rename inside directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary name beside ``path`` to write the new file to; once the block ends, the
    file is made durable (fsync) and renamed to ``path``: a reader, or a crash, finds the old
    file or the new one, never half of one. A block that raises leaves ``path`` as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(TMP_PREFIX + path.name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through `replacing`."""
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
