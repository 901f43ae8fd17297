"""Writing files that a crash never leaves half-written: the run directory's small files
(``checkpoints/last``, ``config.yaml``) and the sweep's (its manifest, statuses, summaries)."""

from __future__ import annotations

import os
from pathlib import Path

TMP_PREFIX = ".tmp-"  # what a write in progress is called; a crash may leave one behind


def fsync_dir(path: Path) -> None:
    """Make a rename inside directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` under a temporary name, on disk, then rename it to ``path`` (making its
    directory if need be): a reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(TMP_PREFIX + path.name)
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
