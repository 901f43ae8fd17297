"""Backends over torch.distributed: on CPU tensors (gloo) and on CUDA tensors (nccl)."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

from torch.distributed import ProcessGroup

from trainrun.dist.backends.base import BaseDistBackend
from trainrun.dist.info import get_backend, get_rank, get_world_size, is_distributed
from trainrun.dist.objects import _all_gather_object, broadcast_object_list, cpu_group


class _TorchDist(BaseDistBackend):
    """What both torch backends share; each names the group it talks over."""

    @abstractmethod
    def _group(self) -> ProcessGroup | None: ...

    @property
    def is_initialized(self) -> bool:
        """Whether this process has joined the default process group."""
        return is_distributed()

    @property
    def rank(self) -> int:
        """This process's rank in the default group (0 when not distributed)."""
        return get_rank()

    @property
    def world_size(self) -> int:
        """The number of processes in the default group (1 when not distributed)."""
        return get_world_size()

    def all_gather_object(self, obj: Any) -> list:
        """Gather a picklable object from every rank.

        Args:
            obj: this rank's object; its own entry in the result is ``obj`` itself.

        Returns:
            Every rank's ``obj``, in rank order (``[obj]`` when not distributed).
        """
        return _all_gather_object(obj, self._group())

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Send ``src``'s picklable object to every rank.

        Args:
            obj: the object to send on ``src``; on the other ranks it is not used.
            src: the rank whose object is sent.

        Returns:
            ``src``'s ``obj``, on every rank (``obj`` when not distributed).
        """
        holder = [obj]
        broadcast_object_list(holder, src, self._group())
        return holder[0]


class TorchCPUDist(_TorchDist):
    """torch.distributed on CPU tensors: the default group if it is gloo or mpi, else a gloo
    group made for it (so it also works in an nccl job).

    Its members are those of ``BaseDistBackend``, over the default process group.
    """

    def _group(self) -> ProcessGroup | None:
        return cpu_group() if is_distributed() else None


class TorchCUDADist(_TorchDist):
    """torch.distributed on CUDA tensors: needs the default group to be nccl.

    Its members are those of ``BaseDistBackend``, over the default process group.

    Raises:
        RuntimeError: when it gathers or broadcasts in a default group whose backend is not
            nccl (the message suggests 'torch_cpu').
    """

    def _group(self) -> ProcessGroup | None:
        backend = get_backend()
        if backend is not None and backend != "nccl":
            raise RuntimeError(
                f"the 'torch_cuda' backend needs an nccl process group, this one is {backend!r}: "
                "use 'torch_cpu'"
            )
        return None
