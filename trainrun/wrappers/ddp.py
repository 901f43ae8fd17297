"""Strategy 'ddp': PyTorch's DistributedDataParallel behind the runner's step contract."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from trainrun.dist import is_distributed
from trainrun.wrappers.base import MakeOptimizer, Optimizers, Strategy
from trainrun.wrappers.base_model import loss_step

log = logging.getLogger("trainrun")


def parameters_without_grad_path(loss: Tensor, module: nn.Module) -> list[str]:
    """Names of trainable parameters that ``loss`` does not depend on (walks the graph)."""
    reached: set[int] = set()
    seen: set[Any] = set()
    pending = [loss.grad_fn]
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            reached.add(id(variable))
        pending.extend(next_node for next_node, _ in node.next_functions)
    return [name for name, p in module.named_parameters()
            if p.requires_grad and id(p) not in reached]


class MMDistributedDataParallel(DistributedDataParallel):
    """torch's DDP with ``train_step``/``val_step``/``test_step``.

    With ``detect_anomalous_params`` every training step names, as an error in the log, the
    parameters that got no gradient (which make DDP hang or fail without
    ``find_unused_parameters``). It walks the autograd graph: use it to debug, not to train.
    """

    def __init__(self, module: nn.Module, detect_anomalous_params: bool = False,
                 **ddp_kwargs: Any):
        super().__init__(module, **ddp_kwargs)
        self.detect_anomalous_params = detect_anomalous_params

    def _check_loss(self, loss: Tensor) -> None:
        unused = parameters_without_grad_path(loss, self.module)
        if unused:
            log.error("parameters that got no gradient this step: %s", ", ".join(unused))

    def train_step(self, data: Any, optim_wrapper: Any) -> dict[str, Tensor]:
        check = self._check_loss if self.detect_anomalous_params else None
        return loss_step(self, data, optim_wrapper, check)

    def val_step(self, data: Any) -> Any:
        return self.module.val_step(data)

    def test_step(self, data: Any) -> Any:
        return self.module.test_step(data)


class DDPStrategy(Strategy):
    """Every rank holds the whole model; gradients are averaged in buckets during backward."""

    name = "ddp"
    OPTIONS = {
        "find_unused_parameters": False,
        "bucket_cap_mb": 25,
        "broadcast_buffers": True,
        "gradient_as_bucket_view": False,
        "static_graph": False,
        "detect_anomalous_params": False,
    }

    def setup(self, model: nn.Module, device: torch.device,
              make_optimizer: MakeOptimizer | None) -> tuple[nn.Module, Optimizers | None]:
        model = model.to(device)
        if is_distributed():
            device_ids = [device.index] if device.type == "cuda" else None
            model = MMDistributedDataParallel(model, device_ids=device_ids, **self.options)
        optimizer = make_optimizer(self.unwrap(model)) if make_optimizer is not None else None
        return model, optimizer
