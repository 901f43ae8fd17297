"""The backend of a single process: gathering returns the one object."""

from __future__ import annotations

from typing import Any

from trainrun.dist.backends.base import BaseDistBackend


class NonDist(BaseDistBackend):
    """One process, no communication: the backend ``get_dist_backend`` picks when no process
    group is initialised."""

    @property
    def is_initialized(self) -> bool:
        """Always False, as there is no multi-process job."""
        return False

    @property
    def rank(self) -> int:
        """Always 0."""
        return 0

    @property
    def world_size(self) -> int:
        """Always 1."""
        return 1

    def all_gather_object(self, obj: Any) -> list:
        """The one process's object, as a list.

        Args:
            obj: this process's object.

        Returns:
            ``[obj]``.
        """
        return [obj]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """The object itself: there is nobody to send it to.

        Args:
            obj: this process's object.
            src: the sending rank; there is only 0.

        Returns:
            ``obj``.
        """
        return obj
