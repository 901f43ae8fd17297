"""Naming, publishing and pruning checkpoints in ``work_dir/checkpoints``.

A checkpoint is written by the strategy under a temporary name (one file, or a directory of
shards), then renamed by rank 0; ``checkpoints/last`` is rewritten after that. A crash at any
moment therefore leaves the previous checkpoint in charge, and a half-written one is never
visible under a real name.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

from torch import nn

from trainrun.dist import barrier, broadcast_object_list, is_main_process
from trainrun.wrappers.base import Optimizers, Strategy

TMP_PREFIX = ".tmp-"
LAST = "last"
_STEP = re.compile(r"^(epoch|iter)_(\d+)")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(TMP_PREFIX + path.name)
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class CheckpointManager:
    """Saves through ``strategy`` into ``directory``, keeping at most ``max_keep`` periodic
    checkpoints (-1: all); the newest and the best are never pruned."""

    def __init__(self, directory: Path, strategy: Strategy, max_keep: int = 3,
                 suffix: str = ".pth"):
        self.directory = directory
        self.strategy = strategy
        self.max_keep = max_keep
        self.suffix = suffix

    def clean_partial(self) -> None:
        """Remove what a crash during a save left behind (rank 0; call before saving)."""
        if is_main_process() and self.directory.is_dir():
            for entry in self.directory.iterdir():
                if entry.name.startswith(TMP_PREFIX):
                    _remove(entry)

    def save(self, name: str, model: nn.Module, optimizer: Optimizers | None,
             extra: dict[str, Any], update_last: bool = True) -> Path:
        """Write checkpoint ``name`` on every rank and publish it; returns its path."""
        final = self.directory / f"{name}{self.suffix}"
        tmp = self.directory / f"{TMP_PREFIX}{name}{self.suffix}"
        if is_main_process():
            self.directory.mkdir(parents=True, exist_ok=True)
            _remove(tmp)
        barrier()
        self.strategy.save_checkpoint(str(tmp), model, optimizer, extra)
        barrier()  # every rank's part is on disk
        if is_main_process():
            if tmp.is_dir() or (final.is_dir() and not final.is_symlink()):
                _remove(final)  # only a file is renamed over a file (atomically)
            os.replace(tmp, final)
            _fsync_dir(self.directory)
            if update_last:
                _write_atomically(self.directory / LAST, final.name + "\n")
                self._prune()
        barrier()
        return final

    def remove(self, path: Path) -> None:
        if is_main_process():
            _remove(path)

    def latest(self) -> Path | None:
        """The checkpoint ``last`` names, if it is there; the same answer on every rank."""
        found = [None]
        if is_main_process():
            last = self.directory / LAST
            if last.is_file():
                candidate = self.directory / last.read_text(encoding="utf-8").strip()
                found[0] = str(candidate) if candidate.exists() else None
        broadcast_object_list(found)
        return Path(found[0]) if found[0] else None

    def _prune(self) -> None:
        if self.max_keep < 0:
            return
        periodic = sorted((int(m.group(2)), entry) for entry in self.directory.iterdir()
                          if (m := _STEP.match(entry.name)))
        keep = max(self.max_keep, 1)  # never the newest, which `last` names
        for _, entry in periodic[: max(len(periodic) - keep, 0)]:
            _remove(entry)
