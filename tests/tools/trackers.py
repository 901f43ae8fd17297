"""Trackers the command-line tests name by import path (``logging.backends=[tests.tools.
trackers.X]``), and a data set whose batches state their tokens."""

from __future__ import annotations

import json
import os
from pathlib import Path

from trainrun.examples.digits import DigitsDataset

CALLS = "tracker_calls.jsonl"  # where RecordingTracker writes, in the run directory


class RecordingTracker:
    """Writes every call it gets, with the rank of the process that made it, to `CALLS`
    (the interface by duck typing: no base class)."""

    def __init__(self):
        self.rank = int(os.environ.get("RANK", "0"))
        self.path: Path | None = None

    def _write(self, call: str, **details) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"call": call, "rank": self.rank, **details}) + "\n")

    def start(self, run_dir, config, resume):
        self.path = Path(run_dir) / CALLS
        self._write("start", run_dir=str(run_dir), config=config, resume=resume)

    def log(self, values, step):
        self._write("log", values=values, step=step)

    def finish(self):
        self._write("finish")


class NoFinish:
    def start(self, run_dir, config, resume): ...
    def log(self, values, step): ...


class NeedsArguments(RecordingTracker):
    def __init__(self, project):
        super().__init__()


NOT_A_CLASS = {"start": None}


class DigitsWithTokens(DigitsDataset):
    """The digits, each sample stating its 64 pixels as its tokens (collated: one count per
    sample)."""

    def __getitem__(self, index):
        return {**super().__getitem__(index), "num_tokens": 64}
