"""The model contract every strategy relies on.

A model is an ``nn.Module`` whose ``forward(batch, mode)`` returns a dict of losses
(``mode='loss'``) or predictions (``mode='predict'``). ``BaseModel`` turns that into the three
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

    The values to log stay tensors: turning them into numbers would wait for the device at
    every step. A floating-point scalar (the usual loss) is its own mean: it is used as it is,
    which gives the same bits without the two extra operations and the extra backward node of
    ``mean()``.

    Args:
        losses: what ``forward(batch, mode='loss')`` returned: tensors by name.

    Returns:
        The loss to optimise (the sum of the means of the entries whose name contains
        'loss') and the values to log: each entry's mean, detached, plus ``loss``, the sum.

    Raises:
        TypeError: ``losses`` is not a dict, or is empty.
        ValueError: no entry's name contains 'loss'.
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


def forward_arguments(model: nn.Module, data: Any, mode: str) -> tuple[tuple, dict[str, Any]]:
    """The arguments ``model`` is called with on a batch: ``(data,), {'mode': mode}``, unless
    the model inside the wrapper says otherwise with a ``forward_arguments(data, mode)`` method
    of its own (``trainrun.compat.mmengine``'s models unpack the batch into ``forward``'s
    arguments, as MMEngine calls them).

    Args:
        model: the model a step calls: a strategy's wrapper, or the model itself.
        data: the batch, on the model's device.
        mode: ``'loss'`` or ``'predict'``.

    Returns:
        The positional and the keyword arguments of the call.
    """
    own = _own_method(model, "forward_arguments")
    return own(data, mode) if own is not None else ((data,), {"mode": mode})


def _own_method(model: nn.Module, name: str) -> Callable[..., Any] | None:
    """The method ``name`` of the model inside a strategy's wrapper (or of ``model``
    itself), where it has one."""
    return getattr(getattr(model, "module", model), name, None)


def loss_step(model: nn.Module, data: Any, optim_wrapper: Any,
              check: Callable[[Tensor], None] | None = None) -> dict[str, Tensor]:
    """Forward ``data`` through ``model`` in loss mode inside the optimiser's context, then
    backward and (when the micro-steps are in) step. ``check`` sees the loss first. The losses
    are parsed by the model's own ``parse_losses`` where it has one (MMEngine's models do),
    else by ``parse_losses``.

    This is ``BaseModel.train_step``, shared with the strategies' wrappers, which call it with
    themselves as ``model`` so that the forward goes through their wrapping.

    Args:
        model: the module whose ``forward(data, mode='loss')`` returns a dict of losses.
        data: the batch, on the model's device.
        optim_wrapper: the runner's ``OptimWrapper`` or the strategy's own (its
            ``optim_context`` and ``update_params``).
        check: called with the loss before backward (DDP's unused-parameter check), or None.

    Returns:
        The values to log, as ``parse_losses`` gives them.
    """
    with optim_wrapper.optim_context(model), phase("forward"):
        args, kwargs = forward_arguments(model, data, "loss")
        losses = model(*args, **kwargs)
    loss, log_vars = (_own_method(model, "parse_losses") or parse_losses)(losses)
    if check is not None:
        check(loss)
    optim_wrapper.update_params(loss)
    return log_vars


class BaseModel(nn.Module):
    """A model the runner can train, validate and test.

    A subclass implements ``forward(batch, mode)``; the three steps the runner calls come
    from it. ``batch`` is what the data loader gives, moved to the model's device: for a data
    set whose items are dicts (the shipped ones), the collate makes it a dict of batched
    tensors, e.g. ``{'inputs': float32[B, 64], 'labels': int64[B]}``.

    A model that steps several optimisers itself (a GAN) overrides ``train_step`` instead;
    its ``optim_wrapper`` is then a dict of wrappers by submodule.
    """

    @abstractmethod
    def forward(self, batch: Any, mode: str = "loss") -> Any:
        """``mode='loss'``: a dict of losses; ``mode='predict'``: one prediction per sample.

        Args:
            batch: the batch, on the model's device (a dict of tensors from the collate).
            mode: ``'loss'`` while training; ``'predict'`` in validation and testing (in eval
                mode, without gradients, under autocast in the run's precision).

        Returns:
            With ``'loss'``, a dict of tensors by name. The entries whose name contains
            'loss' are summed into the loss to optimise; every entry is logged (its mean),
            and the sum as ``loss`` (averaged over ranks in ``metrics.jsonl``). With
            ``'predict'``, what the metrics' ``process(batch, outputs)`` receives as
            ``outputs``, one prediction per sample in the batch's order: class indices
            (int64, shape ``[B]``) or class scores (``[B, classes]``) for ``Accuracy``, which
            compares them with ``batch['labels']``; a number per sample (``[B]``) for
            ``MeanOf``.

        Raises:
            ValueError: any other mode (the shipped models raise it; the runner passes only
                these two).
        """

    def train_step(self, data: Any, optim_wrapper: Any) -> dict[str, Tensor]:
        """One optimisation step (or micro-step, with gradient accumulation) on ``data``.

        The forward runs in ``optim_wrapper.optim_context`` (autocast, and no gradient sync
        on micro-steps that do not step); the loss goes to ``optim_wrapper.update_params``.

        Args:
            data: the batch, on the model's device.
            optim_wrapper: the runner's ``OptimWrapper`` (or the strategy's own).

        Returns:
            The values to log, each entry of the loss dict's mean (detached tensors) plus
            ``loss``, their sum. The ``after_train_iter`` hooks get it as ``outputs``.

        Raises:
            TypeError: ``forward`` returned no dict of tensors (or an empty one).
            ValueError: no entry's name contains 'loss'.
        """
        return loss_step(self, data, optim_wrapper)

    def val_step(self, data: Any) -> Any:
        """Predict ``data`` for validation: ``forward(data, mode='predict')``.

        Args:
            data: the batch, on the model's device.

        Returns:
            The predictions, which each validation metric's ``process`` receives.
        """
        return self(data, mode="predict")

    def test_step(self, data: Any) -> Any:
        """Predict ``data`` for testing: ``forward(data, mode='predict')``.

        Args:
            data: the batch, on the model's device.

        Returns:
            The predictions, which each test metric's ``process`` receives.
        """
        return self(data, mode="predict")
