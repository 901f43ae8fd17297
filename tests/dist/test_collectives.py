"""Tensor collectives on every rank of real gloo groups (2 and 3 ranks) and with no group.

Bodies run on each rank and assert what that rank must see. Where MMEngine 0.10.7 documents
an example for the same function, the body checks the example's values.
"""

from __future__ import annotations

import pytest
import torch

import trainrun.dist as dist

# ---------------------------------------------------------------- query and control


def _query() -> tuple:
    rank, world = dist.get_dist_info()
    assert rank == dist.get_rank() and world == dist.get_world_size()
    assert dist.is_main_process() == (rank == 0)
    assert dist.is_distributed() == (world > 1)
    assert dist.get_backend() == ("gloo" if world > 1 else None)
    assert (dist.get_default_group() is None) == (world == 1)
    dist.barrier()
    return rank, world, dist.get_local_rank(), dist.get_local_size()


def test_query_functions(on_ranks, world_size):
    results = on_ranks(_query)
    assert results == [(r, world_size, r, world_size) for r in range(world_size)]


@dist.master_only
def _only_on_master(value):
    return value * 2


def _master_only_body():
    return _only_on_master(21)


def test_master_only_runs_on_rank_zero_only(on_ranks, world_size):
    assert on_ranks(_master_only_body) == [42] + [None] * (world_size - 1)


# ---------------------------------------------------------------- all_reduce

_OPS = {
    "sum": lambda values: sum(values),
    "product": lambda values: torch.stack(values).prod(0),
    "min": lambda values: torch.stack(values).min(0).values,
    "max": lambda values: torch.stack(values).max(0).values,
    "band": lambda values: _fold(values, lambda a, b: a & b),
    "bor": lambda values: _fold(values, lambda a, b: a | b),
    "bxor": lambda values: _fold(values, lambda a, b: a ^ b),
}


def _fold(values, fn):
    out = values[0]
    for value in values[1:]:
        out = fn(out, value)
    return out


def _rank_value(rank: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.tensor([3, 5, 12]) + 2 * rank + 1).to(dtype)


def _all_reduce_body(op: str, dtype: torch.dtype):
    rank, world = dist.get_dist_info()
    data = _rank_value(rank, dtype)
    dist.all_reduce(data, op.upper() if rank == 1 else op)  # names are case-insensitive
    expected = _OPS[op]([_rank_value(r, dtype) for r in range(world)]).to(dtype)
    assert data.dtype == dtype
    assert torch.equal(data, expected), (op, data, expected)


_OP_DTYPES = [
    (op, dtype)
    for op in sorted(_OPS)
    for dtype in (torch.int64, torch.int32, torch.uint8, torch.float32)
    if not (op.startswith("b") and dtype.is_floating_point)  # bitwise ops: integers only
]


@pytest.mark.parametrize(("op", "dtype"), _OP_DTYPES)
def test_all_reduce_every_op(on_ranks, op, dtype):
    on_ranks(_all_reduce_body, op, dtype)


def _mean_body(dtype):
    rank, world = dist.get_dist_info()
    data = torch.tensor([rank + 1, 2 * rank], dtype=dtype)
    dist.all_reduce(data, "mean")
    exact = torch.tensor([sum(r + 1 for r in range(world)), sum(2 * r for r in range(world))],
                         dtype=torch.float64) / world
    assert data.dtype == dtype
    assert torch.equal(data, exact.to(dtype)), (data, exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_all_reduce_mean(on_ranks, dtype):
    """Integer tensors take the true mean, stored in their dtype (as MMEngine does)."""
    on_ranks(_mean_body, dtype)


def _mmengine_all_reduce_example():
    rank, world = dist.get_dist_info()
    data = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank
    dist.all_reduce(data)
    return data.tolist()


def test_all_reduce_matches_mmengine_example(run_on):
    assert run_on(1)(_mmengine_all_reduce_example) == [[1, 2]]
    assert run_on(2)(_mmengine_all_reduce_example) == [[4, 6], [4, 6]]


def _async_mean_body():
    rank, world = dist.get_dist_info()
    data = torch.full((4,), float(rank))
    handle = dist.all_reduce(data, "mean", async_op=True)
    assert handle is not None
    handle.wait()
    assert torch.equal(data, torch.full((4,), (world - 1) / 2))
    assert handle.is_completed()


def test_all_reduce_async_handle_finishes_the_mean(on_ranks):
    on_ranks(_async_mean_body)


def _non_contiguous_reduce_body():
    rank, world = dist.get_dist_info()
    base = torch.arange(12.0).reshape(3, 4) * (rank + 1)
    view = base.t()  # non-contiguous
    dist.all_reduce(view)
    factor = sum(r + 1 for r in range(world))
    assert torch.equal(base, torch.arange(12.0).reshape(3, 4) * factor)


def test_all_reduce_non_contiguous_view(on_ranks):
    on_ranks(_non_contiguous_reduce_body)


def _bad_op_body():
    with pytest.raises(ValueError, match="sum, mean, product, min, max, band, bor, bxor"):
        dist.all_reduce(torch.ones(1), "average")
    with pytest.raises(ValueError, match="must be one of"):
        dist.reduce(torch.ones(1), 0, "median")
    with pytest.raises(ValueError, match="must be one of"):
        dist.all_reduce_dict({"a": torch.ones(1)}, "avg")


def test_bad_reduce_op_names_the_allowed_ones(on_ranks):
    on_ranks(_bad_op_body)


# ---------------------------------------------------------------- all_gather and gather


def _all_gather_body():
    rank, world = dist.get_dist_info()
    data = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank  # MMEngine's example
    return [t.tolist() for t in dist.all_gather(data)]


def test_all_gather_matches_mmengine_example(on_ranks, world_size):
    expected = [[1 + 2 * r, 2 + 2 * r] for r in range(world_size)]
    assert on_ranks(_all_gather_body) == [expected] * world_size


def _uneven(rank: int) -> torch.Tensor:
    return torch.arange((rank + 1) * 3, dtype=torch.float32).reshape(rank + 1, 3)[:, :2] + rank


def _all_gather_uneven_body():
    rank, world = dist.get_dist_info()
    gathered = dist.all_gather(_uneven(rank))
    assert len(gathered) == world
    for r, tensor in enumerate(gathered):
        assert torch.equal(tensor, _uneven(r)), (r, tensor)
    # different numbers of dimensions, and a 0-d tensor
    mixed = dist.all_gather(torch.tensor(7.0) if rank == 0 else torch.ones(rank, 2))
    assert torch.equal(mixed[0], torch.tensor(7.0))
    assert all(torch.equal(mixed[r], torch.ones(r, 2)) for r in range(1, world))


def test_all_gather_tensors_of_different_shapes(on_ranks):
    on_ranks(_all_gather_uneven_body)


def _all_gather_torch_shape_body():
    rank, world = dist.get_dist_info()
    out = [torch.empty(3) for _ in range(world)]
    assert dist.all_gather(out, torch.full((3,), float(rank))) is None
    assert all(torch.equal(t, torch.full((3,), float(r))) for r, t in enumerate(out))
    out = [torch.empty(2, dtype=torch.int64) for _ in range(world)]
    handle = dist.all_gather(out, torch.tensor([rank, -rank]), None, True)
    handle.wait()
    assert [t.tolist() for t in out] == [[r, -r] for r in range(world)]


def test_all_gather_accepts_torch_call_shape(on_ranks):
    on_ranks(_all_gather_torch_shape_body)


def _gather_body(dst):
    rank, world = dist.get_dist_info()
    dst = min(dst, world - 1)
    gathered = dist.gather(torch.arange(2, dtype=torch.int64) + 1 + 2 * rank, dst=dst)
    return dst, [t.tolist() for t in gathered]


@pytest.mark.parametrize("dst", [0, 1])
def test_gather_to_one_rank(on_ranks, world_size, dst):
    results = on_ranks(_gather_body, dst)
    expected = [[1 + 2 * r, 2 + 2 * r] for r in range(world_size)]
    for rank, (actual_dst, gathered) in enumerate(results):
        assert gathered == (expected if rank == actual_dst else [])


def _gather_rows_body(dst, async_op=False):
    rank, world = dist.get_dist_info()
    dst = min(dst, world - 1)
    rows = dist.gather_rows(torch.tensor([rank, 0.5 * rank, 2**40 + rank], dtype=torch.float64),
                            dst=dst, async_op=async_op)
    if async_op:
        assert isinstance(rows, dist.Handle)
        rows.wait()
        assert rows.is_completed()
        rows = rows.result()  # the same rows again, no second wait
    if rank != dst:
        assert rows is None
        return None
    assert rows.dtype == torch.float64 and rows.shape == (world, 3)
    return rows.tolist()


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("dst", [0, 1])
def test_gather_rows_stacks_every_rank_in_rank_order_on_one_rank(on_ranks, world_size, dst,
                                                                 async_op):
    results = on_ranks(_gather_rows_body, dst, async_op)
    expected = [[r, 0.5 * r, 2**40 + r] for r in range(world_size)]
    assert results[min(dst, world_size - 1)] == expected
    assert sum(result is not None for result in results) == 1


def _gather_torch_shape_body():
    rank, world = dist.get_dist_info()
    gather_list = [torch.empty(2) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.full((2,), rank + 0.5), gather_list, 0)
    if rank == 0:
        assert [t.tolist() for t in gather_list] == [[r + 0.5] * 2 for r in range(world)]
    uneven = dist.gather(torch.ones(rank + 1), dst=0)
    if rank == 0:
        assert [t.numel() for t in uneven] == list(range(1, world + 1))


def test_gather_accepts_torch_call_shape_and_uneven_shapes(on_ranks):
    on_ranks(_gather_torch_shape_body)


# ---------------------------------------------------------------- broadcast and reduce


def _broadcast_body(src):
    rank, world = dist.get_dist_info()
    src = min(src, world - 1)
    data = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank
    dist.broadcast(data, src)
    assert data.tolist() == [1 + 2 * src, 2 + 2 * src]
    grid = torch.arange(6.0).reshape(2, 3) * (rank + 1)
    view = grid.t()  # non-contiguous, filled in place
    handle = dist.broadcast(view, src=src, async_op=True)
    handle.wait()
    assert torch.equal(grid, torch.arange(6.0).reshape(2, 3) * (src + 1))


@pytest.mark.parametrize("src", [0, 1])
def test_broadcast_in_place(on_ranks, src):
    on_ranks(_broadcast_body, src)


def _reduce_body(op):
    rank, world = dist.get_dist_info()
    dst = world - 1
    data = torch.tensor([float(rank + 1), 2.0])
    handle = dist.reduce(data, dst=dst, op=op, async_op=True)
    handle.wait()
    if rank == dst:
        values = [torch.tensor([float(r + 1), 2.0]) for r in range(world)]
        expected = sum(values) / world if op == "mean" else torch.stack(values).max(0).values
        assert torch.equal(data, expected), data


@pytest.mark.parametrize("op", ["mean", "max"])
def test_reduce_to_one_rank(on_ranks, op):
    on_ranks(_reduce_body, op)


# ---------------------------------------------------------------- seeds, dicts, params


def _seed_body():
    rank = dist.get_rank()
    given = dist.sync_random_seed(1234 + rank)
    fresh = dist.sync_random_seed()
    assert 0 <= fresh < 2**31
    return given, fresh


def test_sync_random_seed_is_rank_zeros(on_ranks):
    results = on_ranks(_seed_body)
    assert {given for given, _ in results} == {1234}
    assert len({fresh for _, fresh in results}) == 1


def _reduce_dict_body():
    rank, world = dist.get_dist_info()
    items = [("loss", torch.tensor(0.1 * (rank + 1), dtype=torch.float64)),
             ("acc", torch.tensor([rank, 2 * rank])),
             ("count", rank + 1),
             ("lr", 1e-3)]
    data = dict(items if rank % 2 == 0 else reversed(items))  # keys in another order
    mean = dist.all_reduce_dict(data, "mean")
    assert mean is data  # reduced in place, as MMEngine's is, and returned
    summed = dist.all_reduce_dict(dict(items), "sum")
    ranks = range(world)
    assert list(mean) == [k for k, _ in (items if rank % 2 == 0 else reversed(items))]
    assert mean["loss"].dtype == torch.float64  # never narrowed
    exact_loss = sum(0.1 * (r + 1) for r in ranks) / world
    assert mean["loss"].item() == pytest.approx(exact_loss, rel=1e-14)  # summation order varies
    # integers keep their dtype: the mean is truncated, as MMEngine's is
    assert mean["acc"].dtype == torch.int64
    assert mean["acc"].tolist() == [sum(ranks) // world, 2 * sum(ranks) // world]
    assert isinstance(mean["count"], int) and mean["count"] == sum(r + 1 for r in ranks) // world
    assert mean["lr"] == pytest.approx(1e-3)
    assert summed["acc"].dtype == torch.int64 and summed["count"] == sum(r + 1 for r in ranks)
    assert summed["acc"].tolist() == [sum(ranks), 2 * sum(ranks)]


def test_all_reduce_dict(on_ranks):
    on_ranks(_reduce_dict_body)


def _reduce_dict_mmengine_example():
    rank = dist.get_rank()
    data = {"key1": torch.arange(2, dtype=torch.int64) + 2 * rank,
            "key2": torch.arange(3, dtype=torch.int64) + 3 * rank}
    dist.all_reduce_dict(data)  # MMEngine's example reads data afterwards
    return {k: v.tolist() for k, v in data.items()}


def test_all_reduce_dict_matches_mmengine_example(run_on):
    assert run_on(1)(_reduce_dict_mmengine_example) == [{"key1": [0, 1], "key2": [0, 1, 2]}]
    assert run_on(2)(_reduce_dict_mmengine_example) == [{"key1": [2, 4], "key2": [3, 5, 7]}] * 2


def _reduce_dict_int64_body():
    rank, world = dist.get_dist_info()
    data = {"tokens": torch.tensor([rank + 1, 10 * (rank + 1)], dtype=torch.int64)}
    dist.all_reduce_dict(data)
    total = sum(r + 1 for r in range(world))
    assert data["tokens"].dtype == torch.int64
    assert data["tokens"].tolist() == [total, 10 * total]
    return data["tokens"].tolist()


def test_all_reduce_dict_keeps_int64(on_ranks, world_size):
    total = sum(r + 1 for r in range(world_size))
    assert on_ranks(_reduce_dict_int64_body) == [[total, 10 * total]] * world_size


def _reduce_dict_not_a_dict_body():
    with pytest.raises(TypeError, match="expected a dict .*; got str"):
        dist.all_reduce_dict("foo")
    with pytest.raises(TypeError, match="expected a dict .*; got list"):
        dist.all_reduce_dict([torch.ones(1)])
    with pytest.raises(AssertionError):  # what MMEngine raises, and its own tests expect
        dist.all_reduce_dict("foo")
    with pytest.raises(AssertionError):
        dist.broadcast_object_list("foo")


def test_all_reduce_dict_refuses_a_non_dict(on_ranks):
    on_ranks(_reduce_dict_not_a_dict_body)


def _reduce_params_body(coalesce, bucket_size_mb):
    rank, world = dist.get_dist_info()
    model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.BatchNorm1d(200))
    with torch.no_grad():
        for index, tensor in enumerate(list(model.parameters()) + list(model.buffers())):
            tensor.copy_(torch.full_like(tensor, float(rank + index)))
    dist.all_reduce_params(model.parameters(), coalesce, bucket_size_mb, op="mean")
    dist.all_reduce_params(model.buffers(), coalesce, bucket_size_mb)
    params = list(model.parameters())
    for index, tensor in enumerate(params + list(model.buffers())):
        values = [float(r + index) for r in range(world)]
        expected = sum(values) / world if index < len(params) else sum(values)
        assert torch.all(tensor == torch.tensor(expected, dtype=tensor.dtype)), index


@pytest.mark.parametrize(("coalesce", "bucket_size_mb"), [(True, -1), (True, 0.1), (False, -1)])
def test_all_reduce_params(on_ranks, coalesce, bucket_size_mb):
    on_ranks(_reduce_params_body, coalesce, bucket_size_mb)


def _reduce_params_mmengine_example():
    rank = dist.get_rank()
    data = [torch.arange(2) + 2 * rank, torch.arange(3) + 3 * rank]
    dist.all_reduce_params(data)
    return [t.tolist() for t in data]


def test_all_reduce_params_matches_mmengine_example(run_on):
    assert run_on(1)(_reduce_params_mmengine_example) == [[[0, 1], [0, 1, 2]]]
    assert run_on(2)(_reduce_params_mmengine_example) == [[[2, 4], [3, 5, 7]]] * 2


# ---------------------------------------------------------------- local groups


def _local_group_body(gpus_per_node):
    rank, world = dist.get_dist_info()
    dist.init_local_group(rank // gpus_per_node, gpus_per_node)
    local = dist.get_local_group()
    summed = torch.tensor([rank])
    if local is not None:
        dist.all_reduce(summed, group=local)
    return dist.get_local_rank(), dist.get_local_size(), summed.item()


def test_local_groups_one_per_node(run_on):
    """Two 'nodes' of one rank each: every rank helps create both groups, keeps its own."""
    assert run_on(2)(_local_group_body, 1) == [(0, 1, 0), (0, 1, 1)]
    assert run_on(2)(_local_group_body, 2) == [(0, 2, 1), (1, 2, 1)]
    assert run_on(1)(_local_group_body, 1) == [(0, 1, 0)]


def _stale_local_group_body():
    """A local group made under an earlier default group is not handed out again."""
    return dist.get_local_group() is None, dist.get_local_size()


def test_local_group_does_not_outlive_its_default_group(run_on):
    run_on(2)(_local_group_body, 1)
    assert run_on(2)(_stale_local_group_body) == [(True, 2), (True, 2)]


def _bad_local_group_body():
    with pytest.raises(ValueError, match="divide the world size 3"):
        dist.init_local_group(0, 2)
    with pytest.raises(ValueError, match="node_rank=5"):
        dist.init_local_group(5, 1)


def test_local_group_rejects_bad_layouts(run_on):
    run_on(3)(_bad_local_group_body)
