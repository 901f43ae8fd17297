"""Seconds per iteration and waiting for data, for the log and the ETA."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from trainrun.runner.hooks.base import TIMER, Hook


class IterTimerHook(Hook):
    """Keeps the mean iteration and data times over the last ``window`` iterations."""

    priority = TIMER  # see hooks/base.py for the order

    def __init__(self, window: int = 50):
        self.iter_times: deque[float] = deque(maxlen=window)
        self.data_times: deque[float] = deque(maxlen=window)
        self._last = 0.0

    def before_train_epoch(self, runner: Any) -> None:
        self._last = time.perf_counter()

    def before_train_iter(self, runner: Any, batch_idx: int, batch: Any) -> None:
        self.data_times.append(time.perf_counter() - self._last)

    def after_train_iter(self, runner: Any, batch_idx: int, batch: Any,
                         outputs: dict[str, Any]) -> None:
        now = time.perf_counter()
        self.iter_times.append(now - self._last)
        self._last = now

    def after_val(self, runner: Any, metrics: dict[str, float]) -> None:
        self._last = time.perf_counter()  # validation time is not an iteration's

    @property
    def iter_time(self) -> float:
        return sum(self.iter_times) / len(self.iter_times) if self.iter_times else 0.0

    @property
    def data_time(self) -> float:
        return sum(self.data_times) / len(self.data_times) if self.data_times else 0.0

    def eta_seconds(self, remaining_iters: int) -> float:
        return self.iter_time * remaining_iters
