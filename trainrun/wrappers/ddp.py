"""Strategy 'ddp': PyTorch's DistributedDataParallel behind the runner's step contract."""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from trainrun.dist import is_distributed
from trainrun.messages import human
from trainrun.wrappers.base import MakeOptimizer, Optimizers, Strategy, compile_module
from trainrun.wrappers.base_model import loss_step
from trainrun.wrappers.memory import ParamSpec, StateBytes

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


_HAS_FORWARD_SYNC = "forward_sync_buffers" in inspect.signature(
    DistributedDataParallel.__init__).parameters


def ddp_options(options: dict[str, Any]) -> dict[str, Any]:
    """DDP's keyword arguments with ``broadcast_buffers`` as this torch spells it.

    torch 2.13 deprecates ``broadcast_buffers`` (warning on every wrap): True becomes
    ``forward_sync_buffers=True``; False stays, as torch itself advises until it offers a way
    to skip the buffer sync at construction (``quiet_buffer_warning`` silences that case).
    """
    if _HAS_FORWARD_SYNC and options.get("broadcast_buffers") is True:
        options = {k: v for k, v in options.items() if k != "broadcast_buffers"}
        options["forward_sync_buffers"] = True
    return options


@contextmanager
def quiet_buffer_warning() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated",
                                category=FutureWarning)
        yield


class MMDistributedDataParallel(DistributedDataParallel):
    """torch's DDP with ``train_step``/``val_step``/``test_step``.

    ``train_step(data, optim_wrapper)`` runs the forward in loss mode through DDP (so that
    gradients are averaged over the ranks in backward) and returns the values to log, as
    ``BaseModel.train_step`` does; ``val_step`` and ``test_step`` are the wrapped model's own,
    without DDP. The user's model is ``.module``.

    With ``detect_anomalous_params`` every training step names, as an error in the log, the
    parameters that got no gradient (which make DDP hang or fail without
    ``find_unused_parameters``). It walks the autograd graph: use it to debug, not to train.

    Args:
        module: the user's model, already on its device.
        detect_anomalous_params: name the parameters that got no gradient at every step.
        **ddp_kwargs: torch's ``DistributedDataParallel`` arguments (``device_ids``,
            ``output_device``, ``broadcast_buffers``, ``find_unused_parameters``,
            ``bucket_cap_mb``, ``gradient_as_bucket_view``, ``static_graph``, ...);
            ``broadcast_buffers=True`` becomes ``forward_sync_buffers=True`` where torch
            deprecates the former.
    """

    def __init__(self, module: nn.Module, detect_anomalous_params: bool = False,
                 **ddp_kwargs: Any):
        with quiet_buffer_warning():
            super().__init__(module, **ddp_options(ddp_kwargs))
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
    """Every rank holds the whole model; gradients are averaged in buckets during backward.

    ``strategy.type: ddp``. In a distributed job the model is wrapped in
    ``MMDistributedDataParallel`` (with ``device_ids`` set to this rank's CUDA device);
    in a single process it is used as it is. With ``compile`` on, the model is compiled
    before the wrap. Checkpoints are one torch file from rank 0.

    Args:
        find_unused_parameters: let DDP find, every step, the parameters the loss does not
            depend on (needed when some get no gradient; it costs a graph walk).
        bucket_cap_mb: the size of DDP's gradient buckets, in megabytes.
        broadcast_buffers: sync the buffers (batch-norm statistics) from rank 0 at every
            forward.
        gradient_as_bucket_view: make the gradients views into DDP's buckets, which saves a
            copy of the gradients.
        static_graph: tell DDP that the set of used parameters is the same at every step.
        detect_anomalous_params: log the parameters that got no gradient at every step (to
            debug, not to train).
    """

    name = "ddp"

    WRAPPERS = (DistributedDataParallel,)  # MMDistributedDataParallel too
    COMPILES = "the model, before the DDP wrap"
    OPTIONS = {
        "find_unused_parameters": False,
        "bucket_cap_mb": 25,
        "broadcast_buffers": True,
        "gradient_as_bucket_view": False,
        "static_graph": False,
        "detect_anomalous_params": False,
    }
    ACCEPTS = {**dict.fromkeys(OPTIONS, "true or false"), "bucket_cap_mb": "a number > 0"}

    @classmethod
    def memory_plan(cls, specs: Sequence[ParamSpec], world_size: int, cfg: Mapping[str, Any],
                    model: nn.Module | None = None) -> StateBytes:
        """Every rank holds everything (`Strategy`'s plan); DDP's gradient buckets, a
        communication buffer, are named beside it."""
        plan = super().memory_plan(specs, world_size, cfg, model)
        if world_size > 1 and not cls.options_in(cfg)["gradient_as_bucket_view"]:
            plan.notes.append(f"not in the total: DDP's gradient buckets, a second copy of the "
                              f"gradients ({human(plan.kind('grads'))}); "
                              f"strategy.gradient_as_bucket_view: true makes them one")
        return plan

    def setup(self, model: nn.Module, device: torch.device,
              make_optimizer: MakeOptimizer | None) -> tuple[nn.Module, Optimizers | None]:
        model = model.to(device)
        if self.compile_options is not None:
            compile_module(model, "model", self.compile_options)
        if is_distributed():
            device_ids = [device.index] if device.type == "cuda" else None
            model = MMDistributedDataParallel(model, device_ids=device_ids, **self.options)
        optimizer = make_optimizer(self.unwrap(model)) if make_optimizer is not None else None
        return model, optimizer
