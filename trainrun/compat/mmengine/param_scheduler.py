"""MMEngine's learning-rate schedulers, reproduced to the last bit.

MMEngine's schedulers are chained: each step multiplies (or moves) a parameter group's current
rate, by-iteration schedulers after every iteration and by-epoch ones after every epoch, in
the order the config lists them. ``mmengine_rates`` steps the same formulas on one group's
rate, for every iteration of the run, and ``MMEngineRates`` is the trainrun scheduler (stepped
once per iteration) that gives each iteration its rate. So a run's rates are MMEngine's, and a
resumed run finds them again from its step count.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from trainrun.compat.mmengine.refusal import refused, type_name
from trainrun.runner.schema import ConfigError

INF = int(1e9)  # MMEngine's "no end"


class Schedule(ABC):
    """One MMEngine scheduler's steps over a run.

    Args:
        begin: the first step (epoch or iteration) it acts on.
        end: the step it stops before.
        by_epoch: whether it steps after epochs (else after iterations).
    """

    def __init__(self, begin: int = 0, end: int = INF, by_epoch: bool = True) -> None:
        if end <= begin:
            raise ValueError(f"end ({end}) must be after begin ({begin})")
        self.begin, self.end, self.by_epoch = begin, end, by_epoch
        self.global_step = -1
        self.last_step = -1

    def step(self, value: float, base: float) -> float:
        """The rate after one more step, from the rate ``value`` now and the group's first
        rate ``base``."""
        self.global_step += 1
        if self.begin <= self.global_step < self.end:
            self.last_step += 1
            return self.value(value, base)
        return value

    @abstractmethod
    def value(self, value: float, base: float) -> float:
        """The rate at ``last_step`` (within begin and end), from the rate now."""


class MultiStep(Schedule):
    def __init__(self, milestones: Sequence[int], gamma: float = 0.1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.milestones, self.gamma = Counter(milestones), gamma

    def value(self, value: float, base: float) -> float:
        if self.last_step not in self.milestones:
            return value
        return value * self.gamma ** self.milestones[self.last_step]


class Step(Schedule):
    def __init__(self, step_size: int, gamma: float = 0.1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.step_size, self.gamma = step_size, gamma

    def value(self, value: float, base: float) -> float:
        if self.last_step == 0 or self.last_step % self.step_size != 0:
            return value
        return value * self.gamma


class Exponential(Schedule):
    def __init__(self, gamma: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gamma = gamma

    def value(self, value: float, base: float) -> float:
        return value if self.last_step == 0 else value * self.gamma


class Constant(Schedule):
    def __init__(self, factor: float = 1.0 / 3, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.factor, self.total = factor, self.end - self.begin - 1

    def value(self, value: float, base: float) -> float:
        if self.last_step == 0:
            return value * self.factor
        return value * (1.0 / self.factor) if self.last_step == self.total else value


class Linear(Schedule):
    def __init__(self, start_factor: float = 1.0 / 3, end_factor: float = 1.0,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.start, self.stop, self.total = start_factor, end_factor, self.end - self.begin - 1

    def value(self, value: float, base: float) -> float:
        if self.last_step == 0:
            return value * self.start
        change = self.stop - self.start
        return value * (1.0 + change / (self.total * self.start + (self.last_step - 1) * change))


class Cosine(Schedule):
    def __init__(self, T_max: int | None = None, eta_min: float | None = None,  # noqa: N803
                 eta_min_ratio: float | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if eta_min is not None and eta_min_ratio is not None:
            raise ValueError("give eta_min or eta_min_ratio, not both")
        self.period = T_max or (self.end - self.begin)
        self.eta_min = 0.0 if eta_min is None and eta_min_ratio is None else eta_min
        self.eta_min_ratio = eta_min_ratio

    def value(self, value: float, base: float) -> float:
        low = self.eta_min if self.eta_min_ratio is None else base * self.eta_min_ratio
        step, period = self.last_step, self.period
        if step == 0:
            return value
        if (step - 1 - period) % (2 * period) == 0:
            return value + (base - low) * (1 - math.cos(math.pi / period)) / 2
        return ((1 + math.cos(math.pi * step / period))
                / (1 + math.cos(math.pi * (step - 1) / period)) * (value - low) + low)


class Poly(Schedule):
    def __init__(self, eta_min: float = 0.0, power: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.eta_min, self.power, self.total = eta_min, power, self.end - self.begin - 1

    def value(self, value: float, base: float) -> float:
        if self.last_step == 0:
            return value
        return ((value - self.eta_min) * (1 - 1 / (self.total - self.last_step + 1)) ** self.power
                + self.eta_min)


# MMEngine's names, what each becomes, and which of its options count steps (scaled by the
# epoch's length where ``convert_to_iter_based`` turns epochs into iterations)
SCHEDULES: dict[str, tuple[type[Schedule], tuple[str, ...]]] = {
    "MultiStepLR": (MultiStep, ("milestones",)),
    "StepLR": (Step, ("step_size",)),
    "ExponentialLR": (Exponential, ()),
    "ConstantLR": (Constant, ()),
    "LinearLR": (Linear, ()),
    "CosineAnnealingLR": (Cosine, ("T_max",)),
    "PolyLR": (Poly, ()),
}


def build_schedule(key: str, cfg: Mapping[str, Any], epoch_length: int,
                   default_end: Callable[[bool], int]) -> Schedule:
    """One scheduler of MMEngine's ``param_scheduler``, as MMEngine's Runner builds it: ``end``
    defaults to the run's length (epochs or iterations, ``default_end(by_epoch)``), and
    ``convert_to_iter_based`` turns its epochs into iterations of ``epoch_length``.

    Raises:
        ConfigError: an unknown type, or options the scheduler does not take (named).
    """
    cfg = dict(cfg)
    name = type_name(cfg.pop("type", None))
    if name not in SCHEDULES:
        raise refused(f"{key}.type", name,
                      f"the learning-rate schedulers are {', '.join(SCHEDULES)}")
    cls, counted = SCHEDULES[name]
    by_epoch = cfg.pop("by_epoch", True)
    convert = cfg.pop("convert_to_iter_based", False)
    cfg.setdefault("end", default_end(by_epoch))
    if by_epoch and convert:
        by_epoch = False
        for option in ("begin", "end", *counted):
            if option in cfg and cfg[option] is not None and cfg[option] != INF:
                value = cfg[option]
                cfg[option] = [v * epoch_length for v in value] if isinstance(value, list) \
                    else int(value * epoch_length)
    try:
        return cls(by_epoch=by_epoch, **cfg)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{key}: {name} {error}") from None


def mmengine_rates(schedules: Sequence[Schedule], base: float, total_iters: int,
                   epoch_length: int | None) -> list[float]:
    """The rate of each of ``total_iters`` iterations for a group whose first rate is
    ``base``: each schedule steps once when built, then by-iteration ones after every
    iteration and by-epoch ones after every ``epoch_length`` iterations (None: never, as in
    an iteration-based run)."""
    value = base
    for schedule in schedules:
        value = schedule.step(value, base)
    rates = []
    for i in range(total_iters):
        rates.append(value)
        for schedule in schedules:
            if not schedule.by_epoch:
                value = schedule.step(value, base)
        if epoch_length and (i + 1) % epoch_length == 0:
            for schedule in schedules:
                if schedule.by_epoch:
                    value = schedule.step(value, base)
    return rates


class MMEngineRates(LRScheduler):
    """A trainrun scheduler that gives every iteration MMEngine's rate, per parameter group.

    Args:
        optimizer: the optimiser whose groups it sets.
        rates: for each parameter group, the rate of every iteration of the run.
    """

    def __init__(self, optimizer: Optimizer, rates: list[list[float]]) -> None:
        self.rates = rates
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        step = min(self.last_epoch, len(self.rates[0]) - 1)
        return [group_rates[step] for group_rates in self.rates]

    def state_dict(self) -> dict[str, Any]:
        """The step count and the torch scheduler's fields; the rates are made again."""
        return {k: v for k, v in super().state_dict().items() if k != "rates"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The step count back, and the groups' rates for it."""
        super().load_state_dict(state_dict)
        for group, rate in zip(self.optimizer.param_groups, self.get_lr(), strict=True):
            group["lr"] = rate
        self._last_lr = self.get_lr()


def scheduler_factory(cfg: Any, epoch_length: int | None, max_epochs: int | None
                      ) -> Callable[[Optimizer, int], MMEngineRates]:
    """What trainrun's Runner takes as ``scheduler``: a function that makes the
    ``MMEngineRates`` of an optimiser for MMEngine's ``param_scheduler`` (one dict or a list).

    Args:
        cfg: MMEngine's ``param_scheduler``.
        epoch_length: iterations per epoch (the train loader's length); None for an
            iteration-based run.
        max_epochs: the run's epochs; None for an iteration-based run.
    """
    items = list(cfg) if isinstance(cfg, Sequence) else [cfg]
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise refused(f"param_scheduler[{i}]", item, "give config dicts")

    def make(optimizer: Optimizer, total_iters: int) -> MMEngineRates:
        def default_end(by_epoch: bool) -> int:
            return max_epochs if by_epoch and max_epochs is not None else total_iters

        rates = []
        for group in optimizer.param_groups:
            schedules = [build_schedule(f"param_scheduler[{i}]", item, epoch_length or 1,
                                        default_end) for i, item in enumerate(items)]
            rates.append(mmengine_rates(schedules, group.get("initial_lr", group["lr"]),
                                        total_iters, epoch_length))
        return MMEngineRates(optimizer, rates)

    for i, item in enumerate(items):  # a bad option is refused now, before the run is built
        build_schedule(f"param_scheduler[{i}]", item, epoch_length or 1, lambda _: INF)
    return make


__all__ = ["MMEngineRates", "mmengine_rates", "scheduler_factory"]
