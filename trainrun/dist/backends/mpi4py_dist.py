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
    """Objects over MPI's COMM_WORLD (pickled by mpi4py), without torch.distributed.

    Raises:
        ImportError: on construction, when mpi4py or the MPI library is missing (the
            message says what to install).
    """

    def __init__(self) -> None:
        self._comm = _mpi().COMM_WORLD

    @property
    def is_initialized(self) -> bool:
        """Whether MPI is initialised and COMM_WORLD has more than one process."""
        return bool(_mpi().Is_initialized()) and self._comm.Get_size() > 1

    @property
    def rank(self) -> int:
        """This process's rank in COMM_WORLD."""
        return self._comm.Get_rank()

    @property
    def world_size(self) -> int:
        """The number of processes in COMM_WORLD."""
        return self._comm.Get_size()

    def all_gather_object(self, obj: Any) -> list:
        """Gather a picklable object from every rank, with MPI's allgather.

        Args:
            obj: this rank's object.

        Returns:
            Every rank's ``obj``, in rank order.
        """
        return self._comm.allgather(obj)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Send ``src``'s picklable object to every rank, with MPI's bcast.

        Args:
            obj: the object to send on ``src``; on the other ranks it is not used.
            src: the rank in COMM_WORLD whose object is sent.

        Returns:
            ``src``'s ``obj``, on every rank.
        """
        return self._comm.bcast(obj, root=src)
