"""Runs validation every ``val_interval`` epochs (or iterations) and at the end of training,
from epoch (iteration) ``val_begin`` on."""

from __future__ import annotations

from typing import Any

from trainrun.runner.hooks.base import VALIDATION, Hook, every


class ValidationHook(Hook):
    priority = VALIDATION  # see hooks/base.py for the order

    def __init__(self, interval: int = 1, begin: int = 1):
        self.interval = interval
        self.begin = begin

    def _due(self, count: int, last: int) -> bool:
        return count >= self.begin and (every(count, self.interval) or count == last)

    def after_train_epoch(self, runner: Any) -> None:
        if runner.by_epoch and self._due(runner.epoch, runner.max_epochs):
            runner.val()

    def after_train_iter(self, runner: Any, batch_idx: int, batch: Any,
                         outputs: dict[str, Any]) -> None:
        if not runner.by_epoch and self._due(runner.iter, runner.max_iters):
            runner.val()
