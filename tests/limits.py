"""A file system that refuses writes, for the tests of what a full disk does: RLIMIT_FSIZE
makes a write past a size fail with EFBIG ("File too large") as a full disk's fails with
ENOSPC (Python ignores SIGXFSZ, so the write raises instead of killing the process)."""

from __future__ import annotations

import resource
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def files_limited_to(size: int) -> Iterator[None]:
    """No file of this process grows past ``size`` bytes inside the block."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
