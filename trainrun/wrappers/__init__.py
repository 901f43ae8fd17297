"""Model wrappers: one file per strategy, all behind the `Strategy` interface.

Adding a strategy is one new file with a ``Strategy`` subclass and one
``STRATEGIES.register`` line (below; the registry is ``trainrun.registry``'s). Everything
outside this package that depends on the strategy (building it, telling a wrapper from a plain
model) asks the registry; reading a checkpoint asks the checkpoint formats
(``trainrun.checkpoint``), never a strategy.
"""

from __future__ import annotations

from typing import Any

from trainrun.registry import STRATEGIES
from trainrun.wrappers.base import Strategy
from trainrun.wrappers.base_model import BaseModel, parse_losses
from trainrun.wrappers.contracts import ModelContract, OptimWrapperContract, StepOptimWrapper
from trainrun.wrappers.ddp import DDPStrategy, MMDistributedDataParallel
from trainrun.wrappers.deepspeed import DeepSpeedStrategy
from trainrun.wrappers.fsdp import FSDPStrategy, MMFullyShardedDataParallel
from trainrun.wrappers.separate_ddp import MMSeparateDistributedDataParallel, SeparateDDPStrategy
from trainrun.wrappers.single import SingleDeviceStrategy

STRATEGIES.register("none", SingleDeviceStrategy)
STRATEGIES.register("ddp", DDPStrategy)
STRATEGIES.register("separate_ddp", SeparateDDPStrategy)
STRATEGIES.register("deepspeed", DeepSpeedStrategy)
STRATEGIES.register("fsdp", FSDPStrategy)


def build_strategy(name: str, **options: Any) -> Strategy:
    """The strategy called ``name`` with ``options`` (those it does not take are an error)."""
    if name not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}; got {name!r}")
    return STRATEGIES[name](**options)


def is_model_wrapper(model: Any) -> bool:
    """Whether ``model`` is a registered strategy's wrapper (torch's DDP and FSDP included):
    of a class one of them declares in `Strategy.WRAPPERS`."""
    return any(cls.wraps(model) for cls in STRATEGIES.values())


__all__ = [
    "BaseModel",
    "DDPStrategy",
    "DeepSpeedStrategy",
    "FSDPStrategy",
    "MMDistributedDataParallel",
    "MMFullyShardedDataParallel",
    "MMSeparateDistributedDataParallel",
    "ModelContract",
    "OptimWrapperContract",
    "STRATEGIES",
    "SeparateDDPStrategy",
    "SingleDeviceStrategy",
    "StepOptimWrapper",
    "Strategy",
    "build_strategy",
    "is_model_wrapper",
    "parse_losses",
]
