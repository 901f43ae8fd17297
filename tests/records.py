"""Reading a run's ``metrics.jsonl`` in tests: every record, the training ones, the validation
ones, the losses, the gradient norms."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


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


def grad_norms(work_dir: str | os.PathLike) -> dict[int, float]:
    """The logged gradient norms by step (the steps that stepped the optimiser)."""
    return {r["step"]: r["grad_norm"] for r in records(work_dir) if "grad_norm" in r}


def assert_same_norms(a: dict[int, float], b: dict[int, float]) -> None:
    """The same steps, and at each a gradient norm within 1e-4 (relative) of the other's."""
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))  # (a helper: pytest does not explain it)
    for step, norm in a.items():
        assert b[step] == pytest.approx(norm, rel=1e-4), step
