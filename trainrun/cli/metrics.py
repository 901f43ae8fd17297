"""Reading a run's ``metrics.jsonl`` back: the curves that tools/plot_metrics.py draws and
tools/sweep.py summarises."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

# Logged values that are the x axis or bookkeeping: every other number is a curve.
NOT_CURVES = {"step", "epoch", "mode"}

Series = dict[str, list[tuple[int, float]]]  # panel title -> (step, value) points


def read_run(run_dir: Path) -> tuple[Series, Series]:
    """The run's training and validation series, by key."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"RUN_DIR {str(run_dir)!r}: no metrics.jsonl there")
    train: Series = defaultdict(list)
    val: Series = defaultdict(list)
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            # a run killed mid-write leaves a cut last line; everything before it still counts
            print(f"warning: {path}:{number} is not JSON; skipped", file=sys.stderr)
            continue
        into = val if record.get("mode") == "val" else train
        for key, value in record.items():
            if key not in NOT_CURVES and isinstance(value, (int, float)):
                into[key].append((record["step"], float(value)))
    if not train and not val:
        raise ValueError(f"RUN_DIR {str(run_dir)!r}: metrics.jsonl holds no values yet")
    return train, val
