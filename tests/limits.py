"""A file system that refuses writes, for the tests of what a full disk does: RLIMIT_FSIZE
makes a write past a size fail with EFBIG ("File too large") as a full disk's fails with
ENOSPC (Python ignores SIGXFSZ, so the write raises instead of killing the process)."""

from __future__ import annotations

import resource
from collections.abc import Iterator
from contextlib import contextmanager


def limit_files_to(size: int) -> None:
    """From now on, no file of this process (or of a process it starts) grows past ``size``
    bytes; also a ``preexec_fn`` for a child that should start so."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


@contextmanager
def files_limited_to(size: int) -> Iterator[None]:
    """No file of this process grows past ``size`` bytes inside the block."""
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    limit_files_to(size)
    try:
        yield
    finally:
        limit_files_to(soft)
