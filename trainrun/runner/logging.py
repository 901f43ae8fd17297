"""Where a run's messages and numbers go.

Rank 0 logs to the console and to ``train.log``; every other rank logs warnings and errors
only, prefixed with its rank, so a failure anywhere still reaches the console.
``metrics.jsonl`` gets one JSON object per line from rank 0.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from logging.handlers import MemoryHandler
from pathlib import Path
from typing import Any, TextIO

from trainrun.dist import get_rank, master_only

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


def _plain(value: Any) -> Any:
    """A JSON-ready value: tensors and numpy scalars as Python numbers, full precision."""
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN or Infinity
    return value


class MetricsFile:
    """Appends one JSON object per line to ``metrics.jsonl``; writes on rank 0 only. A line
    that a killed run left cut short is ended first, so a resumed run's lines stay whole.
    The file stays open between lines (opening it costs about as much as the line itself)
    and each line is flushed as it is written, so a killed run loses none."""

    def __init__(self, path: Path):
        self.path = path
        self._file: TextIO | None = None

    @master_only
    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps({key: _plain(value) for key, value in record.items()}) + "\n"
        if self._file is None:
            if self.path.is_file() and self.path.stat().st_size:
                with open(self.path, "rb") as f:
                    f.seek(-1, 2)
                    if f.read(1) != b"\n":
                        line = "\n" + line
            self._file = open(self.path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
        self._file.write(line)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
