"""Writing files that a crash never leaves half-written, and hashing what is written.

The run directory's small files (``checkpoints/last``, ``config.yaml``) and the sweep's (its
manifest, statuses, summaries) are written through `replacing`; a checkpoint's files are put
on disk with `fsync_and_hash`, whose hashes the checkpoint's manifest takes
(`trainrun.checkpoint.manifest`).
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch

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


# ---------------------------------------------------------------- checkpoint files and hashes

def save_state_file(path: str | os.PathLike, state: Any) -> None:
    """Write ``state`` to ``path`` with torch.save, on disk (fsynced) when this returns."""
    with open(path, "wb") as f:
        torch.save(state, f)
        fsync_and_hash(f, path)


def copy_tensors(state: Any) -> Any:
    """``state`` with every tensor in its dicts, lists and tuples copied to new CPU memory:
    a snapshot that later training steps cannot change."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, Mapping):
        return {key: copy_tensors(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(copy_tensors(value) for value in state)
    return state


class BackgroundWriter:
    """Writes torch files (`save_state_file`) in a thread of its own, one after another, each
    from a snapshot of its state taken when it is asked for (`copy_tensors`)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def save(self, path: str | os.PathLike, state: Any) -> Future:
        """Write ``state`` to ``path`` in the background; the state may change as soon as this
        returns. None: nothing to write (a rank that writes no file).

        Returns:
            A future that ends (or raises) once the file is on disk.
        """
        if state is None:
            done: Future = Future()
            done.set_result(None)
            return done
        state = copy_tensors(state)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainrun-save")
        return self._pool.submit(save_state_file, path, state)

    def close(self) -> None:
        """Wait for the writes asked for to end."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def files_written_by(path: Path, rank: int, writer_rank: re.Pattern[str] | None) -> list[Path]:
    """The files of the checkpoint at ``path`` (a file, or a directory) that ``rank`` wrote:
    those whose names ``writer_rank`` matches with ``rank`` as its group 1; those it does not
    match (all, if it is None) are rank 0's."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return [file for file in files if _writer_rank(file.name, writer_rank) == rank]


def _writer_rank(name: str, writer_rank: re.Pattern[str] | None) -> int:
    found = writer_rank.search(name) if writer_rank is not None else None
    return int(found.group(1)) if found else 0


_CHUNK = 1 << 20
_KEPT = 1024  # hashes of written files kept at most (a checkpoint's manifest takes them)
_hashed_when_written: dict[str, tuple[tuple[int, int, int], str]] = {}
_hashed_lock = threading.Lock()


def sha256_of(path: str | os.PathLike) -> str:
    """The sha256 of the file at ``path``, read from it."""
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])  # hashlib lets other threads run meanwhile
    return digest.hexdigest()


def _file_identity(path: str | os.PathLike) -> tuple[int, int, int]:
    """What tells a file apart from a changed one: its inode, size and modification time."""
    found = os.stat(path)
    return found.st_ino, found.st_size, found.st_mtime_ns


def fsync_and_hash(f: IO[bytes], path: str | os.PathLike) -> None:
    """Put the file ``f`` (open at ``path``, completely written) on disk, and hash it from the
    page cache in another thread meanwhile: the hash costs no time of its own where the disk
    is the slower of the two. `written_sha256` hands it to the checkpoint's manifest."""
    f.flush()
    identity = _file_identity(path)
    hashed: list[str] = []
    hashing = threading.Thread(target=lambda: hashed.append(sha256_of(path)),
                               name="trainrun-hash")
    hashing.start()
    try:
        os.fsync(f.fileno())
    finally:
        hashing.join()
    with _hashed_lock:
        if len(_hashed_when_written) >= _KEPT:
            _hashed_when_written.clear()
        if hashed:
            _hashed_when_written[os.path.abspath(path)] = (identity, hashed[0])


def written_sha256(path: str | os.PathLike) -> str:
    """The sha256 of the file at ``path``: the one `fsync_and_hash` took when this process
    wrote it, if the file has not changed since (same inode, size and modification time);
    else read from the file."""
    with _hashed_lock:
        found = _hashed_when_written.pop(os.path.abspath(path), None)
    if found is not None and found[0] == _file_identity(path):
        return found[1]
    return sha256_of(path)
