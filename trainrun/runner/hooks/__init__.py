"""Hooks: logging, checkpointing, timing and validation are hooks, and so can be yours."""

from trainrun.registry import HOOKS
from trainrun.runner.hooks.base import Hook
from trainrun.runner.hooks.checkpoint import CheckpointHook
from trainrun.runner.hooks.early_stopping import EarlyStoppingHook
from trainrun.runner.hooks.ema import EMAHook
from trainrun.runner.hooks.logger import LoggerHook
from trainrun.runner.hooks.preemption import PreemptionHook
from trainrun.runner.hooks.profiler import ProfilerHook
from trainrun.runner.hooks.timer import IterTimerHook
from trainrun.runner.hooks.validation import ValidationHook

# the hooks a config's ``hooks:`` list names
HOOKS.register("EMA", EMAHook)
HOOKS.register("EarlyStopping", EarlyStoppingHook)
HOOKS.register("Profiler", ProfilerHook)

__all__ = ["CheckpointHook", "EarlyStoppingHook", "EMAHook", "Hook", "IterTimerHook", "LoggerHook",
           "PreemptionHook", "ProfilerHook", "ValidationHook"]
