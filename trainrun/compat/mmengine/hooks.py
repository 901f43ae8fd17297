"""``mmengine.hooks``: ``Hook`` with MMEngine's hook points, ``HookAdapter``, ``EMAHook`` and
the default hooks' names.

An MMEngine hook's points differ from trainrun's in a few names and arguments
(``after_val_epoch(runner, metrics)`` and ``after_val(runner)`` where trainrun has
``after_val(runner, metrics)``). Given to trainrun's Runner inside ``HookAdapter``, such a
hook has its MMEngine points called at the matching trainrun ones.
"""

from __future__ import annotations

from typing import Any

from trainrun.compat.mmengine.refusal import refused
from trainrun.runner.hooks.base import NORMAL
from trainrun.runner.hooks.base import Hook as _Hook
from trainrun.runner.hooks.ema import EMAHook as _EMAHook
from trainrun.runner.schema import ConfigError

# MMEngine's priority names and their numbers (lower runs first), as its ``Priority`` has them
PRIORITIES = {"HIGHEST": 0, "VERY_HIGH": 10, "HIGH": 30, "ABOVE_NORMAL": 40, "NORMAL": 50,
              "BELOW_NORMAL": 60, "LOW": 70, "VERY_LOW": 90, "LOWEST": 100}


class Hook:
    """Base class of an MMEngine-style hook: override the points you need; each does nothing
    by default. trainrun's Runner calls them through ``HookAdapter``."""

    priority: Any = "NORMAL"

    def before_run(self, runner: Any) -> None: ...
    def after_run(self, runner: Any) -> None: ...
    def before_train(self, runner: Any) -> None: ...
    def after_train(self, runner: Any) -> None: ...
    def before_train_epoch(self, runner: Any) -> None: ...
    def after_train_epoch(self, runner: Any) -> None: ...
    def before_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None: ...
    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None,
                         outputs: Any = None) -> None: ...
    def before_val(self, runner: Any) -> None: ...
    def after_val(self, runner: Any) -> None: ...
    def before_val_epoch(self, runner: Any) -> None: ...
    def after_val_epoch(self, runner: Any, metrics: dict | None = None) -> None: ...
    def before_test(self, runner: Any) -> None: ...
    def after_test(self, runner: Any) -> None: ...
    def before_test_epoch(self, runner: Any) -> None: ...
    def after_test_epoch(self, runner: Any, metrics: dict | None = None) -> None: ...


def priority_number(priority: Any) -> int:
    """A hook's priority as a number: MMEngine's names, or a number as it is.

    Raises:
        ValueError: an unknown name.
    """
    if isinstance(priority, str):
        if priority.upper() not in PRIORITIES:
            raise ValueError(f"hook priority {priority!r}: expected a number or one of "
                             f"{', '.join(PRIORITIES)}")
        return PRIORITIES[priority.upper()]
    return int(priority)


# MMEngine's hook points that trainrun's loops have no counterpart of, and why: a hook that
# overrides one is refused rather than never called
UNCALLED = {
    "before_val_iter": "validation calls no hook per batch",
    "after_val_iter": "validation calls no hook per batch",
    "before_test_iter": "testing calls no hook per batch",
    "after_test_iter": "testing calls no hook per batch",
    "before_save_checkpoint": "trainrun's checkpoint is put together from its parts",
    "after_load_checkpoint": "trainrun's resume loads the parts itself",
}


class OptimWrapperView:
    """trainrun's optimiser wrapper with MMEngine's ``get_lr()``: the rates by parameter
    group, ``{'lr': [...]}``; everything else is the wrapper's own."""

    def __init__(self, wrapper: Any, rates: list[float] | None = None) -> None:
        self._wrapper = wrapper
        self._rates = rates

    def get_lr(self) -> dict[str, list[float]]:
        """The rates of the iteration just trained, where the view knows them; else now."""
        if self._rates is not None:
            return {"lr": list(self._rates)}
        return {"lr": [group["lr"] for group in self._wrapper.optimizer.param_groups]}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapper, name)


class RunnerView:
    """trainrun's runner as an MMEngine hook sees it at one hook point.

    trainrun counts an iteration (``runner.iter``) before its ``after_train_iter`` hooks and an
    epoch (``runner.epoch``) before its ``after_train_epoch`` hooks; MMEngine counts them
    after. So at those points the view gives the 0-based iteration or epoch just trained, as
    MMEngine's runner does; after an iteration, ``optim_wrapper.get_lr()`` gives the rates it
    trained with (trainrun has already stepped its schedulers). Everything else is the
    runner's own.

    Args:
        runner: trainrun's runner.
        iter_offset: subtracted from ``runner.iter``.
        epoch_offset: subtracted from ``runner.epoch``.
        rates: the learning rates to report, by parameter group; None: the optimiser's now.
    """

    def __init__(self, runner: Any, iter_offset: int = 0, epoch_offset: int = 0,
                 rates: list[float] | None = None) -> None:
        self._runner = runner
        self._iter_offset = iter_offset
        self._epoch_offset = epoch_offset
        self._rates = rates

    @property
    def iter(self) -> int:
        return self._runner.iter - self._iter_offset

    @property
    def epoch(self) -> int:
        return self._runner.epoch - self._epoch_offset

    @property
    def work_dir(self) -> str:
        """The work directory, as MMEngine gives it: a string."""
        return str(self._runner.work_dir)

    @property
    def cfg(self) -> Any:
        """The MMEngine config the runner was built from (None without one)."""
        return getattr(self._runner, "mmengine_cfg", None)

    @property
    def optim_wrapper(self) -> OptimWrapperView:
        return OptimWrapperView(self._runner.optim_wrapper, self._rates)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)


class HookAdapter(_Hook):
    """One MMEngine-style hook, called at trainrun's hook points.

    Args:
        hook: the hook; its methods are found by MMEngine's names, so any object with some
            of them works (a subclass of the compat ``Hook`` or of nothing).
    """

    def __init__(self, hook: Any) -> None:
        for point in UNCALLED:
            own = getattr(type(hook), point, None)
            if own is not None and own is not getattr(Hook, point, None):
                raise ConfigError(f"{type(hook).__name__}.{point}: a hook point trainrun does "
                                  f"not call ({UNCALLED[point]}); move the work to another "
                                  f"point")
        self.hook = hook
        self.priority = priority_number(getattr(hook, "priority", NORMAL))
        self._rates: list[float] | None = None  # the rates of the iteration being trained

    def _call(self, name: str, runner: Any, *args: Any, iter_offset: int = 0,
              epoch_offset: int = 0, rates: list[float] | None = None) -> None:
        method = getattr(self.hook, name, None)
        if method is not None:
            method(RunnerView(runner, iter_offset, epoch_offset, rates), *args)

    def before_run(self, runner: Any) -> None:
        self._call("before_run", runner)

    def after_run(self, runner: Any) -> None:
        self._call("after_run", runner)

    def before_train(self, runner: Any) -> None:
        self._call("before_train", runner)

    def after_train(self, runner: Any) -> None:
        self._call("after_train", runner)

    def before_train_epoch(self, runner: Any) -> None:
        self._call("before_train_epoch", runner)

    def after_train_epoch(self, runner: Any) -> None:
        self._call("after_train_epoch", runner, epoch_offset=1)

    def before_train_iter(self, runner: Any, batch_idx: int, batch: Any) -> None:
        wrapper = getattr(runner, "optim_wrapper", None)
        optimizer = getattr(wrapper, "optimizer", None)
        self._rates = None if optimizer is None else [g["lr"] for g in optimizer.param_groups]
        self._call("before_train_iter", runner, batch_idx, batch)

    def after_train_iter(self, runner: Any, batch_idx: int, batch: Any,
                         outputs: dict[str, Any]) -> None:
        self._call("after_train_iter", runner, batch_idx, batch, outputs, iter_offset=1,
                   rates=self._rates)

    def before_val(self, runner: Any) -> None:
        self._call("before_val", runner)
        self._call("before_val_epoch", runner)

    def after_val(self, runner: Any, metrics: dict[str, float]) -> None:
        self._call("after_val_epoch", runner, metrics)
        self._call("after_val", runner)

    def before_test(self, runner: Any) -> None:
        self._call("before_test", runner)
        self._call("before_test_epoch", runner)

    def after_test(self, runner: Any, metrics: dict[str, float]) -> None:
        self._call("after_test_epoch", runner, metrics)
        self._call("after_test", runner)


class EMAHook(_EMAHook):
    """MMEngine's EMAHook: trainrun's exponential moving average of the weights, with
    MMEngine's arguments (``average = (1 - momentum) * average + momentum * weights``, every
    ``interval`` iterations; validation uses the average).

    Args:
        ema_type: only ``'ExponentialMovingAverage'``.
        strict_load: accepted as MMEngine's (trainrun always loads the whole average).
        begin_iter: only 0.
        begin_epoch: only 0.
        momentum: the weight of the new weights in each update.
        interval: update every this many iterations.
        update_buffers: only False (buffers are the model's own).

    Raises:
        ConfigError: an option trainrun's average cannot follow (named).
    """

    def __init__(self, ema_type: str = "ExponentialMovingAverage", strict_load: bool = False,
                 begin_iter: int = 0, begin_epoch: int = 0, momentum: float = 0.0002,
                 interval: int = 1, update_buffers: bool = False) -> None:
        for key, value, allowed in (("ema_type", ema_type, "ExponentialMovingAverage"),
                                    ("begin_iter", begin_iter, 0),
                                    ("begin_epoch", begin_epoch, 0),
                                    ("update_buffers", update_buffers, False)):
            if value != allowed:
                raise refused(f"EMAHook.{key}", value, f"use {allowed!r}")
        super().__init__(momentum=momentum, interval=interval)


class DefaultHookName:
    """One of MMEngine's default hooks, by name: given in ``default_hooks`` (``dict(type=
    CheckpointHook, interval=1)``), where the compat Runner reads its options into trainrun's
    own hooks. It is not built by itself."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(f"{type(self).__name__} is one of trainrun's own hooks: give its "
                        f"options in default_hooks, e.g. dict(type={type(self).__name__}, ...)")


class CheckpointHook(DefaultHookName):
    """``default_hooks.checkpoint``: interval, by_epoch, max_keep_ckpts, save_last, save_best
    and rule."""


class LoggerHook(DefaultHookName):
    """``default_hooks.logger``: interval."""


class IterTimerHook(DefaultHookName):
    """``default_hooks.timer``."""


class ParamSchedulerHook(DefaultHookName):
    """``default_hooks.param_scheduler``."""


class DistSamplerSeedHook(DefaultHookName):
    """``default_hooks.sampler_seed``."""


class RuntimeInfoHook(DefaultHookName):
    """``default_hooks.runtime_info``."""


# MMEngine's hook names that trainrun's own registry (shared by trainrun's configs) does not
# hold: the compat Runner's custom_hooks look them up here first
COMPAT_HOOKS = {"EMAHook": EMAHook}

__all__ = ["CheckpointHook", "DistSamplerSeedHook", "EMAHook", "Hook", "HookAdapter",
           "IterTimerHook", "LoggerHook", "ParamSchedulerHook", "RuntimeInfoHook"]
