"""Object collectives and `collect_results` on real gloo groups and with no group."""

from __future__ import annotations

import os
import stat

import pytest
import torch

import trainrun.dist as dist
from trainrun.dist import objects


def _broadcast_objects_body(src):
    rank, world = dist.get_dist_info()
    src = min(src, world - 1)
    data = ["foo", 12, {1: 2}] if rank == src else [None, None, None]  # MMEngine's example
    assert dist.broadcast_object_list(data, src=src) is None
    assert data == ["foo", 12, {1: 2}]
    big = [torch.arange(1000) * rank, "x" * 100_000]
    dist.broadcast_object_list(big, src=src)
    assert torch.equal(big[0], torch.arange(1000) * src) and big[1] == "x" * 100_000


def test_broadcast_object_list_refuses_anything_but_a_list_in_one_process_too():
    for data in ("foo", ("a", "b"), None):
        with pytest.raises(TypeError, match="^broadcast_object_list fills a list in place; got "):
            dist.broadcast_object_list(data)


@pytest.mark.parametrize("src", [0, 1])
def test_broadcast_object_list(on_ranks, src):
    on_ranks(_broadcast_objects_body, src)


def _all_gather_object_body():
    rank, world = dist.get_dist_info()
    mine = {"rank": rank, "payload": list(range(rank * 1000))}  # sizes differ by rank
    gathered = dist.all_gather_object(mine)
    assert gathered[rank] is mine  # no copy of one's own object
    assert gathered == [{"rank": r, "payload": list(range(r * 1000))} for r in range(world)]
    assert dist.all_gather_object(None) == [None] * world
    # torch's call shape fills the list it is given
    object_list = [None] * world
    assert dist.all_gather_object(object_list, ("t", rank)) is None
    assert object_list == [("t", r) for r in range(world)]
    nones = ["unset"] * world
    dist.all_gather_object(nones, obj=None)
    assert nones == [None] * world


def test_all_gather_object(on_ranks):
    on_ranks(_all_gather_object_body)


def _gather_object_body(dst):
    rank, world = dist.get_dist_info()
    dst = min(dst, world - 1)
    gathered = dist.gather_object(["foo", 12, {1: 2}] if rank == 0 else f"rank{rank}", dst=dst)
    if rank == dst:
        assert gathered == [["foo", 12, {1: 2}]] + [f"rank{r}" for r in range(1, world)]
    else:
        assert gathered is None


@pytest.mark.parametrize("dst", [0, 1])
def test_gather_object(on_ranks, dst):
    on_ranks(_gather_object_body, dst)


# ---------------------------------------------------------------- collect_results


def _dealt(size: int, world: int, rank: int) -> list:
    """What a non-shuffling DistributedSampler gives ``rank``: padded by wrapping around."""
    per_rank = -(-size // world)
    indices = list(range(size)) + list(range(per_rank * world - size))
    return indices[rank::world]


def _result(index: int):
    return None if index % 7 == 3 else {"index": index, "label": index % 10, "name": f"{index}.png"}


def _collect_body(size, device, tmpdir):
    rank, world = dist.get_dist_info()
    part = [_result(i) for i in _dealt(size, world, rank)]
    collected = dist.collect_results(part, size, device=device, tmpdir=tmpdir)
    if rank != 0:
        assert collected is None
        return None
    assert collected == [_result(i) for i in range(size)]  # order restored, padding cut, None kept
    return len(collected)


@pytest.mark.parametrize("device", ["cpu", "gpu"])
@pytest.mark.parametrize("size", [1, 10, 11, 12, 100])
def test_collect_results_restores_dataset_order(on_ranks, world_size, size, device):
    results = on_ranks(_collect_body, size, device, None)
    assert results[0] == size and results[1:] == [None] * (world_size - 1)


def _collect_in_small_chunks_body(chunk_items, part_lengths):
    """Parts sent in many chunks of ``chunk_items`` results: every chunk's trailer must name
    the next one's length, and a rank with nothing to send sends just a zero."""
    objects._CHUNK_ITEMS = chunk_items  # in this worker process only
    try:
        rank = dist.get_rank()
        starts = [sum(part_lengths[:r]) for r in range(len(part_lengths))]
        part = [_result(starts[rank] + i) for i in range(part_lengths[rank])]
        return dist.collect_results(part, sum(part_lengths), device="gpu")
    finally:
        objects._CHUNK_ITEMS = 8192


@pytest.mark.parametrize(("chunk_items", "part_lengths"), [
    (3, [10, 9, 9]),  # several chunks, the last one short
    (3, [6, 6, 6]),  # parts a whole number of chunks long
    (1, [2, 0, 1]),  # a rank with an empty part
])
def test_collect_results_in_many_chunks(run_on, chunk_items, part_lengths):
    collected = run_on(3)(_collect_in_small_chunks_body, chunk_items, part_lengths)
    starts = [sum(part_lengths[:r]) for r in range(len(part_lengths))]
    round_robin = [start + i for i in range(max(part_lengths))
                   for start, length in zip(starts, part_lengths, strict=True) if i < length]
    assert collected[0] == [_result(i) for i in round_robin]
    assert collected[1:] == [None, None]


def _collect_tmpdir_body(tmpdir):
    rank, world = dist.get_dist_info()
    before = set(os.listdir(tmpdir))
    dist.barrier()
    result = _collect_body(23, "cpu", tmpdir)
    dist.barrier()
    return before, set(os.listdir(tmpdir)), result


def test_collect_results_through_a_shared_directory_leaves_nothing(on_ranks, tmp_path):
    for before, after, _ in on_ranks(_collect_tmpdir_body, str(tmp_path)):
        assert after == before == set()


def _private_dir_body(tmpdir):
    """The directory the parts pass through is private to the user while it exists."""
    rank = dist.get_rank()
    original = os.replace
    modes = []

    def spy(src, dst):
        modes.append(stat.S_IMODE(os.stat(os.path.dirname(dst)).st_mode))
        return original(src, dst)

    os.replace = spy
    try:
        _collect_body(9, "cpu", tmpdir)
    finally:
        os.replace = original
    return rank, modes


def test_collect_results_directory_is_private(run_on, tmp_path):
    results = run_on(2)(_private_dir_body, str(tmp_path))
    assert dict(results)[1] == [0o700]


def _uneven_parts_body():
    """Parts of different lengths (no padding at all) still interleave in rank order."""
    rank, world = dist.get_dist_info()
    size = 3 * world - 1
    part = [i for i in range(size) if i % world == rank]
    return dist.collect_results(part, size, device="gpu")


def test_collect_results_parts_of_different_lengths(run_on):
    assert run_on(3)(_uneven_parts_body)[0] == list(range(8))


def _mmengine_collect_example(device):
    rank = dist.get_rank()
    data = ["foo", {1: 2}] if rank == 0 else [24, {"a": "b"}]
    return dist.collect_results(data, 4, device=device)


@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_collect_results_matches_mmengine_example(run_on, device):
    assert run_on(2)(_mmengine_collect_example, device) == [["foo", 24, {1: 2}, {"a": "b"}], None]
    assert run_on(1)(_mmengine_collect_example, device) == [["foo", {1: 2}]]


def _bad_device_body():
    with pytest.raises(ValueError, match="'cpu' or 'gpu'"):
        dist.collect_results([1], 1, device="tpu")


def test_collect_results_rejects_unknown_device(on_ranks):
    on_ranks(_bad_device_body)
