"""Pluggable object-communication backends, chosen by name.

| name        | library                      | needs                         |
|-------------|------------------------------|-------------------------------|
| non_dist    | none (one process)           | nothing                       |
| torch_cpu   | torch.distributed, CPU (gloo) | an initialised process group |
| torch_cuda  | torch.distributed, CUDA (nccl)| an nccl process group        |
| mpi4py      | MPI through mpi4py            | mpirun, mpi4py, an MPI library |
"""

from __future__ import annotations

from collections.abc import Callable

from trainrun.dist.backends.base import BaseDistBackend
from trainrun.dist.backends.mpi4py_dist import MPI4PyDist
from trainrun.dist.backends.non_dist import NonDist
from trainrun.dist.backends.torch_dist import TorchCPUDist, TorchCUDADist
from trainrun.dist.info import get_backend, is_distributed

DIST_BACKENDS: dict[str, Callable[[], BaseDistBackend]] = {
    "non_dist": NonDist,
    "torch_cpu": TorchCPUDist,
    "torch_cuda": TorchCUDADist,
    "mpi4py": MPI4PyDist,
}
_default_name: str | None = None


def set_default_dist_backend(name: str | None) -> None:
    """Make ``name`` what `get_dist_backend()` returns (None: choose from the process group)."""
    if name is not None and name not in DIST_BACKENDS:
        raise ValueError(f"dist backend must be one of {', '.join(DIST_BACKENDS)}; got {name!r}")
    global _default_name
    _default_name = name


def get_dist_backend(name: str | None = None) -> BaseDistBackend:
    """The backend called ``name``; without a name, the configured default: 'non_dist' when
    no process group is initialised, else the torch one matching its backend."""
    if name is None:
        name = _default_name
    if name is None:
        if not is_distributed():
            name = "non_dist"
        else:
            name = "torch_cuda" if get_backend() == "nccl" else "torch_cpu"
    if name not in DIST_BACKENDS:
        raise ValueError(f"dist backend must be one of {', '.join(DIST_BACKENDS)}; got {name!r}")
    return DIST_BACKENDS[name]()


__all__ = [
    "BaseDistBackend",
    "DIST_BACKENDS",
    "MPI4PyDist",
    "NonDist",
    "TorchCPUDist",
    "TorchCUDADist",
    "get_dist_backend",
    "set_default_dist_backend",
]
