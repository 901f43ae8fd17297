"""Reading a run's ``metrics.jsonl`` in tests: every record, the training ones, the validation
ones, the losses."""

from __future__ import annotations

import json
import os
from pathlib import Path


def records(work_dir: str | os.PathLike) -> list[dict]:
    """Every line of the run's metrics.jsonl, in order."""
    lines = (Path(work_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def train_records(work_dir: str | os.PathLike) -> list[dict]:
    """The training lines (validation lines, and the mark a resume leaves, carry a
    ``mode``)."""
    return [r for r in records(work_dir) if "mode" not in r]


def val_records(work_dir: str | os.PathLike) -> list[dict]:
    """The validation lines (``mode`` val)."""
    return [r for r in records(work_dir) if r.get("mode") == "val"]


def losses(work_dir: str | os.PathLike) -> dict[int, float]:
    """The logged loss by step (a resume takes out the lines of the steps it trains again,
    so each step has one)."""
    return {r["step"]: r["loss"] for r in train_records(work_dir)}


def loss_list(work_dir: str | os.PathLike) -> list[tuple[int, float]]:
    """(step, loss) of every training line, in order, repeats included."""
    return [(r["step"], r["loss"]) for r in train_records(work_dir)]
