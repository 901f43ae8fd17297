"""Who am I in the job: rank, world size, local rank and friends.

Every function here answers sensibly in a process that never joined a process group
(rank 0 of a world of 1), so library code can call them unconditionally.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as torch_dist
from torch.distributed import ProcessGroup

F = TypeVar("F", bound=Callable[..., Any])

# The group of the ranks on this node, set by `launch.init_local_group`, with the default
# group it was made in: once that default group is gone, so is the local group. Both are held
# weakly: a group kept alive past `destroy_process_group` is torn down at interpreter exit,
# where gloo's threads can abort the process.
_LOCAL_GROUP: tuple[weakref.ref, weakref.ref] | None = None


def is_distributed() -> bool:
    """Whether this process has joined the default process group.

    Returns:
        True once it has (``init_dist``); False in a process that never joined one, or
        where torch.distributed is not available.
    """
    return torch_dist.is_available() and torch_dist.is_initialized()


def get_default_group() -> ProcessGroup | None:
    """The default (world) process group.

    Returns:
        The group every rank joined, or None when not distributed.
    """
    return torch_dist.distributed_c10d._get_default_group() if is_distributed() else None


def get_backend(group: ProcessGroup | None = None) -> str | None:
    """The communication backend of ``group``.

    Args:
        group: the process group; None for the default group.

    Returns:
        The backend's name ('gloo', 'nccl', 'mpi', ...), or None when not distributed.
    """
    if not is_distributed():
        return None
    return str(torch_dist.get_backend(group or get_default_group()))


def get_world_size(group: ProcessGroup | None = None) -> int:
    """The number of processes in ``group``.

    Args:
        group: the process group; None for the default group.

    Returns:
        How many ranks ``group`` has; 1 when not distributed.
    """
    return torch_dist.get_world_size(group) if is_distributed() else 1


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group``.

    Args:
        group: the process group; None for the default group.

    Returns:
        The rank, from 0; 0 when not distributed.
    """
    return torch_dist.get_rank(group) if is_distributed() else 0


def get_dist_info(group: ProcessGroup | None = None) -> tuple[int, int]:
    """This process's rank and the world size of ``group``, in one call.

    Args:
        group: the process group; None for the default group.

    Returns:
        ``(rank, world_size)``; ``(0, 1)`` when not distributed.
    """
    return get_rank(group), get_world_size(group)


def is_main_process(group: ProcessGroup | None = None) -> bool:
    """Whether this process is rank 0 of ``group``, the one that logs and writes files.

    Args:
        group: the process group; None for the default group.

    Returns:
        True on rank 0, and in a process that is not distributed; False elsewhere.
    """
    return get_rank(group) == 0


def get_local_group() -> ProcessGroup | None:
    """The group of the ranks on this node, once ``init_local_group`` has built it.

    Returns:
        This node's group; None before ``init_local_group`` (in the current default group)
        and when not distributed.
    """
    if _LOCAL_GROUP is None or _LOCAL_GROUP[0]() is not get_default_group():
        return None
    return _LOCAL_GROUP[1]()


def _set_local_group(group: ProcessGroup | None) -> None:
    global _LOCAL_GROUP
    _LOCAL_GROUP = (weakref.ref(get_default_group()), weakref.ref(group)) \
        if group is not None else None


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def get_local_rank() -> int:
    """This process's rank among the processes of its node.

    Answers from the local group when there is one, else from ``LOCAL_RANK``, which every
    launcher of ``init_dist`` exports, so it needs no local group.

    Returns:
        The local rank, from 0; 0 when not distributed.
    """
    local_group = get_local_group()
    if local_group is not None:
        return torch_dist.get_rank(local_group)
    return _env_int("LOCAL_RANK", 0) if is_distributed() else 0


def get_local_size() -> int:
    """The number of processes on this node.

    Answers from the local group when there is one, else from ``LOCAL_WORLD_SIZE``, which
    every launcher of ``init_dist`` exports, so it needs no local group.

    Returns:
        The local world size; 1 when not distributed.
    """
    local_group = get_local_group()
    if local_group is not None:
        return torch_dist.get_world_size(local_group)
    return _env_int("LOCAL_WORLD_SIZE", 1) if is_distributed() else 1


def barrier(group: ProcessGroup | None = None) -> None:
    """Wait until every rank of ``group`` has called this; a no-op when not distributed.

    Args:
        group: the process group; None for the default group.

    Raises:
        DistTimeoutError: when some rank does not arrive within the collective timeout (as
            the backend reports it).
    """
    if is_distributed():
        from trainrun.dist.timeouts import named_operation

        with named_operation("barrier", group):
            torch_dist.barrier(group)


def master_only(func: F) -> F:
    """Decorate ``func`` so it runs on rank 0 only; other ranks get None.

    Rank 0 of the default group; a process that is not distributed counts as rank 0, so
    ``func`` runs there.

    Args:
        func: the function to guard, e.g. one that logs or writes a file.

    Returns:
        A function with ``func``'s name and docstring that calls ``func`` and returns its
        result on rank 0, and returns None without calling it on every other rank.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if is_main_process():
            return func(*args, **kwargs)
        return None

    return wrapper  # type: ignore[return-value]
