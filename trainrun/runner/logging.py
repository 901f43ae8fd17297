"""Where a run's messages go.

Rank 0 logs to the console and to the run directory's log (``train.log``; a test's
``test.log``); every other rank logs warnings and errors only, prefixed with its rank, so a
failure anywhere still reaches the console. The numbers go to ``metrics.jsonl``
(`trainrun.runner.run_dir.MetricsFile`).
"""

from __future__ import annotations

import logging
import os
import sys
from logging.handlers import MemoryHandler
from pathlib import Path

from trainrun.dist import get_rank

LOGGER_NAME = "trainrun"


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)


def setup_logging(log_file: Path | None = None, hold_for_file: bool = False) -> logging.Logger:
    """Configure the 'trainrun' logger for this rank (again from scratch on each call).
    ``hold_for_file``: keep the records until `attach_log_file` names the file they go to."""
    logger = get_logger()
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    logger.propagate = False
    logger.setLevel(logging.INFO)
    rank = get_rank()
    console = logging.StreamHandler(sys.stderr)
    console.addFilter(lambda record: not getattr(record, "file_only", False))
    if rank == 0:
        console.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s",
                                               "%Y-%m-%d %H:%M:%S"))
    else:
        console.setLevel(logging.WARNING)
        console.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(message)s"))
    logger.addHandler(console)
    if rank == 0 and log_file is not None:
        logger.addHandler(_file_handler(log_file))
    elif hold_for_file:
        logger.addHandler(MemoryHandler(capacity=100_000, flushLevel=logging.CRITICAL + 1))
    return logger


def log_restart(logger: logging.Logger) -> None:
    """Say when this process is a restart: torchrun's (``--max-restarts``, after a worker
    died) or a requeued SLURM job's."""
    torchrun = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    slurm = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    if torchrun:
        logger.warning("torchrun restarted the workers: restart %d of %s (--max-restarts)",
                       torchrun, os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?"))
    if slurm:
        logger.warning("SLURM started this job again: restart %d", slurm)


class LogFile(logging.FileHandler):
    """train.log. A record it cannot write (a full disk, a quota) is said in one line on
    stderr, once, instead of logging's traceback block for every record; the console still
    gets every record."""

    failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        error = sys.exc_info()[1]
        if self.failed or error is None:
            return
        self.failed = True
        stream, self.stream = self.stream, None  # what it holds cannot be written either
        try:
            if stream is not None:
                stream.close()
        except OSError:
            pass
        try:
            print(f"warning: cannot write {self.baseFilename}: {error}; its records go to the "
                  f"console only from now on", file=sys.stderr, flush=True)
        except (OSError, ValueError):  # stderr is gone too
            pass


def _file_handler(path: Path) -> logging.FileHandler:
    handler = LogFile(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    return handler


def attach_log_file(path: Path) -> None:
    """Log to ``path`` from now on, starting with the records held since `setup_logging`."""
    logger = get_logger()
    file_handler = _file_handler(path)
    for held in [h for h in logger.handlers if isinstance(h, MemoryHandler)]:
        held.setTarget(file_handler)
        held.flush()
        logger.removeHandler(held)
        held.close()
    logger.addHandler(file_handler)
