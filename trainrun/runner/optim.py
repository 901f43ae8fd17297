"""Optimiser wrapper: backward, gradient accumulation, clipping and mixed precision.

A model's ``train_step`` runs its forward inside ``optim_context`` and hands the loss to
``update_params``; this class decides the rest, so models never repeat it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from trainrun.dist import phase
from trainrun.dist.device import DTYPES, autocast_dtype

PRECISIONS = tuple(DTYPES)  # the names of `precision`


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
    ``precision`` (fp16 with a gradient scaler)."""

    def __init__(self, optimizer: Optimizer, accumulate: int = 1,
                 clip_grad: float | dict[str, float] | None = None, precision: str = "fp32",
                 device_type: str = "cpu"):
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
        self.iters = 0  # micro-steps taken in all, once `set_total` has been called
        self.max_iters: int | None = None

    def set_total(self, done_iters: int, max_iters: int) -> None:
        """Where training stands and where it ends, so that the last ``max_iters % accumulate``
        micro-steps form a group of their own (their loss divided by their number, then a
        step) instead of being left unapplied."""
        self.iters, self.max_iters = done_iters, max_iters

    def group_size(self) -> int:
        """Micro-steps in the current accumulation group."""
        if self.max_iters is None:
            return self.accumulate
        tail_start = self.max_iters - self.max_iters % self.accumulate
        return self.accumulate if self.iters < tail_start else self.max_iters - tail_start

    @property
    def will_step(self) -> bool:
        """Whether the current micro-step ends with an optimiser step (and gradient sync)."""
        return self.micro_steps + 1 >= self.group_size()

    def optim_context(self, model: nn.Module) -> AbstractContextManager[None]:
        """Around the forward: no gradient sync on micro-steps that do not step, and autocast."""
        return _OptimContext(self, model)

    def update_params(self, loss: Tensor) -> None:
        """Backward ``loss``; step and zero the gradients once ``accumulate`` micro-steps are in."""
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
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.clip_grad:
            params = [p for group in self.optimizer.param_groups for p in group["params"]
                      if p.grad is not None]
            self.grad_norm = nn.utils.clip_grad_norm_(params, **self.clip_grad)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def get_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def _params(self) -> list[Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def state_dict(self) -> dict[str, Any]:
        """What the wrapper adds to the optimiser's own state (saved by the strategy).

        Between optimiser steps it holds this rank's accumulated gradients too (copied to the
        CPU, as they travel to rank 0), without which a run resumed there would step on fewer
        micro-batches than one that never stopped.
        """
        grads = None
        if self.micro_steps:
            grads = [None if p.grad is None else p.grad.detach().to("cpu", copy=True)
                     for p in self._params()]
        return {"micro_steps": self.micro_steps,
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "grads": grads}

    def load_state_dict(self, state: dict[str, Any]) -> None:
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


class OptimWrapperDict(dict):
    """One `OptimWrapper` per named submodule, for models with several optimisers (GANs).

    The model's own ``train_step`` picks ``optim_wrapper['generator']`` and so on.
    """

    def get_lr(self) -> float:
        return next(iter(self.values())).get_lr()

    def set_total(self, done_iters: int, max_iters: int) -> None:
        for wrapper in self.values():
            wrapper.set_total(done_iters, max_iters)

    def state_dict(self) -> dict[str, Any]:
        return {name: wrapper.state_dict() for name, wrapper in self.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, wrapper in self.items():
            wrapper.load_state_dict(state[name])
