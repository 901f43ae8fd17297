"""Pluggable object-communication backends, chosen by name.

==========  ==============================  ==============================
name        library                         needs
==========  ==============================  ==============================
non_dist    none (one process)              nothing
torch_cpu   torch.distributed, CPU (gloo)   an initialised process group
torch_cuda  torch.distributed, CUDA (nccl)  an nccl process group
mpi4py      MPI through mpi4py              mpirun, mpi4py, an MPI library
==========  ==============================  ==============================
"""

from __future__ import annotations

from collections.abc import Callable

from trainrun.dist.backends.base import BaseDistBackend
from trainrun.dist.backends.mpi4py_dist import MPI4PyDist
from trainrun.dist.backends.non_dist import NonDist
from trainrun.dist.backends.torch_dist import TorchCPUDist, TorchCUDADist
from trainrun.dist.info import get_backend, is_distributed

#: The object-communication backends by name, each with the class ``get_dist_backend`` makes.
DIST_BACKENDS: dict[str, Callable[[], BaseDistBackend]] = {
    "non_dist": NonDist,
    "torch_cpu": TorchCPUDist,
    "torch_cuda": TorchCUDADist,
    "mpi4py": MPI4PyDist,
}
_default_name: str | None = None


def set_default_dist_backend(name: str | None) -> None:
    """Make ``name`` what ``get_dist_backend()`` returns.

    Args:
        name: 'non_dist', 'torch_cpu', 'torch_cuda' or 'mpi4py'; None: choose from the
            process group again, as at the start.

    Raises:
        ValueError: when ``name`` is not a known backend; the message names them.
    """
    if name is not None and name not in DIST_BACKENDS:
        raise ValueError(f"dist backend must be one of {', '.join(DIST_BACKENDS)}; got {name!r}")
    global _default_name
    _default_name = name


def get_dist_backend(name: str | None = None) -> BaseDistBackend:
    """The object-communication backend called ``name``, or the configured default.

    Args:
        name: 'non_dist', 'torch_cpu' (gloo), 'torch_cuda' (nccl) or 'mpi4py'. None: the one
            ``set_default_dist_backend`` chose, else 'non_dist' when no process group is
            initialised, else the torch one matching its backend ('torch_cuda' for nccl,
            'torch_cpu' for any other).

    Returns:
        A new instance of that backend.

    Raises:
        ValueError: when ``name`` is not a known backend; the message names them.
        ImportError: for 'mpi4py' when mpi4py or the MPI library is missing.
    """
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
