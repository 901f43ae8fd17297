"""``mmengine.optim``: the optimiser wrappers' and the learning-rate schedulers' names, as an
MMEngine config gives them to the compat Runner (``optim_wrapper=dict(type=AmpOptimWrapper,
...)``, ``param_scheduler=dict(type=MultiStepLR, ...)``). The Runner turns a wrapper into
trainrun's ``optim`` section and precision, and the schedulers into MMEngine's own rates
(``param_scheduler.py``). A name may be given as the class or as its string.
"""

from __future__ import annotations

from typing import Any

from trainrun.compat.mmengine.registry import OPTIM_WRAPPERS, PARAM_SCHEDULERS
from trainrun.runner.optim import OptimWrapper


class AmpOptimWrapper(OptimWrapper):
    """``OptimWrapper`` with autocast: MMEngine's name for mixed precision. Given as
    ``optim_wrapper=dict(type=AmpOptimWrapper, dtype=...)``, the compat Runner turns
    ``dtype`` ('float16', the default, or 'bfloat16') into trainrun's ``precision``."""


class SchedulerName:
    """An MMEngine learning-rate scheduler, by name: given in ``param_scheduler``, where the
    compat Runner steps MMEngine's formulas for it. It is not built by itself."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(f"{type(self).__name__} is stepped by the compat Runner: give it as "
                        f"param_scheduler=dict(type={type(self).__name__}, ...)")


class MultiStepLR(SchedulerName):
    """The rate times ``gamma`` at each of ``milestones``."""


class StepLR(SchedulerName):
    """The rate times ``gamma`` every ``step_size`` steps."""


class ExponentialLR(SchedulerName):
    """The rate times ``gamma`` every step."""


class ConstantLR(SchedulerName):
    """The rate times ``factor`` until ``end``."""


class LinearLR(SchedulerName):
    """The rate's factor going linearly from ``start_factor`` to ``end_factor``."""


class CosineAnnealingLR(SchedulerName):
    """The rate along half a cosine down to ``eta_min`` over ``T_max`` steps."""


class PolyLR(SchedulerName):
    """The rate along a polynomial of ``power`` down to ``eta_min``."""


class OneCycleLR(SchedulerName):
    """The rate up to ``eta_max`` and down far below its start, over ``total_steps``."""


OPTIM_WRAPPERS.register_module(module=OptimWrapper)
OPTIM_WRAPPERS.register_module(module=AmpOptimWrapper)
for _name in SchedulerName.__subclasses__():
    PARAM_SCHEDULERS.register_module(module=_name)

__all__ = ["AmpOptimWrapper", "ConstantLR", "CosineAnnealingLR", "ExponentialLR", "LinearLR",
           "MultiStepLR", "OneCycleLR", "OptimWrapper", "PolyLR", "StepLR"]
