"""Saves checkpoints every ``interval`` epochs (or iterations), the best on a validation
metric, and the last one at the end of training."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from trainrun.runner.config import best_rule_for
from trainrun.runner.hooks.base import CHECKPOINT, Hook, every
from trainrun.runner.logging import get_logger


class CheckpointHook(Hook):
    priority = CHECKPOINT  # see hooks/base.py for the order

    def __init__(self, interval: int = 1, save_last: bool = True, save_best: str | None = None,
                 best_rule: str | None = None, background: bool = False):
        self.interval = interval
        self.background = background  # periodic saves written while training goes on
        self.save_last = save_last
        self.save_best = save_best
        self.greater = (best_rule or best_rule_for(save_best or "")) == "greater"
        self.best_value: float | None = None
        self.best_path: str | None = None
        self._saved_at: int | None = None

    def _save(self, runner: Any, background: bool = False) -> None:
        if self._saved_at != runner.iter:
            runner.save_checkpoint(background=background)
            self._saved_at = runner.iter

    def after_train_epoch(self, runner: Any) -> None:
        if runner.by_epoch and every(runner.epoch, self.interval):
            self._save(runner, self.background)

    def after_train_iter(self, runner: Any, batch_idx: int, batch: Any,
                         outputs: dict[str, Any]) -> None:
        if self.background:
            runner.checkpoints.poll()  # publishes a background save once it is on disk
        if not runner.by_epoch and every(runner.iter, self.interval):
            self._save(runner, self.background)

    def after_train(self, runner: Any) -> None:
        if self.save_last:
            self._save(runner)  # in the foreground: the job ends next
        runner.checkpoints.finish()

    def after_val(self, runner: Any, metrics: dict[str, float]) -> None:
        if not (self.save_best and runner.training):
            return
        if self.save_best not in metrics:
            get_logger().warning("checkpoint.save_best=%r is not among the validation metrics "
                                 "%s; no best checkpoint is kept", self.save_best, list(metrics))
            self.save_best = None
            return
        value = metrics[self.save_best]
        if math.isnan(value) or not self._improves(value):
            return
        previous = self.best_path
        self.best_value = value
        self.best_path = str(runner.save_checkpoint(
            name=f"best_{self.save_best}_{runner.checkpoint_tag()}", update_last=False))
        if previous and previous != self.best_path:
            runner.checkpoints.remove(Path(previous))
        get_logger().info("new best %s %.6g saved", self.save_best, value)

    def _improves(self, value: float) -> bool:
        if self.best_value is None:
            return True
        return value > self.best_value if self.greater else value < self.best_value

    def state_dict(self) -> dict[str, Any]:
        return {"best_value": self.best_value, "best_path": self.best_path}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_value = state.get("best_value")
        self.best_path = state.get("best_path")
