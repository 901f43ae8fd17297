"""The interface of an object-communication backend."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class BaseDistBackend(ABC):
    """Gathers and broadcasts picklable objects over one communication library.

    Code that must run under several libraries (distributed metric evaluation above all)
    talks to this interface and lets ``get_dist_backend`` pick the implementation:
    ``NonDist``, ``TorchCPUDist``, ``TorchCUDADist`` or ``MPI4PyDist``. Their constructors
    take no arguments.
    """

    @property
    @abstractmethod
    def is_initialized(self) -> bool:
        """Whether the library has a running multi-process job this backend can use."""

    @property
    @abstractmethod
    def rank(self) -> int:
        """This process's rank (0 when not initialised)."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """Number of processes (1 when not initialised)."""

    @abstractmethod
    def all_gather_object(self, obj: Any) -> list:
        """Gather a picklable object from every rank.

        Args:
            obj: this rank's object.

        Returns:
            Every rank's ``obj``, in rank order.
        """

    @abstractmethod
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Send ``src``'s picklable object to every rank.

        Args:
            obj: the object to send on ``src``; on the other ranks it is not used.
            src: the rank whose object is sent.

        Returns:
            ``src``'s ``obj``, on every rank.
        """
