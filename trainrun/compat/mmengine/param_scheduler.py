"""MMEngine's learning-rate schedulers, reproduced to the last bit.

MMEngine's schedulers are chained: each step multiplies (or moves) a parameter group's current
rate, by-iteration schedulers after every iteration and by-epoch ones after every epoch, in
the order the config lists them (``OneCycleLR`` alone sets the rate outright).
``mmengine_rates`` steps the same formulas on one group's rate, for every iteration of the
run, and ``MMEngineRates`` is the trainrun scheduler (stepped once per iteration) that gives
each iteration its rate. So a run's rates are MMEngine's, and a resumed run finds them again
from its step count.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

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

    # options MMEngine's scheduler does not take though a similar one (torch's) does, and
    # what to give instead
    refusals: ClassVar[dict[str, str]] = {}
    # options given as one value per parameter group
    per_group: ClassVar[tuple[str, ...]] = ()

    def __init__(self, begin: int = 0, end: int = INF, by_epoch: bool = True) -> None:
        if end <= begin:
            raise ValueError(f"end ({end}) must be after begin ({begin})")
        self.begin, self.end, self.by_epoch = begin, end, by_epoch
        self.global_step = -1
        self.last_step = -1
        self.label = type(self).__name__  # how its messages name it

    def first_rate(self, base: float) -> float:
        """The group's first rate for the schedules built after this one, from the rate
        ``base`` it was before: unchanged, but for ``OneCycle``."""
        return base

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


class OneCycle(Schedule):
    """MMEngine's ``OneCycleLR``: the rate climbs from ``eta_max / div_factor`` to ``eta_max``
    over the first ``pct_start`` of ``total_steps``, then anneals down to
    ``eta_max / div_factor / final_div_factor``; with ``three_phase`` it first anneals back to
    the start, symmetrically, and only then down.

    It sets the rate outright rather than scaling it, and (as MMEngine's writes its start into
    the group's ``initial_lr``) its start becomes the first rate of the schedules listed after
    it. Momentum is not cycled: MMEngine 0.10.7's ``OneCycleLR`` schedules the rate only.

    Args:
        eta_max: the highest rate (required).
        total_steps: the cycle's length in steps; None: from ``begin`` to ``end``.
        pct_start: the share of the cycle spent climbing, between 0 and 1.
        anneal_strategy: 'cos' (half a cosine) or 'linear'.
        div_factor: ``eta_max`` over the starting rate.
        final_div_factor: the starting rate over the final one.
        three_phase: whether to anneal back to the start before annealing down.
    """

    refusals: ClassVar[dict[str, str]] = {
        "max_lr": "MMEngine's OneCycleLR names the highest rate eta_max",
        **dict.fromkeys(("epochs", "steps_per_epoch"), "MMEngine's OneCycleLR takes total_steps,"
                        " or cycles from begin to end"),
        **dict.fromkeys(("cycle_momentum", "base_momentum", "max_momentum"),
                        "MMEngine 0.10.7's OneCycleLR cycles the learning rate only, never"
                        " momentum: leave the option out"),
    }
    per_group = ("eta_max",)

    def __init__(self, eta_max: float | None = None, total_steps: int | None = None,
                 pct_start: float = 0.3, anneal_strategy: str = "cos", div_factor: float = 25.0,
                 final_div_factor: float = 1e4, three_phase: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if eta_max is None:
            raise ValueError("needs eta_max, the highest rate of the cycle")
        for option, number in (("eta_max", eta_max), ("div_factor", div_factor),
                               ("final_div_factor", final_div_factor)):
            if isinstance(number, bool) or not isinstance(number, int | float) or number <= 0:
                raise ValueError(f"{option} ({number!r}) must be a positive number")
        if total_steps is None:
            total_steps = self.end - self.begin
        elif isinstance(total_steps, bool) or not isinstance(total_steps, int) \
                or total_steps <= 0:
            raise ValueError(f"total_steps ({total_steps!r}) must be a positive integer")
        if not isinstance(pct_start, float) or not 0 < pct_start < 1:
            raise ValueError(f"pct_start ({pct_start!r}) must be a float between 0 and 1 "
                             "(both excluded)")
        if anneal_strategy not in ("cos", "linear"):
            raise ValueError(f"anneal_strategy ({anneal_strategy!r}) must be 'cos' or 'linear'")
        self.total_steps, self.pct_start = total_steps, pct_start
        self.anneal = self.cosine if anneal_strategy == "cos" else self.linear
        self.start = eta_max / div_factor
        self.low = self.start / final_div_factor
        # each phase: the step it ends at (a float, as MMEngine's), the rates it goes between
        climb_end = float(pct_start * total_steps) - 1
        if three_phase:
            self.phases = [(climb_end, self.start, eta_max),
                           (float(2 * pct_start * total_steps) - 2, eta_max, self.start),
                           (total_steps - 1, self.start, self.low)]
        else:
            self.phases = [(climb_end, self.start, eta_max),
                           (total_steps - 1, eta_max, self.low)]

    @staticmethod
    def cosine(start: float, stop: float, fraction: float) -> float:
        """From ``start`` to ``stop`` along half a cosine, at ``fraction`` of the way."""
        return stop + (start - stop) / 2.0 * (math.cos(math.pi * fraction) + 1)

    @staticmethod
    def linear(start: float, stop: float, fraction: float) -> float:
        """From ``start`` to ``stop`` along a line, at ``fraction`` of the way."""
        return (stop - start) * fraction + start

    def first_rate(self, base: float) -> float:
        return self.start

    def value(self, value: float, base: float) -> float:
        step = self.last_step
        if step > self.total_steps:  # where MMEngine's stops the run
            raise ValueError(f"{self.label} total_steps ({self.total_steps}) is smaller than "
                             f"the run, which steps it past step {self.total_steps}; give more, "
                             "or leave it out to cycle from begin to end")
        phase_start: float = 0
        for i, (phase_end, start, stop) in enumerate(self.phases):
            if step <= phase_end or i == len(self.phases) - 1:
                if phase_end == phase_start:  # MMEngine's would divide by zero
                    raise ValueError(f"{self.label} pct_start ({self.pct_start}) with "
                                     f"total_steps ({self.total_steps}) leaves phase {i + 1} "
                                     "of the cycle no steps")
                return self.anneal(start, stop, (step - phase_start) / (phase_end - phase_start))
            phase_start = phase_end
        raise AssertionError("the last phase is always chosen")


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
    "OneCycleLR": (OneCycle, ("total_steps",)),
}


def build_schedule(key: str, cfg: Mapping[str, Any], epoch_length: int,
                   default_end: Callable[[bool], int],
                   group: tuple[int, int] | None = None) -> Schedule:
    """One scheduler of MMEngine's ``param_scheduler``, as MMEngine's Runner builds it: ``end``
    defaults to the run's length (epochs or iterations, ``default_end(by_epoch)``), and
    ``convert_to_iter_based`` turns its epochs into iterations of ``epoch_length``. An option
    given per parameter group (``OneCycleLR``'s ``eta_max`` as a list) takes the value of
    ``group``, the group's index and the number of groups (None: the first value, to check).
    As in MMEngine, several groups take one value more, for the group its ``OptimWrapper``
    adds (which trains nothing; trainrun has no such group, so that value drives nothing).

    Raises:
        ConfigError: an unknown type, options the scheduler does not take or bad values
            (named).
    """
    cfg = dict(cfg)
    name = type_name(cfg.pop("type", None))
    if name not in SCHEDULES:
        raise refused(f"{key}.type", name,
                      f"the learning-rate schedulers are {', '.join(SCHEDULES)}")
    cls, counted = SCHEDULES[name]
    for option, instead in cls.refusals.items():
        if option in cfg:
            raise refused(f"{key}.{option}", cfg[option], instead)
    for option in cls.per_group:
        values = cfg.get(option)
        if isinstance(values, list | tuple):
            if not values or any(isinstance(v, bool) or not isinstance(v, int | float)
                                 or v <= 0 for v in values):
                raise ConfigError(f"{key}.{option}={values!r}: give positive numbers")
            if group is not None:
                index, groups = group
                # MMEngine's OptimWrapper adds a group of its own where there are several (it
                # trains nothing: its rate is the base_lr MMEngine logs)
                wanted = groups + 1 if groups > 1 else groups
                if len(values) != wanted:
                    raise ConfigError(
                        f"{key}.{option}={values!r}: {len(values)} values for {groups} "
                        f"parameter groups; give one number, or {wanted}: one a group"
                        + (" and the last for the group MMEngine's wrapper adds"
                           if groups > 1 else ""))
                values = values[index:]
            cfg[option] = values[0]
    by_epoch = cfg.pop("by_epoch", True)
    convert = cfg.pop("convert_to_iter_based", False)
    cfg.setdefault("end", default_end(by_epoch))
    if by_epoch and convert:
        by_epoch = False
        for option in ("begin", "end", *counted):
            if option in cfg and cfg[option] is not None and cfg[option] != INF:
                value = cfg[option]
                if isinstance(value, list):
                    cfg[option] = [v * epoch_length for v in value]
                elif option == "total_steps":  # as MMEngine's, unrounded: a float is refused
                    cfg[option] = value * epoch_length
                else:
                    cfg[option] = int(value * epoch_length)
    try:
        schedule = cls(by_epoch=by_epoch, **cfg)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{key}: {name} {error}") from None
    schedule.label = f"{key}: {name}"
    return schedule


def mmengine_rates(schedules: Sequence[Schedule], base: float, total_iters: int,
                   epoch_length: int | None) -> list[float]:
    """The rate of each of ``total_iters`` iterations for a group whose first rate is
    ``base``: each schedule steps once when built, then by-iteration ones after every
    iteration and by-epoch ones after every ``epoch_length`` iterations (None: never, as in
    an iteration-based run).

    Raises:
        ValueError: a ``OneCycleLR`` stepped past its ``total_steps``, or into a phase
            without steps (where MMEngine's would stop the run).
    """
    value = base
    bases = []  # each schedule's first rate: the group's when it is built
    for schedule in schedules:
        base = schedule.first_rate(base)
        bases.append(base)
        value = schedule.step(value, base)
    rates = []
    for i in range(total_iters):
        rates.append(value)
        for schedule, first in zip(schedules, bases, strict=True):
            if not schedule.by_epoch:
                value = schedule.step(value, first)
        if epoch_length and (i + 1) % epoch_length == 0:
            for schedule, first in zip(schedules, bases, strict=True):
                if schedule.by_epoch:
                    value = schedule.step(value, first)
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
        groups = optimizer.param_groups
        for index, group in enumerate(groups):
            schedules = [build_schedule(f"param_scheduler[{i}]", item, epoch_length or 1,
                                        default_end, (index, len(groups)))
                         for i, item in enumerate(items)]
            try:
                rates.append(mmengine_rates(schedules, group.get("initial_lr", group["lr"]),
                                            total_iters, epoch_length))
            except ValueError as error:  # its message names the scheduler and the option
                raise ConfigError(str(error)) from None
        return MMEngineRates(optimizer, rates)

    for i, item in enumerate(items):  # a bad option is refused now, before the run is built
        build_schedule(f"param_scheduler[{i}]", item, epoch_length or 1, lambda _: INF)
    return make


__all__ = ["MMEngineRates", "mmengine_rates", "scheduler_factory"]
