"""How long this rank waits in collectives: for its gradients at the end of backward, and in
the runner's own small collectives between steps.

In synchronous data parallelism the ranks meet in the gradient collectives (DDP's bucket
all-reduces, fully sharded data parallel's reduce-scatters, DeepSpeed's reduction): the ranks
that finish their own work first wait there for the last one, or for a slow link. Autograd
calls back once it has computed this rank's gradients; the time from then until backward
returns is that wait (`waiting_for_gradients`). Between steps the runner waits in a few
collectives of its own (the agreement on a stop signal, the logged numbers reaching rank 0):
`waiting` times those blocks whole. Measured with the CPU's clock only: no device
synchronisation is added, so on a GPU whose collectives wait on the device (NCCL) the wait is
close to nothing and shows in the time around it instead. Nothing is measured in a process
without a process group.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as torch_dist
from torch.autograd import Variable


class _Clock:
    """This process's wait since it was last taken, and when autograd finished the current
    backward."""

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
    gradients (waiting for the gradient collectives) to what `take_wait` returns.

    Nothing is measured when ``loss`` needs no gradient.

    Args:
        loss: the tensor whose backward runs inside the block.
    """

    __slots__ = ("armed",)

    def __init__(self, loss: torch.Tensor) -> None:
        self.armed = bool(loss.requires_grad and _grouped())
        if self.armed:
            loss.register_hook(_on_loss_grad)

    def __enter__(self) -> None:
        _Clock.ready = None

    def __exit__(self, exc_type: type | None, *exc_info: Any) -> None:
        ready, _Clock.ready = _Clock.ready, None
        if self.armed and exc_type is None and ready is not None:
            _Clock.waited += time.perf_counter() - ready


class waiting:  # noqa: N801 - used as a context manager, like a function
    """Around a collective (or a wait for one): adds the block's time to what `take_wait`
    returns."""

    __slots__ = ("started",)

    def __enter__(self) -> None:
        self.started = time.perf_counter() if _grouped() else None

    def __exit__(self, *exc_info: Any) -> None:
        if self.started is not None:
            _Clock.waited += time.perf_counter() - self.started


def _grouped() -> bool:
    return torch_dist.is_available() and torch_dist.is_initialized()


def take_wait() -> float:
    """The seconds waited in collectives since the last call (0.0 if none).

    Returns:
        What the `waiting_for_gradients` and `waiting` blocks measured since then.
    """
    waited, _Clock.waited = _Clock.waited, 0.0
    return waited
