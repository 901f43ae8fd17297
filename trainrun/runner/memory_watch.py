"""What a running job's rank holds, measured while it trains: the measured side of the
memory plan (`Strategy.memory_plan`), for bench/memory_plan.py and its test."""

from __future__ import annotations

from typing import Any

from trainrun.runner.hooks.base import Hook
from trainrun.wrappers.memory import PeakWatch


class _AfterEachStep(Hook):
    """Measures after each training step (ZeRO-3 gathers its small parameters again then)."""

    def __init__(self, watch: PeakWatch):
        self.watch = watch

    def after_train_iter(self, runner: Any, batch_idx: int, batch: Any,
                         outputs: Any = None) -> None:
        self.watch.take()


def watch_memory(runner: Any) -> PeakWatch:
    """A `PeakWatch` of ``runner``'s rank, measuring around each optimiser step, after each
    training step and wherever the strategy says its state peaks inside one; call its
    ``close()`` when training is done."""
    watch = PeakWatch(runner.optimizer, lambda: runner.strategy.state_tensors(
        runner.model, runner.optimizer))
    runner.hooks.append(_AfterEachStep(watch))
    runner.strategy.measure_inside_step(watch.take)
    return watch
