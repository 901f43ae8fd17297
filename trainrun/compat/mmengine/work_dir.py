"""MMEngine's work directory layout on trainrun's run directory: the checkpoints
(``epoch_N.pth``, ``iter_N.pth``) in the work directory itself, and ``last_checkpoint`` there
holding the absolute path of the newest, as MMEngine's tools read it. trainrun's own files
(``metrics.jsonl``, ``train.log``, ``config.yaml``, the lock, each checkpoint's hash) sit
beside them, and trainrun's ``last`` names the newest too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainrun.checkpoint.files import write_atomically
from trainrun.checkpoint.manager import named_by_last
from trainrun.runner.hooks.base import CHECKPOINT, Hook
from trainrun.runner.run_dir import RunDir

LAST_CHECKPOINT = "last_checkpoint"  # MMEngine's: the newest checkpoint's absolute path


class MMEngineRunDir(RunDir):
    """A run directory whose checkpoints are in the directory itself, as MMEngine keeps them.

    Args:
        path: the work directory (it need not exist yet).
    """

    @property
    def checkpoints(self) -> Path:
        """The checkpoints, and ``last`` naming the newest: the work directory itself."""
        return self.path

    @property
    def last_checkpoint(self) -> Path:
        """MMEngine's ``last_checkpoint``: the newest checkpoint's absolute path."""
        return self.path / LAST_CHECKPOINT


class LastCheckpointFile(Hook):
    """Rank 0 keeps ``last_checkpoint`` naming the checkpoint trainrun's ``last`` names, once
    it is published (after the checkpoint hook, and at the end of training for one written
    in the background)."""

    priority = CHECKPOINT + 1

    def __init__(self, run_dir: MMEngineRunDir) -> None:
        self.run_dir = run_dir
        self.written: Path | None = None

    def _update(self, runner: Any) -> None:
        if runner.rank != 0:
            return
        newest = named_by_last(self.run_dir.checkpoints)
        if newest is not None and newest.exists() and newest != self.written:
            write_atomically(self.run_dir.last_checkpoint, str(newest.resolve()))
            self.written = newest

    def after_train_iter(self, runner: Any, batch_idx: int, batch: Any,
                         outputs: dict[str, Any]) -> None:
        self._update(runner)

    def after_train_epoch(self, runner: Any) -> None:
        self._update(runner)

    def after_train(self, runner: Any) -> None:
        self._update(runner)

    def after_run(self, runner: Any) -> None:
        self._update(runner)
