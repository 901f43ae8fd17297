"""``mmengine.model``: ``BaseModel`` with MMEngine's calling convention, ``BaseDataPreprocessor``,
and the model wrappers.

MMEngine calls a model's ``forward`` with the batch unpacked: a dict batch as keyword
arguments, a list or tuple batch as positional ones, and ``mode`` ('loss', 'predict' or
'tensor'), after the model's ``data_preprocessor`` has moved it to the model's device.
trainrun calls ``forward(batch, mode)``. ``BaseModel`` bridges the two through
``forward_arguments``, which every trainrun strategy asks the model for, so the forward still
runs through the strategy's wrapper (DDP's gradient hooks, FSDP's gathers).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from trainrun.dist.device import map_tensors
from trainrun.runner.schema import ConfigError
from trainrun.wrappers import BaseModel as _Model
from trainrun.wrappers import (
    MMDistributedDataParallel,
    MMFullyShardedDataParallel,
    MMSeparateDistributedDataParallel,
    is_model_wrapper,
)

MODES = ("loss", "predict", "tensor")


def unpacked(data: Any, mode: str) -> tuple[tuple, dict[str, Any]]:
    """``forward``'s arguments for ``data`` as MMEngine passes them: a dict's items as keyword
    arguments, a list's or a tuple's items as positional ones, and ``mode``.

    Raises:
        TypeError: ``data`` is neither (MMEngine refuses it too).
    """
    if isinstance(data, Mapping):
        return (), {**data, "mode": mode}
    if isinstance(data, (list, tuple)):
        return tuple(data), {"mode": mode}
    raise TypeError(f"the data preprocessor's output must be a dict, a list or a tuple to call "
                    f"forward with (as MMEngine does), got {type(data).__name__}")


def cast_data(data: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Tensors of a (nested) batch on ``device``; anything else as it is."""
    return map_tensors(data, lambda tensor: tensor.to(device, non_blocking=non_blocking))


class BaseDataPreprocessor(nn.Module):
    """Moves a batch to the model's device: MMEngine's default data preprocessor.

    It holds no state of its own, so a model's ``state_dict`` has the keys MMEngine gives it.

    Args:
        non_blocking: copy tensors to the device without waiting (pinned memory to a GPU).
    """

    def __init__(self, non_blocking: bool = False) -> None:
        super().__init__()
        self.non_blocking = non_blocking
        # follows the model's device through .to() and the strategies' moves; not saved
        self.register_buffer("_device_probe", torch.empty(0), persistent=False)

    @property
    def device(self) -> torch.device:
        """The device the model's parameters are on."""
        return self._device_probe.device

    def cast_data(self, data: Any) -> Any:
        """``data`` with its tensors on ``device``."""
        return cast_data(data, self.device, self.non_blocking)

    def forward(self, data: Any, training: bool = False) -> Any:
        """The batch as ``forward`` gets it: here, on the model's device.

        Args:
            data: the batch the data loader gave.
            training: whether it is for a training step (a subclass may augment then).
        """
        return self.cast_data(data)


class BaseModel(_Model):
    """A model written for MMEngine: ``forward(*inputs, mode)`` with the batch unpacked.

    ``train_step``, ``val_step`` and ``test_step`` behave as MMEngine's: the batch goes
    through ``data_preprocessor``, then to ``forward`` unpacked, with ``mode='loss'``
    (a dict of losses, parsed by ``parse_losses``) or ``mode='predict'`` (what the metrics'
    ``process`` gets as ``data_samples``).

    Args:
        data_preprocessor: a module, or a config dict built by the compat ``MODELS`` registry;
            None: ``BaseDataPreprocessor`` (moves the batch to the model's device).
        init_cfg: MMEngine's weight initialisation config; refused (initialise the weights in
            ``__init__``, or in ``init_weights``, which the compat Runner calls before
            training as MMEngine's does).

    Raises:
        ConfigError: an ``init_cfg`` was given.
    """

    def __init__(self, data_preprocessor: Mapping[str, Any] | nn.Module | None = None,
                 init_cfg: Any = None) -> None:
        super().__init__()
        if init_cfg is not None:
            raise ConfigError("model.init_cfg: not supported by trainrun.compat.mmengine; "
                              "initialise the weights in the model's __init__")
        if data_preprocessor is None:
            data_preprocessor = BaseDataPreprocessor()
        elif isinstance(data_preprocessor, Mapping):
            from trainrun.compat.mmengine.registry import MODELS

            data_preprocessor = MODELS.build(data_preprocessor)
        if not isinstance(data_preprocessor, nn.Module):
            raise TypeError(f"data_preprocessor: expected an nn.Module or a config dict, got "
                            f"{type(data_preprocessor).__name__}")
        self.data_preprocessor = data_preprocessor
        self._is_init = False

    @property
    def is_init(self) -> bool:
        """Whether ``init_weights`` has run."""
        return self._is_init

    def init_weights(self) -> None:
        """MMEngine's ``BaseModule.init_weights`` without ``init_cfg``: each direct child's
        own ``init_weights()`` where it has one and has not run it. The compat Runner calls
        it before training, as MMEngine's Runner does; a model that overrides it initialises
        its weights there (and calls this for its children's)."""
        if self._is_init:
            return
        for child in self.children():
            if callable(getattr(child, "init_weights", None)) and \
                    not getattr(child, "is_init", False):
                child.init_weights()
        self._is_init = True

    def forward_arguments(self, data: Any, mode: str) -> tuple[tuple, dict[str, Any]]:
        """What trainrun's strategies call ``forward`` with: the preprocessed batch, unpacked.

        Args:
            data: the batch the data loader gave.
            mode: ``'loss'`` (training) or ``'predict'``.
        """
        return unpacked(self.data_preprocessor(data, mode == "loss"), mode)

    def _run_forward(self, data: Any, mode: str) -> Any:
        """``forward`` on an already preprocessed batch, unpacked (MMEngine's helper)."""
        args, kwargs = unpacked(data, mode)
        return self(*args, **kwargs)

    def val_step(self, data: Any) -> Any:
        """``forward(..., mode='predict')`` on the preprocessed batch."""
        return self._run_forward(self.data_preprocessor(data, False), "predict")

    def test_step(self, data: Any) -> Any:
        """``forward(..., mode='predict')`` on the preprocessed batch."""
        return self._run_forward(self.data_preprocessor(data, False), "predict")

    def parse_losses(self, losses: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss to optimise and the values to log, as MMEngine computes them: each entry's
        mean (a list of tensors: the sum of their means), and the sum of the entries named
        '*loss*' added left to right; the values to log are detached, ``loss`` first.

        Raises:
            TypeError: an entry that is neither a tensor nor a list of tensors.
        """
        means: dict[str, Tensor] = {}
        for name, value in losses.items():
            if isinstance(value, Tensor):
                means[name] = value.mean()
            elif isinstance(value, (list, tuple)) and all(isinstance(v, Tensor) for v in value):
                means[name] = sum(v.mean() for v in value)
            else:
                raise TypeError(f"losses[{name!r}]: expected a tensor or a list of tensors, "
                                f"got {type(value).__name__}")
        loss = sum(value for name, value in means.items() if "loss" in name)
        if not isinstance(loss, Tensor):
            raise ValueError(f"forward(..., mode='loss') returned no entry named '*loss*': "
                             f"{list(losses)}")
        log_vars = {"loss": loss.detach(), **{k: v.detach() for k, v in means.items()}}
        return loss, log_vars


__all__ = [
    "BaseDataPreprocessor",
    "BaseModel",
    "MMDistributedDataParallel",
    "MMFullyShardedDataParallel",
    "MMSeparateDistributedDataParallel",
    "is_model_wrapper",
]
