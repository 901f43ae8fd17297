"""The exit codes of trainrun's processes, which the command lines, sweep and verify_resume read
and return, and how a refusal (exit 2) is said once for a job of several ranks. A leaf module,
so that every layer above ``dist/`` can import it (``dist/`` imports nothing else of trainrun;
its heartbeat writes EXIT_FAILED out as RANK_LOST_EXIT)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

EXIT_OK = 0
EXIT_FAILED = 1  # a failure while running (also a rank stopped because its job was lost)
EXIT_USAGE = 2  # a bad config or command line, said in one line; nothing was written
EXIT_PREEMPTED = 75  # sysexits' EX_TEMPFAIL: stopped on request after a checkpoint; resume
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)

# seconds a rank other than 0 waits, after a refusal every rank found, before it exits
REFUSAL_GRACE = 3.0


def say_refusal(line: str | None, stream: TextIO | None = None) -> None:
    """Say a refusal that every rank of a job finds alike (a bad config) once, from rank 0.

    Args:
        line: the refusal's one line, on rank 0 (or in a process of its own); None on the
            other ranks, which wait ``REFUSAL_GRACE`` seconds instead: torchrun, seeing one
            rank end, stops the others, rank 0 too, perhaps before it has said the line.
        stream: where the line goes; ``sys.stderr`` by default.
    """
    if line is None:
        time.sleep(REFUSAL_GRACE)
        return
    stream = stream or sys.stderr
    stream.write(line + "\n")
    stream.flush()
