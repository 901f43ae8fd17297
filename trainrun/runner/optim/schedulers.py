"""Learning-rate schedules that step once per iteration.

Every schedule is a `LambdaLR` over a pure function of the iteration, rebuilt from the config
on resume: the checkpointed state is only the step count and the base learning rates.
Iteration-based options (``step_size``, ``milestones``, ``warmup_iters``) count iterations
whatever the training schedule counts.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from trainrun.messages import closest, is_int, is_number, show
from trainrun.runner.schema import (
    REQUIRED,
    ConfigError,
    Fields,
    bad_value,
    choice,
    expected_of,
    fields,
    integer,
    nullable,
    number,
    rule,
)


def _milestones(key: str, value: Any) -> list[int]:
    if not (isinstance(value, (list, tuple)) and len(value) > 0
            and all(is_int(v) and v >= 1 for v in value)
            and all(a < b for a, b in zip(value, value[1:], strict=False))):
        raise bad_value(key, value, "a list of increasing ints >= 1 (iterations)")
    return list(value)


_milestones.expected = "a list of increasing ints >= 1 (iterations)"  # type: ignore[attr-defined]

_check_factor = rule("a number in [0, 1]", lambda v: is_number(v) and 0 <= v <= 1)
_GAMMA = (0.1, number(above=0), "the factor the rate is multiplied by at each step")
_WARMUP: Fields = {
    "warmup_iters": (0, integer(0),
                     "iterations of linear warm-up before the schedule (0: none)"),
    "warmup_start_factor": (0.1, _check_factor,
                            "the warm-up's first rate, as a factor of the base rate"),
}
_DECAY: Fields = {
    "min_lr_ratio": (None, nullable(_check_factor),
                     "where the decay ends, as a factor of each group's rate (default 0)"),
    "min_lr": (None, nullable(number(at_least=0)),
               "where the decay ends, as a rate (instead of min_lr_ratio)"),
    **_WARMUP,
}

# The options each schedule takes (default or REQUIRED, check), in the order the validated
# config lists them.
SCHEDULER_OPTIONS: dict[str, Fields] = {
    "constant": {**_WARMUP},
    "step": {
        "step_size": (REQUIRED, rule("an int >= 1 (iterations)", lambda v: is_int(v) and v >= 1),
                      "iterations between steps of the rate"),
        "gamma": _GAMMA,
        **_WARMUP,
    },
    "multistep": {
        "milestones": (REQUIRED, _milestones, "the iterations at which the rate steps"),
        "gamma": _GAMMA,
        **_WARMUP,
    },
    "exponential": {
        "gamma": (REQUIRED, rule("a number > 0 (the factor per iteration)",
                                 lambda v: is_number(v) and v > 0),
                  "the factor the rate is multiplied by every iteration"),
        **_WARMUP,
    },
    "linear": {**_DECAY},
    "cosine": {**_DECAY},
    "poly": {"power": (1.0, number(above=0), "the polynomial's power (1: linear)"), **_DECAY},
    "linear_warmup": {
        "warmup_iters": (REQUIRED, integer(1),
                         "iterations from start_factor up to the base rate, which then stays"),
        "start_factor": (0.1, _check_factor, "the first rate, as a factor of the base rate"),
    },
}
SCHEDULERS: tuple[str, ...] = tuple(SCHEDULER_OPTIONS)
DECAYING = ("linear", "cosine", "poly")  # these decay over the total iterations
_TYPE: Fields = {"type": (REQUIRED, choice(*SCHEDULERS),
                         "the schedule's shape; every schedule steps once per iteration")}

# linear_warmup's start_factor is the other schedules' warmup_start_factor: take both names
_SYNONYMS = {"linear_warmup": {"warmup_start_factor": "start_factor"}}


def check_scheduler(cfg: Mapping[str, Any] | None, key: str = "scheduler") -> dict[str, Any] | None:
    """The scheduler section with defaults filled; None stays None (a constant rate).

    Raises ConfigError with one line naming ``key.option``, the bad value and what was expected.
    """
    if cfg is None:
        return None
    if not isinstance(cfg, Mapping):
        raise bad_value(key, cfg, "null or a mapping with a 'type'")
    kind = fields(key, cfg, _TYPE, open_=True)["type"]
    options = SCHEDULER_OPTIONS[kind]
    given = _rename_synonyms(dict(cfg), kind, key)
    for name in given:
        if name != "type" and name not in options:
            hint = closest(name, list(options))
            raise ConfigError(
                f"unknown key '{key}.{name}' for scheduler {kind!r}"
                + (f"; did you mean '{key}.{hint}'?" if hint
                   else f"; it takes {', '.join(options) or 'no options'}"))
    for name, (default, check, *_) in options.items():
        if default is REQUIRED and name not in given:
            raise ConfigError(f"{key}.{name}: missing, expected {expected_of(check)} "
                              f"(scheduler {kind!r} needs it)")
    out = fields(key, given, {**_TYPE, **options})
    if kind in DECAYING:
        if out["min_lr"] is not None and out["min_lr_ratio"] is not None:
            raise ConfigError(f"{key}: got both min_lr ({out['min_lr']}) and min_lr_ratio "
                              f"({out['min_lr_ratio']}), expected at most one")
        if out["min_lr"] is None and out["min_lr_ratio"] is None:
            out["min_lr_ratio"] = 0.0
    return out


def _rename_synonyms(given: dict[str, Any], kind: str, key: str) -> dict[str, Any]:
    for alias, name in _SYNONYMS.get(kind, {}).items():
        if alias in given:
            if name in given:
                raise ConfigError(f"{key}: got both {alias} and {name}, expected one "
                                  f"(they mean the same for {kind!r})")
            given[name] = given.pop(alias)
    return given


def check_total_iters(cfg: Mapping[str, Any] | None, total_iters: int,
                      key: str = "scheduler", total_name: str = "the total iterations") -> None:
    """Raise ConfigError when a warmup does not end before ``total_iters``."""
    if cfg is None:
        return
    warmup = cfg.get("warmup_iters", 0)
    if cfg["type"] in DECAYING and warmup >= total_iters:
        raise bad_value(f"{key}.warmup_iters", warmup, f"fewer than {total_name} "
                        f"({total_iters}) so that the decay has room")
    if warmup > total_iters:
        raise bad_value(f"{key}.warmup_iters", warmup,
                        f"at most {total_name} ({total_iters})")


Factor = Callable[[int], float]


def _warmup(iters: int, start: float) -> Factor:
    """From ``start`` at iteration 0 linearly up to 1 at ``iters``, then 1."""
    def factor(step: int) -> float:
        return start + (1.0 - start) * step / iters if step < iters else 1.0
    return factor


def _decay(kind: str, power: float, begin: int, end: int, floor: float) -> Factor:
    """From 1 at ``begin`` down to ``floor`` at ``end`` (cosine, linear or polynomial)."""
    def factor(step: int) -> float:
        progress = min(max((step - begin) / (end - begin), 0.0), 1.0)
        if kind == "cosine":
            shape = (1.0 + math.cos(math.pi * progress)) / 2.0
        else:
            shape = (1.0 - progress) ** power
        return floor + (1.0 - floor) * shape
    return factor


def _main(cfg: Mapping[str, Any], total_iters: int, floor: float) -> Factor:
    """The schedule without its warmup, as a factor of the base learning rate."""
    kind = cfg["type"]
    if kind == "step":
        size, gamma = cfg["step_size"], cfg["gamma"]
        return lambda step: gamma ** (step // size)
    if kind == "multistep":
        milestones, gamma = list(cfg["milestones"]), cfg["gamma"]
        return lambda step: gamma ** bisect.bisect_right(milestones, step)
    if kind == "exponential":
        gamma = cfg["gamma"]
        return lambda step: gamma ** step
    if kind in DECAYING:
        power = cfg.get("power", 1.0)
        return _decay(kind, power, cfg["warmup_iters"], total_iters, floor)
    return lambda step: 1.0


def _combine(warmup: Factor, main: Factor) -> Factor:
    return lambda step: warmup(step) * main(step)


def _floor(cfg: Mapping[str, Any], base_lr: float) -> float:
    """The decay's end as a factor of ``base_lr`` (min_lr is absolute, min_lr_ratio is not)."""
    if cfg.get("min_lr") is None:
        return cfg.get("min_lr_ratio") or 0.0
    if base_lr <= 0:
        return 0.0
    if cfg["min_lr"] > base_lr:
        raise ValueError(f"scheduler.min_lr: got {cfg['min_lr']}, expected at most the "
                         f"learning rate ({base_lr})")
    return cfg["min_lr"] / base_lr


def lr_factor(cfg: Mapping[str, Any] | None, total_iters: int, base_lr: float = 1.0) -> Factor:
    """The factor of ``base_lr`` at each iteration for a checked scheduler config."""
    if cfg is None:
        return lambda step: 1.0
    if cfg["type"] == "linear_warmup":
        return _warmup(cfg["warmup_iters"], cfg["start_factor"])
    main = _main(cfg, total_iters, _floor(cfg, base_lr))
    if cfg.get("warmup_iters", 0) > 0:
        return _combine(_warmup(cfg["warmup_iters"], cfg["warmup_start_factor"]), main)
    return main


class IterationLR(LambdaLR):
    """`LambdaLR` whose `load_state_dict` also sets the optimiser's rates for the restored
    step, so a resumed run has the right rate whether the optimiser's state was loaded before
    or after the scheduler was built."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        rates = [base * factor(self.last_epoch)
                 for base, factor in zip(self.base_lrs, self.lr_lambdas, strict=True)]
        for group, rate in zip(self.optimizer.param_groups, rates, strict=True):
            group["lr"] = rate
        self._last_lr = rates


def build_scheduler(optimizer: Optimizer, cfg: Mapping[str, Any] | None,
                    total_iters: int) -> LRScheduler:
    """An `IterationLR` (a `LambdaLR`) for ``cfg`` (the ``scheduler`` section; None is a
    constant rate), to be stepped once per iteration over ``total_iters`` iterations."""
    if not is_int(total_iters) or total_iters < 1:
        raise ValueError(f"total_iters: got {show(total_iters)}, expected an int >= 1")
    if cfg is not None and not isinstance(cfg, dict):
        cfg = _plain(cfg)
    checked = check_scheduler(cfg)
    check_total_iters(checked, total_iters)
    factors = [_in_group(group, lambda g: lr_factor(checked, total_iters,
                                                     g.get("initial_lr", g["lr"])))
               for group in optimizer.param_groups]
    return IterationLR(optimizer, factors)


def _in_group(group: dict[str, Any], make: Callable[[dict[str, Any]], Any]) -> Any:
    """``make(group)``; its ValueError names the group where ``optim.paramwise`` made it
    (each group's rate is a base of its own: min_lr must not exceed any)."""
    try:
        return make(group)
    except ValueError as error:
        if "name" not in group:
            raise
        raise ValueError(f"{error}: the rate of parameter group {group['name']} "
                         f"(optim.paramwise)") from None


def check_floors(cfg: Mapping[str, Any] | None, optimizer: Optimizer) -> None:
    """Refuse (ValueError naming the group) a checked scheduler's min_lr above the learning
    rate of one of ``optimizer``'s groups: what `build_scheduler` refuses, without a run."""
    if cfg is None or cfg["type"] not in DECAYING:
        return
    for group in optimizer.param_groups:
        _in_group(group, lambda g: _floor(cfg, g.get("initial_lr", g["lr"])))


def _plain(cfg: Any) -> Any:
    """A plain dict from an OmegaConf node (imported only when one is passed)."""
    from omegaconf import DictConfig, OmegaConf

    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
