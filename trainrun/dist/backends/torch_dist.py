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
        return is_distributed()

    @property
    def rank(self) -> int:
        return get_rank()

    @property
    def world_size(self) -> int:
        return get_world_size()

    def all_gather_object(self, obj: Any) -> list:
        return _all_gather_object(obj, self._group())

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        holder = [obj]
        broadcast_object_list(holder, src, self._group())
        return holder[0]


class TorchCPUDist(_TorchDist):
    """torch.distributed on CPU tensors: the default group if it is gloo or mpi, else a gloo
    group made for it (so it also works in an nccl job)."""

    def _group(self) -> ProcessGroup | None:
        return cpu_group() if is_distributed() else None


class TorchCUDADist(_TorchDist):
    """torch.distributed on CUDA tensors: needs the default group to be nccl."""

    def _group(self) -> ProcessGroup | None:
        backend = get_backend()
        if backend is not None and backend != "nccl":
            raise RuntimeError(
                f"the 'torch_cuda' backend needs an nccl process group, this one is {backend!r}: "
                "use 'torch_cpu'"
            )
        return None
