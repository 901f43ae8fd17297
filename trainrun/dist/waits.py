"""How long this rank waits at the end of backward for its gradient collectives.

In synchronous data parallelism the ranks meet in the gradient collectives (DDP's bucket
all-reduces, fully sharded data parallel's reduce-scatters, DeepSpeed's reduction): the ranks
that finish their own work first wait there for the last one, or for a slow link. Autograd
calls back once it has computed this rank's gradients; the time from then until backward
returns is that wait. Measured with the CPU's clock only: no device synchronisation is added,
so on a GPU whose collectives wait on the device (NCCL) it is close to nothing and the wait
shows in the time around it instead.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as torch_dist
from torch.autograd import Variable


class _Clock:
    """This process's wait so far, and when autograd finished the current backward."""

    waited = 0.0
    ready: float | None = None


def _mark_ready() -> None:
    _Clock.ready = time.perf_counter()


def _on_loss_grad(grad: torch.Tensor) -> None:
    # runs as backward starts; the callback runs once autograd has computed every gradient,
    # before the ones DDP and FSDP queue later to wait for their collectives
    Variable._execution_engine.queue_callback(_mark_ready)


class waiting_for_gradients:  # noqa: N801 - used as a context manager, like a function
    """Around a backward of ``loss``: adds the time spent after autograd computed this rank's
    gradients (waiting for the gradient collectives) to what `take_gradient_wait` returns.

    Nothing is measured in a process without a process group, or when ``loss`` needs no
    gradient.

    Args:
        loss: the tensor whose backward runs inside the block.
    """

    __slots__ = ("armed",)

    def __init__(self, loss: torch.Tensor) -> None:
        self.armed = bool(loss.requires_grad and torch_dist.is_available()
                          and torch_dist.is_initialized())
        if self.armed:
            loss.register_hook(_on_loss_grad)

    def __enter__(self) -> None:
        _Clock.ready = None

    def __exit__(self, exc_type: type | None, *exc_info: Any) -> None:
        ready, _Clock.ready = _Clock.ready, None
        if self.armed and exc_type is None and ready is not None:
            _Clock.waited += time.perf_counter() - ready


def take_gradient_wait() -> float:
    """The seconds waited for gradient collectives since the last call (0.0 if none).

    Returns:
        The wait the `waiting_for_gradients` blocks measured since then.
    """
    waited, _Clock.waited = _Clock.waited, 0.0
    return waited
