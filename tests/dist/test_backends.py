"""The pluggable object-communication backends behind `get_dist_backend`."""

from __future__ import annotations

import pytest

import trainrun.dist as dist
from trainrun.dist.backends import NonDist, TorchCPUDist


def _default_backend_body():
    backend = dist.get_dist_backend()
    rank, world = dist.get_dist_info()
    assert (backend.rank, backend.world_size) == (rank, world)
    assert backend.is_initialized == (world > 1)
    gathered = backend.all_gather_object({"rank": rank})
    from_last = backend.broadcast_object(f"from {rank}", src=world - 1)
    return type(backend).__name__, gathered, from_last


def test_default_backend_follows_the_process_group(on_ranks, world_size):
    name = "NonDist" if world_size == 1 else "TorchCPUDist"
    expected = (name, [{"rank": r} for r in range(world_size)], f"from {world_size - 1}")
    assert on_ranks(_default_backend_body) == [expected] * world_size


def _named_backends_body():
    world = dist.get_world_size()
    assert dist.get_dist_backend("non_dist").all_gather_object(5) == [5]
    assert dist.get_dist_backend("torch_cpu").all_gather_object(1) == [1] * world
    if world > 1:
        with pytest.raises(RuntimeError, match="needs an nccl process group"):
            dist.get_dist_backend("torch_cuda").all_gather_object(1)
    dist.set_default_dist_backend("non_dist")
    try:
        assert isinstance(dist.get_dist_backend(), NonDist)
    finally:
        dist.set_default_dist_backend(None)
    assert isinstance(dist.get_dist_backend(), NonDist if world == 1 else TorchCPUDist)


def test_named_backends(on_ranks):
    on_ranks(_named_backends_body)


def test_unknown_backend_names_the_allowed_ones():
    with pytest.raises(ValueError, match="non_dist, torch_cpu, torch_cuda, mpi4py"):
        dist.get_dist_backend("horovod")
    with pytest.raises(ValueError, match="non_dist, torch_cpu, torch_cuda, mpi4py"):
        dist.set_default_dist_backend("horovod")
