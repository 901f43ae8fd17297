"""Reading a run's ``metrics.jsonl`` back: the curves that tools/plot_metrics.py draws and
tools/sweep.py summarises."""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

from trainrun.runner.run_dir import METRICS, RunDir

# Logged values that are the x axis or bookkeeping: every other number is a curve.
NOT_CURVES = {"step", "epoch", "mode"}

Series = dict[str, list[tuple[int, float]]]  # panel title -> (step, value) points


def read_run(run_dir: Path) -> tuple[Series, Series]:
    """The run's training and validation series, by key. Lines of another kind (the mark a
    resume leaves) are no curve's points."""
    run = RunDir(run_dir)
    if not run.metrics.is_file():
        raise ValueError(f"RUN_DIR {str(run_dir)!r}: no {METRICS} there")
    train: Series = defaultdict(list)
    val: Series = defaultdict(list)

    def skipped(number: int) -> None:
        # a run killed mid-write leaves a cut last line; everything before it still counts
        print(f"warning: {run.metrics}:{number} is not JSON; skipped", file=sys.stderr)

    for record in run.read_metrics(on_bad_line=skipped):
        mode = record.get("mode")
        if mode not in (None, "val"):
            continue
        into = val if mode == "val" else train
        for key, value in record.items():
            if key not in NOT_CURVES and isinstance(value, (int, float)):
                into[key].append((record["step"], float(value)))
    if not train and not val:
        raise ValueError(f"RUN_DIR {str(run_dir)!r}: {METRICS} holds no values yet")
    return train, val
