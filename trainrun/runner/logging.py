"""Where a run's messages and numbers go.

Rank 0 logs to the console and to ``train.log``; every other rank logs warnings and errors
only, prefixed with its rank, so a failure anywhere still reaches the console.
``metrics.jsonl`` gets one JSON object per line from rank 0.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

from trainrun.dist import get_rank, master_only

LOGGER_NAME = "trainrun"


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)


def setup_logging(log_file: Path | None = None) -> logging.Logger:
    """Configure the 'trainrun' logger for this rank (again from scratch on each call)."""
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
        file_handler = logging.FileHandler(log_file, encoding="utf-8")
        file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(file_handler)
    return logger


def _plain(value: Any) -> Any:
    """A JSON-ready value: tensors and numpy scalars as Python numbers, full precision."""
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN or Infinity
    return value


class MetricsFile:
    """Appends one JSON object per line to ``metrics.jsonl``; writes on rank 0 only."""

    def __init__(self, path: Path):
        self.path = path

    @master_only
    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps({key: _plain(value) for key, value in record.items()})
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
