"""Optimiser wrapper: backward, gradient accumulation, clipping and mixed precision.

A model's ``train_step`` runs its forward inside ``optim_context`` and hands the loss to
``update_params``; this class decides the rest, so models never repeat it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, ExitStack
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from trainrun.dist import phase
from trainrun.dist.device import DTYPES, autocast_dtype
from trainrun.dist.waits import waiting_for_gradients

PRECISIONS = tuple(DTYPES)  # the names of `precision`


class OptimWrapper:
    """One optimiser with accumulation over ``accumulate`` micro-steps, clipping to
    ``clip_grad`` (a max norm, ``{'max_norm': ..., 'norm_type': ...}`` or
    ``{'clip_value': ...}``) and autocast in ``precision`` (fp16 with a gradient scaler).

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
            gradients it applied, before clipping (a tensor), when clipping the norm or when
            ``measure_grad_norm`` was set (the logger sets it for the steps it logs: without
            clipping by norm the norm costs one more pass over the gradients); None after any
            other micro-step.
        measure_grad_norm: have the next steps measure ``grad_norm`` even without clipping.
        combine_norms: where each rank holds a part of the model (pipeline stages), makes
            this rank's gradient norm (and its ``norm_type``) the whole model's; set by the
            pipeline (`trainrun.wrappers.pipeline`). None: the norm is already the whole's.
        skip_nonfinite: skip each optimiser step whose gradients are not all finite (the
            guard's ``skip_step`` sets it): their norm, the whole model's and so the same on
            every rank, is read on the host at every step.
        skipped: the micro-steps (counting from 1, as ``iters``) whose optimiser step was
            skipped, for the guard to take.

    Args:
        optimizer: the torch optimiser to step.
        accumulate: the micro-steps (batches) whose gradients make one optimiser step; each
            micro-step's loss is divided by it.
        clip_grad: clip the gradients before each step: None (no clipping); the max total
            norm, or ``{'max_norm': ..., 'norm_type': ...}`` (the keyword arguments of
            ``torch.nn.utils.clip_grad_norm_``); or ``{'clip_value': ...}`` (those of
            ``torch.nn.utils.clip_grad_value_``: each value clipped to
            ``[-clip_value, clip_value]``).
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
        self.combine_norms: Callable[[Tensor, float], Tensor] | None = None
        self.skip_nonfinite = False
        self.skipped: list[int] = []
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
        self.gradients_in()

    def gradients_in(self) -> None:
        """Count a micro-step whose gradients are in; step and zero them once ``accumulate``
        micro-steps are in. ``update_params`` ends with it; a step that runs its own backward
        (a pipeline's schedule) calls it after, its loss divided by ``group_size()``."""
        group = self.group_size()
        self.micro_steps += 1
        self.iters += 1
        if self.micro_steps >= group:
            with phase("optimizer step"):
                self.step()
            self.zero_grad()
            self.micro_steps = 0

    def backward(self, loss: Tensor) -> None:
        """Backward ``loss`` as it is (scaled first under fp16); no division, no step. The
        time it then waits for the gradient collectives is measured for the step metrics
        (`trainrun.dist.waits`).

        Args:
            loss: a scalar tensor.
        """
        with waiting_for_gradients(loss):
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self) -> None:
        """Step the optimiser on the gradients there are: unscaled first under fp16, clipped
        to ``clip_grad`` where that is set (measuring ``grad_norm`` first); it does not zero
        them. With ``skip_nonfinite``, a step whose gradients are not all finite is skipped
        (the scaler still lowers its scale under fp16)."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        by_norm = bool(self.clip_grad) and "clip_value" not in self.clip_grad
        if self.clip_grad or self.measure_grad_norm or self.skip_nonfinite:
            params = [p for group in self.optimizer.param_groups for p in group["params"]
                      if p.grad is not None]
            if by_norm:  # it returns the norm before clipping
                self.grad_norm = clip_grad_norm(params, **self.clip_grad,
                                                combine=self.combine_norms)
            else:
                if self.measure_grad_norm or self.skip_nonfinite:
                    self.grad_norm = grad_norm(params, combine=self.combine_norms)
                if self.clip_grad:
                    nn.utils.clip_grad_value_(params, **self.clip_grad)
        if self.skip_nonfinite and not torch.isfinite(self.grad_norm):
            self.skipped.append(self.iters)
            if self.scaler is not None:
                self.scaler.update()
            return
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
        self.micro_steps = state.get("micro_steps", 0)  # (none from a DeepSpeed engine)
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


def each_wrapper(wrapper: Any) -> tuple[Any, ...]:
    """The optimiser wrappers ``wrapper`` holds: itself, or each of a dict of them."""
    return tuple(wrapper.values()) if isinstance(wrapper, Mapping) else (wrapper,)


def measure_grad_norm(wrapper: Any, on: bool) -> None:
    """Ask ``wrapper`` (or each of a dict of them) for the gradient norm of its next step,
    where it takes the request (`OptimWrapper`); others say their norm or none."""
    for one in each_wrapper(wrapper):
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


def _by_mesh(params: list[Tensor]) -> dict[Any, list[Tensor]]:
    """``params`` by the device mesh of their gradients (None: plain tensors)."""
    found: dict[Any, list[Tensor]] = {}
    for param in params:
        found.setdefault(getattr(param.grad, "device_mesh", None), []).append(param)
    return found


def grad_norm(params: list[Tensor], norm_type: float = 2.0,
              combine: Callable[[Tensor, float], Tensor] | None = None) -> Tensor:
    """The norm of all of ``params``' gradients together. Gradients sharded over different
    device meshes (tensor-parallel layers beside the others under FSDP) cannot be stacked in
    one DTensor operation: their norms are taken per mesh, made whole, then combined.
    ``combine``: makes it the whole model's, where ``params`` are one pipeline stage's."""
    total = _norm_by_mesh(params, _by_mesh(params), norm_type)
    return total if combine is None else combine(total, norm_type)


def _norm_by_mesh(params: list[Tensor], groups: dict[Any, list[Tensor]],
                  norm_type: float) -> Tensor:
    """`grad_norm` of ``params``, grouped by mesh already (``groups``, `_by_mesh`'s)."""
    if len(groups) <= 1:  # torch's own measure (no gradients at all included)
        return nn.utils.get_total_norm([p.grad for p in params], norm_type)
    norms = [nn.utils.get_total_norm([p.grad for p in group], norm_type)
             for group in groups.values()]
    norms = [norm.full_tensor() if hasattr(norm, "full_tensor") else norm for norm in norms]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def clip_grad_norm(params: list[Tensor], max_norm: float, norm_type: float = 2.0,
                   error_if_nonfinite: bool = False, foreach: bool | None = None,
                   combine: Callable[[Tensor, float], Tensor] | None = None) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_``, for gradients on several device meshes as well
    (see `grad_norm`), and for one pipeline stage's gradients (``combine`` makes their norm
    the whole model's); returns the norm before clipping."""
    groups = _by_mesh(params)
    if len(groups) <= 1 and combine is None:
        return nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite,
                                        foreach)
    total = _norm_by_mesh(params, groups, norm_type)  # (grouped once, for both)
    if combine is not None:
        total = combine(total, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is "
                           f"non-finite ({total.item()}); clipping them is meaningless")
    for group in groups.values():  # (one foreach operation may not mix meshes)
        nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach)
    return total
