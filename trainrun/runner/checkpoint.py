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
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from trainrun.dist import all_reduce, at_checkpoint, barrier, broadcast_object_list, is_main_process
from trainrun.runner.files import TMP_PREFIX, fsync_dir, write_atomically
from trainrun.wrappers.base import (
    TRAIN_STATE,
    Optimizers,
    Strategy,
    load_state_file,
    refusing_unsafe,
)
from trainrun.wrappers.deepspeed import (
    TAG,
    deepspeed_weights,
    is_deepspeed_checkpoint,
    weights_only_loads,
)
from trainrun.wrappers.fsdp import check_metadata, is_sharded_checkpoint, sharded_model_weights

LAST = "last"
_STEP = re.compile(r"^(epoch|iter)_(\d+)")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


@dataclass
class _Pending:
    future: Future
    tmp: Path
    final: Path
    update_last: bool
    step: int


def named_by_last(directory: Path) -> Path | None:
    """The checkpoint that ``directory/last`` names (there or not); None without ``last``."""
    last = directory / LAST
    if not last.is_file():
        return None
    return directory / last.read_text(encoding="utf-8").strip()


class CheckpointManager:
    """Saves through ``strategy`` into ``directory``, keeping at most ``max_keep`` periodic
    checkpoints (-1: all); the newest and the best are never pruned."""

    def __init__(self, directory: Path, strategy: Strategy, max_keep: int = 3,
                 suffix: str = ".pth"):
        self.directory = directory
        self.strategy = strategy
        self.max_keep = max_keep
        self.suffix = suffix
        self._pending: _Pending | None = None  # a background save not yet published
        self.last_saved: Path | None = None  # the newest save asked for (maybe still writing)

    def clean_partial(self) -> None:
        """Remove what a crash during a save left behind (rank 0; call before saving)."""
        if is_main_process() and self.directory.is_dir():
            for entry in self.directory.iterdir():
                if entry.name.startswith(TMP_PREFIX):
                    _remove(entry)

    def save(self, name: str, model: nn.Module, optimizer: Optimizers | None,
             extra: dict[str, Any], update_last: bool = True, background: bool = False,
             step: int = 0) -> Path:
        """Write checkpoint ``name`` (the state after ``step`` steps) on every rank and publish
        it; returns its path.

        With ``background``, this returns once the state is copied in memory; the checkpoint
        is published by a later `poll` or `finish`, when every rank's part is on disk. A
        background save still running is finished first.
        """
        self.finish()
        self.clean_partial()
        final = self.directory / f"{name}{self.suffix}"
        tmp = self.directory / f"{TMP_PREFIX}{name}{self.suffix}"
        if is_main_process():
            self.directory.mkdir(parents=True, exist_ok=True)
            _remove(tmp)
        barrier()
        self.last_saved = final
        if background:
            future = self.strategy.save_checkpoint_async(str(tmp), model, optimizer, extra)
            self._pending = _Pending(future, tmp, final, update_last, step)
            return final
        self.strategy.save_checkpoint(str(tmp), model, optimizer, extra)
        self._publish(tmp, final, update_last, step)
        return final

    def poll(self) -> None:
        """Publish a background save if every rank's part is written; otherwise return at
        once. Every rank calls this at the same points (one small all_reduce while a save
        is pending, none otherwise)."""
        if self._pending is None:
            return
        writing = torch.tensor([0 if self._pending.future.done() else 1])
        all_reduce(writing, op="max")
        if writing.item() == 0:
            self.finish()

    def finish(self) -> None:
        """Wait for a background save and publish it (every rank); a write that failed on
        any rank raises on every rank and leaves ``last`` where it was."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        error = pending.future.exception()
        failed = torch.tensor([0 if error is None else 1])
        all_reduce(failed, op="max")
        if failed.item():
            raise RuntimeError(f"background save of {pending.final.name} failed"
                               + (f" here: {error!r}" if error else " on another rank")) from error
        self._publish(pending.tmp, pending.final, pending.update_last, pending.step)

    def abandon(self) -> None:
        """Let a background save that will not be published (training failed) end on this
        rank; what it wrote stays under its temporary name, which the next save removes."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.future.exception()  # waits; a write that failed is of no use now either

    def _publish(self, tmp: Path, final: Path, update_last: bool, step: int) -> None:
        """Rename a complete checkpoint to its name and point ``last`` at it (rank 0); the
        heartbeat then knows where a restart would continue from (`at_checkpoint`)."""
        barrier()  # every rank's part is on disk
        if is_main_process():
            if tmp.is_dir() or (final.is_dir() and not final.is_symlink()):
                _remove(final)  # only a file is renamed over a file (atomically)
            os.replace(tmp, final)
            fsync_dir(self.directory)
            if update_last:
                write_atomically(self.directory / LAST, final.name + "\n")
                self._prune()
        barrier()
        if update_last:
            at_checkpoint(final.name, step)

    def remove(self, path: Path) -> None:
        if is_main_process():
            _remove(path)

    def latest(self) -> Path | None:
        """The checkpoint ``last`` names, if it is there; the same answer on every rank."""
        found = [None]
        if is_main_process():
            candidate = named_by_last(self.directory)
            found[0] = str(candidate) if candidate is not None and candidate.exists() else None
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


# ---------------------------------------------------------------- weights of any checkpoint

def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """``path`` itself, or the checkpoint that ``last`` names when ``path`` is a work_dir or
    its ``checkpoints`` directory. Raises FileNotFoundError saying what was looked for."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if not path.is_dir() or is_sharded_checkpoint(path) or is_deepspeed_checkpoint(path):
        return path
    for directory in (path, path / "checkpoints"):
        named = named_by_last(directory)
        if named is not None:
            if not named.exists():
                raise FileNotFoundError(f"{directory / LAST} names {named.name}, which is not "
                                        "there")
            return named
    raise FileNotFoundError(f"{path}: a directory that is not a checkpoint, and has no "
                            f"'{LAST}' or 'checkpoints/{LAST}' naming one")


def check_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint ``path`` names (see `resolve_checkpoint`), after a cheap look that it
    is one and holds only tensors and plain containers: the file itself (memory-mapped, so
    its tensors are not read), a sharded checkpoint's metadata, or a DeepSpeed checkpoint's
    train state and model files. What it does not read is read with weights_only on loading.
    Raises FileNotFoundError, ValueError or pickle.UnpicklingError, each with one line."""
    path = resolve_checkpoint(path)
    if is_sharded_checkpoint(path):
        check_metadata(path)
        return path
    files, guard = [path], refusing_unsafe(path)
    if is_deepspeed_checkpoint(path):
        files = [path / TRAIN_STATE, *sorted((path / TAG).glob("*mp_rank_00_model_states.pt"))]
        guard = weights_only_loads(path)
    with guard:
        for file in files:
            try:
                torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as error:
                if "mmap" not in str(error):  # else an older (non-zip) torch file: read it
                    raise
                torch.load(file, map_location="cpu", weights_only=True)
    return path


def read_weights(path: str | os.PathLike) -> dict[str, Tensor]:
    """The model's whole state, plain keys, from a checkpoint of any strategy (a file, a
    sharded directory or a DeepSpeed directory), read in this process with no group."""
    path = resolve_checkpoint(path)
    if is_deepspeed_checkpoint(path):
        return deepspeed_weights(path)
    if is_sharded_checkpoint(path):
        return sharded_model_weights(path)
    state = load_state_file(str(path))
    return state.get("model", state)
