"""Naming, publishing and pruning checkpoints in ``work_dir/checkpoints``, and finding one by
name (the one ``last`` names, a run directory's newest).

A checkpoint is written by the strategy under a temporary name (one file, or a directory of
shards), hashed by the ranks that wrote it, given its manifest (`trainrun.checkpoint.manifest`),
then renamed by rank 0; ``checkpoints/last`` is rewritten after that. A crash at any moment
therefore leaves the previous checkpoint in charge, and a half-written one is never visible
under a real name.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from trainrun.checkpoint.files import TMP_PREFIX, fsync_dir, write_atomically
from trainrun.checkpoint.format import is_checkpoint
from trainrun.checkpoint.manifest import hash_files, is_sidecar, sidecar, write_manifest
from trainrun.dist import (
    all_reduce,
    at_checkpoint,
    barrier,
    gather_object,
    get_rank,
    is_main_process,
)
from trainrun.messages import first_line, human

CHECKPOINTS_DIR = "checkpoints"  # where a run directory keeps its checkpoints (and LAST)
LAST = "last"
MAX_KEEP = 3  # periodic checkpoints kept by default
# a periodic checkpoint's name: iter_N, epoch_N, or epoch_N_iter_M (a stop M steps into the run,
# inside the epoch after the N-th)
_STEP = re.compile(r"^(epoch|iter)_(\d+)(?:_iter_(\d+))?")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _remove_checkpoint(path: Path) -> None:
    """A checkpoint and its sidecar manifest (a one-file checkpoint's)."""
    _remove(path)
    _remove(sidecar(path))


def _periodic_step(name: str) -> tuple[str, tuple[int, int]] | None:
    """The kind ('iter' or 'epoch') and the place, which orders the checkpoints of a kind, of
    a periodic checkpoint's name, else None: ``iter_N.pth`` is ('iter', (N, 0)),
    ``epoch_N.pth`` ('epoch', (N, 0)), and ``epoch_N_iter_M.pth``, inside the next epoch,
    ('epoch', (N, M))."""
    found = _STEP.match(name)
    if not found or is_sidecar(name):
        return None
    return found.group(1), (int(found.group(2)), int(found.group(3) or 0))


class CheckpointWriter(Protocol):
    """What the manager asks of a strategy (``trainrun.wrappers.Strategy``): to write a
    checkpoint on every rank, in the foreground or the background, and to name the files of
    it a rank wrote."""

    def save_checkpoint(self, path: str, model: nn.Module, optimizer: Any,
                        extra: dict[str, Any]) -> None: ...

    def save_checkpoint_async(self, path: str, model: nn.Module, optimizer: Any,
                              extra: dict[str, Any]) -> Future: ...

    def own_files(self, path: str | os.PathLike, rank: int) -> list[Path]: ...


@dataclass
class _PendingSave:
    """A background save not yet published: its future (this rank's hashes, once its part
    is written), where it is written and where it goes."""

    future: Future
    tmp: Path
    final: Path
    update_last: bool
    step: int


class CheckpointNotWritten(RuntimeError):
    """A checkpoint could not be written (a full disk, a quota, a lost mount); the message
    says why, how much room is left where it is written, and which checkpoint the run still
    has. This rank's part of it is removed, and ``last`` still names the one before."""


def _root_cause(error: BaseException) -> BaseException:
    """The OSError behind ``error``, looked for among its causes and, for DCP's
    CheckpointException, among the ranks' failures it holds; else ``error`` itself. (torch's
    file writer reports a full disk as "unexpected pos", the OSError only as its context.)"""
    todo, seen = [error], set()
    while todo:
        each = todo.pop(0)
        if id(each) in seen:
            continue
        seen.add(id(each))
        if isinstance(each, OSError):
            return each
        failures = getattr(each, "failures", None)  # DCP's: {rank: (exception, traceback)}
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [c for c in (each.__cause__, each.__context__) if c is not None]
    return error


def _room(directory: Path) -> str:
    """How much room the file system of ``directory`` has left, in words."""
    try:
        return f"{human(shutil.disk_usage(directory).free)} free"
    except OSError:
        return "free space unknown"


def _not_written(final: Path, error: BaseException | None) -> CheckpointNotWritten:
    """The error that says checkpoint ``final`` was not written because of ``error`` (None:
    another rank's part failed)."""
    if error is None:
        why = "another rank could not write its part"
    else:
        cause = _root_cause(error)
        why = cause.strerror if isinstance(cause, OSError) and cause.strerror else \
            f"{type(cause).__name__}: {first_line(cause)}"
    before = named_by_last(final.parent)
    kept = f"{before.name} is still the newest" if before is not None else \
        "the run has no checkpoint before it"
    return CheckpointNotWritten(f"checkpoint {final.name} not written: {why} "
                                f"({_room(final.parent)} in {final.parent}); {kept}")


def named_by_last(directory: Path) -> Path | None:
    """The checkpoint that ``directory/last`` names (there or not); None without ``last``."""
    last = directory / LAST
    if not last.is_file():
        return None
    return directory / last.read_text(encoding="utf-8").strip()


class CheckpointManager:
    """Saves through ``strategy`` into ``directory``, keeping at most ``max_keep`` periodic
    checkpoints (-1: all); the newest and the best are never pruned."""

    def __init__(self, directory: Path, strategy: CheckpointWriter, max_keep: int = MAX_KEEP,
                 suffix: str = ".pth"):
        self.directory = directory
        self.strategy = strategy
        self.max_keep = max_keep
        self.suffix = suffix
        self._pending: _PendingSave | None = None  # a background save not yet published
        self.last_saved: Path | None = None  # the newest save asked for (maybe still writing)
        # (path, step) of the newest checkpoint this run stands on: published by it with
        # ``last`` pointed at it, or the one it resumed from
        self.published: tuple[Path, int] | None = None

    def clean_partial(self) -> None:
        """Remove what a crash during a save left behind (rank 0; call before saving): what
        is under a temporary name, and a sidecar whose checkpoint was never renamed to its
        name."""
        if is_main_process() and self.directory.is_dir():
            for entry in self.directory.iterdir():
                if entry.name.startswith(TMP_PREFIX) or (
                        is_sidecar(entry.name) and not entry.with_suffix("").exists()):
                    _remove(entry)

    def save(self, name: str, model: nn.Module, optimizer: Any,
             extra: dict[str, Any], update_last: bool = True, background: bool = False,
             step: int = 0) -> Path:
        """Write checkpoint ``name`` (the state after ``step`` steps) on every rank and publish
        it; returns its path.

        With ``background``, this returns once the state is copied in memory; the checkpoint
        is published by a later `poll` or `finish`, when every rank's part is on disk. A
        background save still running is finished first.

        Raises:
            CheckpointNotWritten: when the file system refused this rank's part (a full disk,
                a quota); its part is removed, and ``last`` still names the checkpoint before.
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
            written = self.strategy.save_checkpoint_async(str(tmp), model, optimizer, extra)
            self._pending = _PendingSave(self._hash_when_written(written, tmp, final), tmp, final,
                                     update_last, step)
            return final
        try:
            self.strategy.save_checkpoint(str(tmp), model, optimizer, extra)
        except BaseException as error:  # noqa: B036 - DCP's errors are BaseExceptions
            if not isinstance(_root_cause(error), OSError):
                raise  # not the file system's: the error as it is
            # DCP's error comes to every rank (it holds the failures of all): they clean up
            # together; a one-file checkpoint's writer fails alone
            self._discard_own(tmp, together=isinstance(getattr(error, "failures", None), dict))
            raise _not_written(final, error) from error
        self._publish(tmp, final, update_last, step, self._hash_own_files(tmp, final))
        return final

    def _discard_own(self, tmp: Path, together: bool = False) -> None:
        """Remove the files of the unfinished checkpoint ``tmp`` that this rank wrote; with
        ``together`` (every rank is here), then the rest of it. Whatever is left (a rank
        that failed alone cannot wait for the others) goes when the run resumes, or at the
        next save (`clean_partial`)."""
        if tmp.exists():
            for path in self.strategy.own_files(tmp, get_rank()):
                path.unlink(missing_ok=True)
        if together:
            barrier()
        if is_main_process() and tmp.is_dir():
            if together:
                _remove(tmp)
            else:
                try:
                    tmp.rmdir()  # empty once every rank has removed its files
                except OSError:
                    pass

    def _hash_own_files(self, tmp: Path, final: Path) -> dict[str, str]:
        """The sha256 of the files of checkpoint ``tmp`` this rank wrote (read back from its
        page cache), by their names in the manifest."""
        return hash_files(self.strategy.own_files(tmp, get_rank()), tmp, final)

    def _hash_when_written(self, written: Future, tmp: Path, final: Path) -> Future:
        """A future of this rank's hashes, computed by a thread of its own once ``written``
        (this rank's part of a background save) is done: the save counts as done only then,
        and training does not wait for the hashing."""
        hashed: Future = Future()

        def work() -> None:
            try:
                written.result()
                hashed.set_result(self._hash_own_files(tmp, final))
            except BaseException as error:  # noqa: B036 - DCP's errors are BaseExceptions
                hashed.set_exception(error)

        threading.Thread(target=work, name="trainrun-hash", daemon=True).start()
        return hashed

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
        any rank raises `CheckpointNotWritten` on every rank, the save's files removed and
        ``last`` left where it was."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        error = pending.future.exception()
        failed = torch.tensor([0 if error is None else 1])
        all_reduce(failed, op="max")
        if failed.item():
            self._discard_own(pending.tmp, together=True)
            raise _not_written(pending.final, error) from error
        self._publish(pending.tmp, pending.final, pending.update_last, pending.step,
                      pending.future.result())

    def abandon(self) -> None:
        """Let a background save that will not be published (training failed) end on this
        rank; what it wrote stays under its temporary name, which the next save removes."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.future.exception()  # waits; a write that failed is of no use now either

    def _publish(self, tmp: Path, final: Path, update_last: bool, step: int,
                 hashes: dict[str, str]) -> None:
        """Write the manifest of a complete checkpoint with every rank's ``hashes``, rename the
        checkpoint to its name and point ``last`` at it (rank 0); the heartbeat then knows
        where a restart would continue from (`at_checkpoint`)."""
        every_rank = gather_object(hashes, dst=0)  # and every rank's part is on disk
        if is_main_process():
            try:
                write_manifest(tmp, final, {k: v for part in every_rank for k, v in part.items()})
            except OSError as error:  # every rank's part is written: this rank removes it all
                _remove(tmp)
                raise _not_written(final, error) from error
            if tmp.is_dir() or (final.is_dir() and not final.is_symlink()):
                _remove(final)  # only a file is renamed over a file (atomically)
            if tmp.is_dir():
                _remove(sidecar(final))  # a one-file checkpoint's, of the same name
            os.replace(tmp, final)
            fsync_dir(self.directory)
            if update_last:
                write_atomically(self.directory / LAST, final.name + "\n")
                self._prune(final.name)
        barrier()
        if update_last:
            self.published = (final, step)
            at_checkpoint(final.name, step)

    def remove(self, path: Path) -> None:
        if is_main_process():
            _remove_checkpoint(path)

    def _prune(self, newest: str) -> None:
        """Remove the periodic checkpoints of the lowest steps beyond ``max_keep``, never
        ``newest``, which ``last`` names: a new run in the directory of an older, longer one
        writes lower steps than that run's, and its own checkpoint is the one to keep."""
        if self.max_keep < 0:
            return
        others = sorted((step[1], entry) for entry in self.directory.iterdir()
                        if (step := _periodic_step(entry.name)) and entry.name != newest)
        keep = max(self.max_keep, 1) - 1  # the newest is one of those kept
        for _, entry in others[: max(len(others) - keep, 0)]:
            _remove_checkpoint(entry)


# ---------------------------------------------------------------- finding checkpoints by name

def checkpoints_in(path: str | os.PathLike) -> Path | None:
    """The directory whose ``last`` names the newest checkpoint: ``path`` itself, or
    ``path/checkpoints`` for a work_dir; None where neither has ``last``."""
    for directory in (Path(path), Path(path) / CHECKPOINTS_DIR):
        if (directory / LAST).is_file():
            return directory
    return None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """``path`` itself, or the checkpoint that ``last`` names when ``path`` is a work_dir or
    its ``checkpoints`` directory. Raises FileNotFoundError saying what was looked for."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if is_checkpoint(path):
        return path
    directory = checkpoints_in(path)
    if directory is None:
        raise FileNotFoundError(f"{path}: a directory that is not a checkpoint, and has no "
                                f"'{LAST}' or '{CHECKPOINTS_DIR}/{LAST}' naming one")
    named = named_by_last(directory)
    if not named.exists():
        raise FileNotFoundError(f"{directory / LAST} names {named.name}, which is not there")
    return named


def newest_first(directory: Path) -> list[Path]:
    """The checkpoint ``directory/last`` names, then the older periodic ones of its kind
    (``iter_N``, or ``epoch_N`` and ``epoch_N_iter_M``), newest first; none if ``last`` names
    nothing that is there."""
    newest = named_by_last(directory)
    if newest is None or not newest.exists():
        return []
    kind, step = _periodic_step(newest.name) or ("", (-1, 0))
    older = sorted((found[1], entry) for entry in directory.iterdir()
                   if (found := _periodic_step(entry.name)) and found[0] == kind
                   and found[1] < step)
    return [newest, *(entry for _, entry in reversed(older))]
