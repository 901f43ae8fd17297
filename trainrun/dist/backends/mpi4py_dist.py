"""The backend over MPI through mpi4py, for jobs started by mpirun without torch.distributed."""

from __future__ import annotations

from typing import Any

from trainrun.dist.backends.base import BaseDistBackend


def _mpi() -> Any:
    # mpi4py 4 raises RuntimeError, not ImportError, when the MPI library itself is missing.
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError) as exc:
        raise ImportError(
            "the 'mpi4py' backend needs mpi4py and an MPI library "
            f"(pip install mpi4py; apt-get install openmpi-bin): {exc}"
        ) from exc
    return MPI


class MPI4PyDist(BaseDistBackend):
    """Objects over MPI's COMM_WORLD (pickled by mpi4py)."""

    def __init__(self) -> None:
        self._comm = _mpi().COMM_WORLD

    @property
    def is_initialized(self) -> bool:
        return bool(_mpi().Is_initialized()) and self._comm.Get_size() > 1

    @property
    def rank(self) -> int:
        return self._comm.Get_rank()

    @property
    def world_size(self) -> int:
        return self._comm.Get_size()

    def all_gather_object(self, obj: Any) -> list:
        return self._comm.allgather(obj)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self._comm.bcast(obj, root=src)
