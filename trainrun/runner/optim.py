"""Optimiser wrapper: backward, gradient accumulation, clipping and mixed precision.

A model's ``train_step`` runs its forward inside ``optim_context`` and hands the loss to
``update_params``; this class decides the rest, so models never repeat it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, ExitStack
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from trainrun.dist import phase
from trainrun.dist.device import DTYPES, autocast_dtype
from trainrun.messages import closest, is_number
from trainrun.runner.paramwise import check_paramwise
from trainrun.runner.schema import (
    ALIASES,
    BOOL,
    OPTIONAL,
    REQUIRED,
    ConfigError,
    Fields,
    bad_value,
    choice,
    expected_of,
    expects,
    integer,
    join,
    nullable,
    number,
    rule,
    section,
    unknown_key,
)

PRECISIONS = tuple(DTYPES)  # the names of `precision`
# optim keys that are the optimiser wrapper's, not the optimiser's
WRAPPER_KEYS = ("clip_grad", "accumulate", "per_module")
# optim keys that say how the optimiser's parameter groups are made (runner/paramwise.py)
GROUP_KEYS = ("paramwise",)
ONE_GROUP = ("LBFGS",)  # optimisers that refuse parameter groups


def build_optimizer(params: Any, cfg: dict[str, Any]) -> Optimizer:
    """Any ``torch.optim`` class by name, e.g. ``{'type': 'AdamW', 'lr': 1e-3}``."""
    options = dict(cfg)
    name = options.pop("type")
    cls = getattr(torch.optim, name, None)
    if not (isinstance(cls, type) and issubclass(cls, Optimizer)):
        raise ValueError(f"optim.type={name!r} is not an optimiser in torch.optim")
    return cls(params, **options)


class OptimWrapper:
    """One optimiser with accumulation over ``accumulate`` micro-steps, clipping to
    ``clip_grad`` (a max norm, or ``{'max_norm': ..., 'norm_type': ...}``) and autocast in
    ``precision`` (fp16 with a gradient scaler).

    A model's ``train_step`` uses two methods, so that the same code runs under every
    strategy and setting::

        with optim_wrapper.optim_context(self):
            losses = self(batch, mode="loss")
        loss, log_vars = parse_losses(losses)
        optim_wrapper.update_params(loss)

    A model with several optimisers (a GAN, through an ``OptimWrapperDict``) does the same
    with each one's wrapper. ``update_params`` is ``backward``, then, once the micro-steps of
    a group are in, ``step`` and ``zero_grad``; a model that needs finer control may call
    those three itself.

    Attributes:
        optimizer: the torch optimiser.
        grad_norm: after a micro-step that stepped the optimiser, the total norm of the
            gradients it applied, before clipping (a tensor), when clipping is on or
            ``measure_grad_norm`` was set (the logger sets it for the steps it logs: without
            clipping the norm costs one more pass over the gradients); None after any other
            micro-step.
        measure_grad_norm: have the next steps measure ``grad_norm`` even without clipping.

    Args:
        optimizer: the torch optimiser to step.
        accumulate: the micro-steps (batches) whose gradients make one optimiser step; each
            micro-step's loss is divided by it.
        clip_grad: clip the total gradient norm before each step: None (no clipping), the
            max norm, or ``{'max_norm': ..., 'norm_type': ...}`` (the keyword arguments of
            ``torch.nn.utils.clip_grad_norm_``).
        precision: ``'fp32'``, ``'bf16'`` or ``'fp16'``: the autocast of the forward (fp16
            with a gradient scaler).
        device_type: the device type autocast and the scaler work on (``'cuda'``, ``'cpu'``).

    Raises:
        ValueError: an unknown ``precision``.
    """

    def __init__(self, optimizer: Optimizer, accumulate: int = 1,
                 clip_grad: float | dict[str, float] | None = None, precision: str = "fp32",
                 device_type: str = "cpu") -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
        self.optimizer = optimizer
        self.accumulate = accumulate
        if isinstance(clip_grad, (int, float)):
            clip_grad = {"max_norm": clip_grad}
        self.clip_grad = clip_grad
        self.precision = precision
        self.device_type = device_type
        self.scaler = torch.amp.GradScaler(device_type) if precision == "fp16" else None
        self.micro_steps = 0  # taken since the last optimiser step
        self.grad_norm: Tensor | None = None
        self.measure_grad_norm = False
        self.iters = 0  # micro-steps taken in all, once `set_total` has been called
        self.max_iters: int | None = None

    def set_total(self, done_iters: int, max_iters: int) -> None:
        """Where training stands and where it ends, so that the last ``max_iters % accumulate``
        micro-steps form a group of their own (their loss divided by their number, then a
        step) instead of being left unapplied.

        The runner calls this when training starts (after a resume, too).

        Args:
            done_iters: the iterations already trained.
            max_iters: the iterations the schedule trains.
        """
        self.iters, self.max_iters = done_iters, max_iters

    def group_size(self) -> int:
        """Micro-steps in the current accumulation group.

        Returns:
            ``accumulate``, or fewer for the last group of the run (see ``set_total``).
        """
        if self.max_iters is None:
            return self.accumulate
        tail_start = self.max_iters - self.max_iters % self.accumulate
        return self.accumulate if self.iters < tail_start else self.max_iters - tail_start

    @property
    def will_step(self) -> bool:
        """Whether the current micro-step ends with an optimiser step (and gradient sync)."""
        return self.micro_steps + 1 >= self.group_size()

    def optim_context(self, model: nn.Module) -> AbstractContextManager[None]:
        """Around the forward: no gradient sync on micro-steps that do not step, and autocast.

        Args:
            model: the model as the strategy wrapped it (its ``no_sync``, where it has one,
                is entered on micro-steps that do not step).

        Returns:
            A context manager for the forward; it enters nothing on a step that syncs, in
            fp32.
        """
        return _OptimContext(self, model)

    def update_params(self, loss: Tensor) -> None:
        """Backward ``loss``; step and zero the gradients once ``accumulate`` micro-steps are in.

        Args:
            loss: this micro-step's loss, a scalar tensor (it is divided by the group's
                number of micro-steps here; pass it undivided).
        """
        self.grad_norm = None
        group = self.group_size()
        if group > 1:
            loss = loss / group
        with phase("backward"):
            self.backward(loss)
        self.micro_steps += 1
        self.iters += 1
        if self.micro_steps >= group:
            with phase("optimizer step"):
                self.step()
            self.zero_grad()
            self.micro_steps = 0

    def backward(self, loss: Tensor) -> None:
        """Backward ``loss`` as it is (scaled first under fp16); no division, no step.

        Args:
            loss: a scalar tensor.
        """
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self) -> None:
        """Step the optimiser on the gradients there are: unscaled first under fp16, clipped
        to ``clip_grad`` (measuring ``grad_norm``) where that is set; it does not zero them."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.clip_grad or self.measure_grad_norm:
            params = [p for group in self.optimizer.param_groups for p in group["params"]
                      if p.grad is not None]
            if self.clip_grad:  # it returns the norm before clipping
                self.grad_norm = nn.utils.clip_grad_norm_(params, **self.clip_grad)
            else:
                self.grad_norm = nn.utils.get_total_norm([p.grad for p in params])
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()

    def zero_grad(self) -> None:
        """Drop the gradients (set to None) of every parameter the optimiser steps."""
        self.optimizer.zero_grad(set_to_none=True)

    def get_lr(self) -> float:
        """The learning rate of the optimiser's first parameter group.

        Returns:
            The learning rate now (what the logger logs as ``lr``).
        """
        return self.optimizer.param_groups[0]["lr"]

    def _params(self) -> list[Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def state_dict(self) -> dict[str, Any]:
        """What the wrapper adds to the optimiser's own state (saved by the strategy).

        Between optimiser steps it holds this rank's accumulated gradients too (copied to the
        CPU, as they travel to rank 0), without which a run resumed there would step on fewer
        micro-batches than one that never stopped.

        Returns:
            ``{'micro_steps': ..., 'scaler': ..., 'grads': ...}`` (``grads`` None right after
            a step).
        """
        grads = None
        if self.micro_steps:
            grads = [None if p.grad is None else p.grad.detach().to("cpu", copy=True)
                     for p in self._params()]
        return {"micro_steps": self.micro_steps,
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "grads": grads}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the micro-steps taken, the scaler, the gradients.

        Args:
            state: what ``state_dict`` returned.
        """
        self.micro_steps = state["micro_steps"]
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if state.get("grads") is not None:
            for p, grad in zip(self._params(), state["grads"], strict=True):
                p.grad = None if grad is None else grad.to(device=p.device, dtype=p.dtype)


class _OptimContext:
    """`OptimWrapper.optim_context`. It decides on entering, as a generator-based context
    would, but enters nothing at all on the usual step (one that syncs, in fp32): around a
    forward, a generator and an ExitStack cost more than the rest of the wrapper together."""

    __slots__ = ("_model", "_stack", "_wrapper")

    def __init__(self, wrapper: OptimWrapper, model: nn.Module):
        self._wrapper = wrapper
        self._model = model
        self._stack: ExitStack | None = None

    def __enter__(self) -> None:
        wrapper = self._wrapper
        no_sync = not wrapper.will_step and hasattr(self._model, "no_sync")
        dtype = autocast_dtype(wrapper.precision)
        if not no_sync and dtype is None:
            return
        with ExitStack() as stack:
            if no_sync:
                stack.enter_context(self._model.no_sync())
            if dtype is not None:
                stack.enter_context(torch.autocast(wrapper.device_type, dtype))
            self._stack = stack.pop_all()

    def __exit__(self, *exc_info: Any) -> bool:
        stack, self._stack = self._stack, None
        return bool(stack is not None and stack.__exit__(*exc_info))


def measure_grad_norm(wrapper: Any, on: bool) -> None:
    """Ask ``wrapper`` (or each of a dict of them) for the gradient norm of its next step,
    where it takes the request (`OptimWrapper`); others say their norm or none."""
    for one in wrapper.values() if isinstance(wrapper, Mapping) else (wrapper,):
        if hasattr(one, "measure_grad_norm"):
            one.measure_grad_norm = on


def grad_norms(wrapper: Any) -> dict[str, Tensor]:
    """The gradient norms the last micro-step's optimiser steps took: ``grad_norm`` of one
    wrapper, ``grad_norm/<name>`` of each of a dict; nothing where none was taken."""
    wrappers = {f"grad_norm/{k}": v for k, v in wrapper.items()} \
        if isinstance(wrapper, Mapping) else {"grad_norm": wrapper}
    norms = {key: getattr(one, "grad_norm", None) for key, one in wrappers.items()}
    return {key: norm for key, norm in norms.items() if norm is not None}


class OptimWrapperDict(dict):
    """One ``OptimWrapper`` per named submodule, for models with several optimisers (GANs).

    The model's own ``train_step`` picks ``optim_wrapper['generator']`` and so on. It is a
    dict of wrappers by submodule name (``optim.per_module``'s keys).
    """

    def get_lr(self) -> float:
        """The learning rate of the first wrapper.

        Returns:
            Its optimiser's first parameter group's learning rate.
        """
        return next(iter(self.values())).get_lr()

    def set_total(self, done_iters: int, max_iters: int) -> None:
        """``OptimWrapper.set_total`` of every wrapper.

        Args:
            done_iters: the iterations already trained.
            max_iters: the iterations the schedule trains.
        """
        for wrapper in self.values():
            wrapper.set_total(done_iters, max_iters)

    def state_dict(self) -> dict[str, Any]:
        """Every wrapper's state.

        Returns:
            Each wrapper's ``state_dict`` by name.
        """
        return {name: wrapper.state_dict() for name, wrapper in self.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load each wrapper's state.

        Args:
            state: what ``state_dict`` returned.
        """
        for name, wrapper in self.items():
            wrapper.load_state_dict(state[name])


# ---------------------------------------------------------------- the optim section

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


CLIP_GRAD_KEYS = {
    "max_norm": (REQUIRED, number(above=0), "the largest total gradient norm kept"),
    "norm_type": (2.0, rule("a number", is_number), "which norm (2: Euclidean; inf: max)"),
    "error_if_nonfinite": (OPTIONAL, BOOL,
                           "raise when the norm is nan or inf (torch's clip_grad_norm_)"),
    "foreach": (OPTIONAL, nullable(BOOL), "torch's clip_grad_norm_ foreach option"),
}
CLIP_GRAD = expects("null, a number > 0 or {max_norm: ..., norm_type: ...}",
                    section(CLIP_GRAD_KEYS))


def check_clip_grad(key: str, value: Any) -> dict[str, Any] | None:
    """null, or {max_norm, norm_type, ...}; a plain number is the max norm."""
    if value is None:
        return None
    if is_number(value):
        value = {"max_norm": value}
    if not isinstance(value, Mapping):
        raise bad_value(key, value, expected_of(CLIP_GRAD))
    return CLIP_GRAD(key, value)


check_clip_grad.expected = expected_of(CLIP_GRAD)  # type: ignore[attr-defined]


def optim_table(kind: str, arguments: set[str] | None) -> Fields:
    """The keys every optim section has; weight_decay only where the optimiser takes it."""
    table: Fields = {
        "type": ("AdamW", expects(f"one of {', '.join(optimizer_names())}", lambda _, v: kind),
                 "a torch.optim optimiser's name"),
        "lr": (1e-3, number(above=0), "the base learning rate"),
    }
    has_decay = arguments is None or "weight_decay" in arguments
    if has_decay:
        table["weight_decay"] = (0.0, number(at_least=0), "the base weight decay")
    paramwise = expects("null or a mapping", partial(check_paramwise, has_decay=has_decay))
    if kind in ONE_GROUP:
        paramwise = rule(f"null: {kind} takes one parameter group", lambda v: v is None)
    # paramwise stays absent unless given, so that the saved config of a run from before it
    # existed still matches on resume
    table.update(
        clip_grad=(None, check_clip_grad,
                   "clip the total gradient norm before each step: null (no clipping), the "
                   "max norm, or {max_norm, norm_type}"),
        accumulate=(1, integer(1),
                    "accumulate the gradients of this many iterations before each step"),
        paramwise=(OPTIONAL, paramwise,
                   "learning rate and weight decay per parameter group (see "
                   "optim.paramwise)"))
    return table


def check_optim(key: str, value: Any, where: Callable[[str], str] | None = None) -> dict[str, Any]:
    """The optimiser section (but per_module): a ``torch.optim`` class, its arguments (checked
    against its signature) and the wrapper's keys.

    ``where`` names each key in messages (per-module overrides name theirs differently).
    """
    where = where or partial(join, key)
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        raise bad_value(key, value, "a mapping with the optimiser's type and arguments")
    kind = choice(*optimizer_names())(where("type"), value.get("type", "AdamW"))
    arguments = optimizer_arguments(kind)
    table = optim_table(kind, arguments)
    extra = {k: v for k, v in value.items() if k not in table and k != "per_module"}
    for name in extra:
        if arguments is not None and name not in arguments:
            hint = closest(str(name), [*table, "per_module", *sorted(arguments)], ALIASES)
            sibling = join(where(name).rpartition(".")[0], hint)
            raise ConfigError(f"unknown key '{where(name)}'; " + (
                f"did you mean '{sibling}'?" if hint
                else f"{kind} takes {', '.join(sorted(arguments))}"))
    out = {name: check(where(name), value.get(name, default))
           for name, (default, check, *_) in table.items()
           if name in value or default is not OPTIONAL}
    return {**out, **extra}


def check_per_module(key: str, optim: Mapping[str, Any]) -> dict[str, dict[str, Any]] | None:
    """``optim.per_module``: {submodule: {overrides of the optim keys}}, each checked merged
    with the shared keys; the result keeps the overrides only."""
    value = optim.get("per_module")
    if value is None:
        return None
    if not isinstance(value, Mapping) or not value:
        raise bad_value(key, value, "null or a mapping of submodule names to option overrides")
    optim_key = key.rpartition(".")[0]
    shared = {k: v for k, v in optim.items() if k != "per_module"}
    out: dict[str, dict[str, Any]] = {}
    for name, overrides in value.items():
        prefix = join(key, name)
        overrides = {} if overrides is None else overrides
        if not isinstance(name, str) or not name:
            raise bad_value(prefix, name, "a submodule name")
        if not isinstance(overrides, Mapping):
            raise bad_value(prefix, overrides, "null or a mapping of optim options")
        if "per_module" in overrides:
            raise unknown_key(prefix, "per_module", shared)

        def where(option: str, _prefix: str = prefix, _own: Mapping = overrides) -> str:
            return join(_prefix if option in _own else optim_key, option)

        merged = check_optim(prefix, {**shared, **overrides}, where)
        out[name] = {k: merged[k] for k in overrides}
    return out


def check_optim_section(key: str, value: Any) -> dict[str, Any]:
    out = check_optim(key, value)
    out["per_module"] = check_per_module(join(key, "per_module"),
                                         value if isinstance(value, Mapping) else {})
    return out
