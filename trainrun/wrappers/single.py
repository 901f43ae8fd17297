"""Strategy 'none': the model as it is, on one device."""

from __future__ import annotations

import logging

import torch
from torch import nn

from trainrun.dist import get_world_size
from trainrun.wrappers.base import MakeOptimizer, Optimizers, Strategy, compile_module

log = logging.getLogger("trainrun")


class SingleDeviceStrategy(Strategy):
    """No wrapping and no gradient sync: each process trains its own copy.

    ``strategy.type: none``: the model is moved to the device (and compiled when ``compile``
    is on) and used as it is. In a job of several processes each trains on its own, with a
    warning (use ``ddp`` to average the gradients). It takes no options; checkpoints are one
    torch file from rank 0.
    """

    name = "none"
    COMPILES = "the model"

    def setup(self, model: nn.Module, device: torch.device,
              make_optimizer: MakeOptimizer | None) -> tuple[nn.Module, Optimizers | None]:
        if get_world_size() > 1:
            log.warning("strategy 'none' in a job of %d processes: each trains on its own, "
                        "gradients are not averaged (use strategy 'ddp' for that)",
                        get_world_size())
        model = model.to(device)
        if self.compile_options is not None:
            compile_module(model, "model", self.compile_options)
        return model, make_optimizer(model) if make_optimizer is not None else None
