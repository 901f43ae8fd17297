"""The optimiser, in one package: built from the config's ``optim`` section (``factory``),
over parameter groups (``param_groups``, from ``optim.paramwise``), wrapped for accumulation,
clipping and mixed precision (``wrapper``), with its learning-rate schedule (``schedulers``);
``section`` checks the ``optim`` section.

The names below are the package's public ones; the rest is imported from its modules.
"""

from trainrun.runner.optim.factory import build_optimizer, optimizer_factory, wrap_optimizers
from trainrun.runner.optim.schedulers import build_scheduler
from trainrun.runner.optim.wrapper import OptimWrapper, OptimWrapperDict

__all__ = [
    "OptimWrapper",
    "OptimWrapperDict",
    "build_optimizer",
    "build_scheduler",
    "optimizer_factory",
    "wrap_optimizers",
]
