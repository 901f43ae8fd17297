"""Optimisers from the config's ``optim`` section: any ``torch.optim`` class by name, one per
submodule where ``per_module`` says so, over parameter groups where ``paramwise`` does
(``trainrun.runner.optim.param_groups``), each in its ``OptimWrapper``; and what each optimiser
keeps per parameter, for the memory plan.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from trainrun.runner.optim.param_groups import (
    Group,
    check_paramwise,
    describe_groups,
    param_groups,
    unmatched_warning,
)
from trainrun.runner.optim.wrapper import OptimWrapper, OptimWrapperDict
from trainrun.wrappers.base import Optimizers

log = logging.getLogger("trainrun")

# optim keys that are the optimiser wrapper's, not the optimiser's
WRAPPER_KEYS = ("clip_grad", "accumulate", "per_module")
# optim keys that say how the optimiser's parameter groups are made (param_groups.py)
GROUP_KEYS = ("paramwise",)


def build_optimizer(params: Any, cfg: dict[str, Any]) -> Optimizer:
    """Any ``torch.optim`` class by name, e.g. ``{'type': 'AdamW', 'lr': 1e-3}``."""
    options = dict(cfg)
    name = options.pop("type")
    cls = getattr(torch.optim, name, None)
    if not (isinstance(cls, type) and issubclass(cls, Optimizer)):
        raise ValueError(f"optim.type={name!r} is not an optimiser in torch.optim")
    return cls(params, **options)


def optimizer_names() -> list[str]:
    return sorted(name for name, cls in vars(torch.optim).items()
                  if isinstance(cls, type) and issubclass(cls, Optimizer) and cls is not Optimizer)


def optimizer_arguments(name: str) -> set[str] | None:
    """The keyword arguments ``torch.optim.<name>`` takes besides params (None: any)."""
    parameters = inspect.signature(getattr(torch.optim, name)).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return None
    return {p for p in parameters if p not in ("self", "params")}


def optimizer_default(name: str, argument: str) -> Any:
    """The default of ``argument`` of ``torch.optim.<name>``; None where it takes no such
    argument (or ``name`` is no optimiser)."""
    cls = getattr(torch.optim, name, None)
    if not callable(cls):
        return None
    found = inspect.signature(cls).parameters.get(argument)
    return None if found is None or found.default is inspect.Parameter.empty else found.default


# The state tensors of a parameter's size each torch optimiser keeps per parameter, as a
# function of its options (scalar step counters left out); what a memory plan counts.
_STATES: dict[str, Callable[[Callable[[str], Any]], int]] = {
    "Adam": lambda opt: 3 if opt("amsgrad") else 2,  # exp_avg, exp_avg_sq (max_exp_avg_sq)
    "AdamW": lambda opt: 3 if opt("amsgrad") else 2,
    "Adamax": lambda opt: 2,  # exp_avg, exp_inf
    "NAdam": lambda opt: 2,  # exp_avg, exp_avg_sq
    "RAdam": lambda opt: 2,
    "Adadelta": lambda opt: 2,  # square_avg, acc_delta
    "Adagrad": lambda opt: 1,  # sum
    "SGD": lambda opt: 1 if opt("momentum") else 0,  # momentum_buffer
    "RMSprop": lambda opt: 1 + bool(opt("momentum")) + bool(opt("centered")),
}


def state_tensors(optim: Mapping[str, Any]) -> int | None:
    """How many tensors of each parameter's size the optimiser ``optim`` describes keeps for
    it ({'type': 'AdamW', ...}: 2; SGD with momentum 1, without 0); None for an optimiser
    whose state is not known here."""
    count = _STATES.get(optim.get("type", "AdamW"))
    if count is None:
        return None
    return count(lambda key: optim.get(key, optimizer_default(optim["type"], key)))


def optimizer_factory(cfg: Mapping[str, Any], on_warning: Callable[[str], None] | None = None,
                      on_groups: Callable[[list[str]], None] | None = None) -> Any:
    """A function building the optimiser(s) of ``cfg`` over a module: one, or one per
    submodule named in ``per_module`` (each with its own overrides). With ``paramwise`` the
    parameters go in groups (`trainrun.runner.optim.param_groups`), described (one line each) to
    ``on_groups``; a custom key that matches no parameter is told to ``on_warning``."""
    common = {k: v for k, v in cfg.items() if k not in WRAPPER_KEYS and v is not None}
    per_module = cfg.get("per_module")

    def make(module: nn.Module) -> Optimizers:
        if not per_module:
            optimizer, unmatched = _optimizer(module, common)
            _report_param_groups(optimizer, "", common, on_groups)
            _warn_unmatched({"optim.paramwise": set(unmatched)}, on_warning)
            return optimizer
        optimizers, missed = {}, {}
        for name, overrides in per_module.items():
            options = {**common, **own_options(overrides)}
            optimizers[name], unmatched = _optimizer(getattr(module, name), options,
                                                     f"{name}.")
            _report_param_groups(optimizers[name], name, options, on_groups)
            # a shared key is unmatched only where no submodule sharing it matched it
            where = (f"optim.per_module.{name}.paramwise" if "paramwise" in (overrides or {})
                     else "optim.paramwise")
            missed[where] = missed.get(where, set(unmatched)) & set(unmatched)
        _warn_unmatched(missed, on_warning)
        return optimizers

    return make


def _report_param_groups(optimizer: torch.optim.Optimizer, scope: str, options: Mapping[str, Any],
          on_groups: Callable[[list[str]], None] | None) -> None:
    """Describe ``optimizer``'s groups to ``on_groups`` where paramwise made them."""
    if on_groups is not None and options.get("paramwise") is not None:
        on_groups(describe_groups(optimizer, scope))


def _optimizer(module: nn.Module, options: Mapping[str, Any],
               prefix: str = "") -> tuple[torch.optim.Optimizer, list[str]]:
    """The optimiser ``options`` describe over ``module``'s parameters (in groups when
    ``paramwise`` is set), and the custom keys that matched none of them."""
    groups, unmatched = module_groups(module, options, prefix)
    arguments = {k: v for k, v in options.items() if k not in GROUP_KEYS}
    if groups is None:
        return build_optimizer(module.parameters(), arguments), []
    return build_optimizer([g.as_optimizer_group() for g in groups], arguments), unmatched


def module_groups(module: nn.Module, optim: Mapping[str, Any],
                  prefix: str = "") -> tuple[list[Group] | None, list[str]]:
    """``module``'s parameter groups under ``optim`` (a checked optim section, or one
    optimiser's options), or None where ``optim.paramwise`` is not set; and the custom keys
    that matched no parameter. The base weight decay is the optimiser's default where
    ``optim`` does not give it."""
    if optim.get("paramwise") is None:
        return None, []
    decay = optim.get("weight_decay", optimizer_default(optim.get("type", "AdamW"),
                                                        "weight_decay"))
    paramwise = check_paramwise("optim.paramwise", optim["paramwise"],
                                has_decay=decay is not None)
    return param_groups(module, optim.get("lr", 1e-3), decay, paramwise, prefix)


def _warn_unmatched(missed: Mapping[str, set[str]],
                    on_warning: Callable[[str], None] | None) -> None:
    for where, keys in missed.items():
        for key in sorted(keys):
            (on_warning or log.warning)(unmatched_warning(where, key))


def own_options(overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """A submodule's overrides that are its optimiser's (not its wrapper's clip_grad or
    accumulate)."""
    return {k: v for k, v in (overrides or {}).items() if k not in WRAPPER_KEYS}


def wrap_optimizers(optimizer: Optimizers, cfg: Mapping[str, Any], precision: str,
                    device_type: str) -> OptimWrapper | OptimWrapperDict:
    """Each optimiser in its wrapper; one of ``per_module`` gets that submodule's clip_grad
    and accumulate where it overrides them."""
    def wrap(one: torch.optim.Optimizer, overrides: Mapping[str, Any] | None) -> OptimWrapper:
        options = {**cfg, **(overrides or {})}
        return OptimWrapper(one, accumulate=options.get("accumulate", 1),
                            clip_grad=options.get("clip_grad"), precision=precision,
                            device_type=device_type)

    if isinstance(optimizer, Mapping):
        per_module = cfg.get("per_module") or {}
        return OptimWrapperDict({name: wrap(opt, per_module.get(name))
                                 for name, opt in optimizer.items()})
    return wrap(optimizer, None)

