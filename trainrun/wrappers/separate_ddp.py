"""Strategy 'separate_ddp': each trainable submodule in its own DDP, for models with several
optimisers (GANs), whose own ``train_step`` decides what is stepped when."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainrun.dist import is_distributed
from trainrun.wrappers.base import MakeOptimizer, Optimizers, Strategy, compile_module
from trainrun.wrappers.ddp import ddp_options, quiet_buffer_warning


def trainable_children(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children of ``module`` with trainable parameters: each gets its own DDP."""
    return [(name, child) for name, child in module.named_children()
            if any(p.requires_grad for p in child.parameters())]


class MMSeparateDistributedDataParallel(nn.Module):
    """Wraps every child of ``module`` that has trainable parameters in its own DDP.

    ``train_step`` is the module's own; the module's children are replaced in place, so its
    code calling ``self.generator(...)`` goes through DDP. ``plain_state_dict`` gives the state
    dict with the keys the unwrapped model has. ``val_step`` and ``test_step`` are the
    module's own too; ``no_sync`` turns off the gradient sync of every wrapped child.

    Args:
        module: the user's model (its own ``train_step`` steps each optimiser), already on
            its device.
        broadcast_buffers: each child's DDP syncs its buffers from rank 0 at every forward.
        find_unused_parameters: each child's DDP finds the parameters that got no gradient.
        **kwargs: further torch ``DistributedDataParallel`` arguments, for every child.
    """

    def __init__(self, module: nn.Module, broadcast_buffers: bool = False,
                 find_unused_parameters: bool = False, **kwargs: Any):
        super().__init__()
        self.module = module
        for name, child in trainable_children(module):
            options = ddp_options({"broadcast_buffers": broadcast_buffers,
                                   "find_unused_parameters": find_unused_parameters,
                                   **kwargs})
            with quiet_buffer_warning():
                ddp = DistributedDataParallel(child, **options)
            module._modules[name] = ddp

    def train_step(self, data: Any, optim_wrapper: Any) -> Any:
        return self.module.train_step(data, optim_wrapper)

    def val_step(self, data: Any) -> Any:
        return self.module.val_step(data)

    def test_step(self, data: Any) -> Any:
        return self.module.test_step(data)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """No gradient sync in any of the wrapped submodules."""
        with ExitStack() as stack:
            for child in self.module.children():
                if isinstance(child, DistributedDataParallel):
                    stack.enter_context(child.no_sync())
            yield

    def _wrapped_names(self) -> set[str]:
        return {name for name, child in self.module.named_children()
                if isinstance(child, DistributedDataParallel)}

    def plain_state_dict(self) -> dict[str, torch.Tensor]:
        """The state dict with the plain model's keys ('generator.module.w' -> 'generator.w')."""
        wrapped = self._wrapped_names()
        state = {}
        for key, value in self.module.state_dict().items():
            head, _, rest = key.partition(".")
            if head in wrapped and rest.startswith("module."):
                key = f"{head}.{rest[len('module.'):]}"
            state[key] = value
        return state

    def load_plain_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        wrapped = self._wrapped_names()
        renamed = {}
        for key, value in state.items():
            head, _, rest = key.partition(".")
            renamed[f"{head}.module.{rest}" if head in wrapped else key] = value
        self.module.load_state_dict(renamed)


class SeparateDDPStrategy(Strategy):
    """One DDP per trainable submodule; the model's own train_step steps its optimisers.

    ``strategy.type: separate_ddp``, for models with several optimisers (GANs, with
    ``optim.per_module``): the optimisers are built over the plain model, which is then
    wrapped in ``MMSeparateDistributedDataParallel`` in a distributed job (used as it is in
    a single process). With ``compile`` on, each submodule with trainable parameters is
    compiled before its DDP wrap. Checkpoints are one torch file with the plain model's keys.

    Args:
        broadcast_buffers: each submodule's DDP syncs its buffers from rank 0 at every
            forward.
        find_unused_parameters: each submodule's DDP finds the parameters that got no
            gradient.
    """

    name = "separate_ddp"

    WRAPPERS = (MMSeparateDistributedDataParallel,)
    OPTIONS = {"broadcast_buffers": False, "find_unused_parameters": False}
    ACCEPTS = dict.fromkeys(OPTIONS, "true or false")
    # the model's own train_step calls its children, not its forward
    COMPILES = "each submodule with trainable parameters, before its DDP wrap"

    def setup(self, model: nn.Module, device: torch.device,
              make_optimizer: MakeOptimizer | None) -> tuple[nn.Module, Optimizers | None]:
        model = model.to(device)
        if self.compile_options is not None:
            for name, child in trainable_children(model):
                compile_module(child, f"model.{name}", self.compile_options)
        optimizer = make_optimizer(model) if make_optimizer is not None else None
        if is_distributed():
            model = MMSeparateDistributedDataParallel(model, **self.options)
        return model, optimizer

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        if isinstance(model, MMSeparateDistributedDataParallel):
            return model.plain_state_dict()
        return model.state_dict()

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        if isinstance(model, MMSeparateDistributedDataParallel):
            model.load_plain_state_dict(state)
        else:
            model.load_state_dict(state)
