"""The model contract every strategy relies on.

A model is an `nn.Module` whose ``forward(batch, mode)`` returns a dict of losses
(``mode='loss'``) or predictions (``mode='predict'``). `BaseModel` turns that into the three
steps the runner calls, so a strategy's wrapper only has to run the same steps around its
own forward.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from trainrun.dist import phase


def _mean(value: Tensor) -> Tensor:
    return value if value.dim() == 0 and value.is_floating_point() else value.mean()


def parse_losses(losses: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """Sum the entries whose name contains 'loss' into the loss to optimise.

    Returns that loss and the values to log (each entry's mean, plus ``loss``), still as
    tensors: turning them into numbers would wait for the device at every step.

    A floating-point scalar (the usual loss) is its own mean: it is used as it is, which gives
    the same bits without the two extra operations and the extra backward node of ``mean()``.
    """
    if not isinstance(losses, dict) or not losses:
        raise TypeError(
            f"forward(batch, mode='loss') must return a dict of tensors, got {losses!r}")
    log_vars: dict[str, Tensor] = {}
    parts = []
    for name, value in losses.items():
        if "loss" in name:
            mean = _mean(value)
            parts.append(mean)
            log_vars[name] = mean.detach()
        else:
            log_vars[name] = _mean(value.detach())
    if not parts:
        raise ValueError(
            f"forward(batch, mode='loss') returned no entry named '*loss*': {list(losses)}")
    loss = parts[0] if len(parts) == 1 else torch.stack(parts).sum()
    if len(parts) > 1 or "loss" not in losses:  # else log_vars['loss'] is loss.detach() already
        log_vars["loss"] = loss.detach()
    return loss, log_vars


def loss_step(model: nn.Module, data: Any, optim_wrapper: Any,
              check: Callable[[Tensor], None] | None = None) -> dict[str, Tensor]:
    """Forward ``data`` through ``model`` in loss mode inside the optimiser's context, then
    backward and (when the micro-steps are in) step. ``check`` sees the loss first."""
    with optim_wrapper.optim_context(model), phase("forward"):
        losses = model(data, mode="loss")
    loss, log_vars = parse_losses(losses)
    if check is not None:
        check(loss)
    optim_wrapper.update_params(loss)
    return log_vars


class BaseModel(nn.Module):
    """A model the runner can train, validate and test."""

    @abstractmethod
    def forward(self, batch: Any, mode: str = "loss") -> Any:
        """``mode='loss'``: a dict of losses; ``mode='predict'``: one prediction per sample."""

    def train_step(self, data: Any, optim_wrapper: Any) -> dict[str, Tensor]:
        """One optimisation step (or micro-step, with gradient accumulation) on ``data``."""
        return loss_step(self, data, optim_wrapper)

    def val_step(self, data: Any) -> Any:
        return self(data, mode="predict")

    def test_step(self, data: Any) -> Any:
        return self(data, mode="predict")
