"""The runner's core: `Runner` (runner.py) and what it is built from: config, loops, hooks,
optimiser wrappers, schedulers, seeds. Checkpoints are in `trainrun.checkpoint`, the command
lines in `trainrun.cli`."""

from trainrun.runner.runner import Runner

__all__ = ["Runner"]
