"""The backend of a single process: gathering returns the one object."""

from __future__ import annotations

from typing import Any

from trainrun.dist.backends.base import BaseDistBackend


class NonDist(BaseDistBackend):
    """One process, no communication."""

    @property
    def is_initialized(self) -> bool:
        return False

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def all_gather_object(self, obj: Any) -> list:
        return [obj]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj
