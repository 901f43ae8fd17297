"""The runner's core: `Runner` (runner.py) and what it is built from: config, loops, hooks,
checkpoints, optimiser wrappers, schedulers, seeds. The command lines are in `trainrun.cli`."""

from trainrun.runner.runner import Runner

__all__ = ["Runner"]
