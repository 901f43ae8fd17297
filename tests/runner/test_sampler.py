"""ResumableSampler: the very indices torch's DistributedSampler deals, and a cursor that
resumes mid-epoch without dealing (or loading) a consumed sample."""

from __future__ import annotations

import itertools

import pytest
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import trainrun.dist as dist
from trainrun.runner.sample_seeds import sample_seed
from trainrun.runner.sampler import ResumableSampler

SIZES = (1, 2, 7, 20, 21, 64)
WORLDS = (1, 2, 3, 4)


def torch_deals(size, world, rank, shuffle, seed, drop_last, epoch):
    sampler = DistributedSampler(range(size), num_replicas=world, rank=rank, shuffle=shuffle,
                                 seed=seed, drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(sampler), len(sampler)


def ours(size, world, rank, shuffle=True, seed=0, drop_last=False, epoch=0, cursor=0):
    sampler = ResumableSampler(size, shuffle=shuffle, seed=seed, drop_last=drop_last,
                               num_replicas=world, rank=rank)
    sampler.set_epoch(epoch)
    sampler.cursor = cursor
    return sampler


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_deals_exactly_what_distributed_sampler_deals(shuffle, drop_last):
    for size, world, seed, epoch in itertools.product(SIZES, WORLDS, (0, 42), (0, 3)):
        for rank in range(world):
            expected, expected_len = torch_deals(size, world, rank, shuffle, seed, drop_last,
                                                 epoch)
            sampler = ours(size, world, rank, shuffle, seed, drop_last, epoch)
            case = (size, world, rank, seed, epoch)
            assert list(sampler) == expected, case
            assert len(sampler) == expected_len, case


def test_epochs_and_seeds_change_the_order_only_when_shuffling():
    first = list(ours(64, 2, 0, epoch=0))
    assert list(ours(64, 2, 0, epoch=1)) != first
    assert list(ours(64, 2, 0, seed=1)) != first
    assert list(ours(64, 2, 0, epoch=0)) == first  # the same every time
    assert list(ours(64, 2, 0, shuffle=False, epoch=5)) == list(range(0, 64, 2))


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("size", "world", "batch"), [(21, 2, 4), (21, 3, 2), (64, 4, 3),
                                                      (10, 3, 1)])
def test_cursor_resumes_where_the_epoch_stopped(size, world, batch, drop_last):
    """After k steps of ``batch`` per rank the cursor is k * batch * world; from there each
    rank deals the rest of what it would have dealt."""
    for rank in range(world):
        whole = list(ours(size, world, rank, drop_last=drop_last, epoch=2))
        for steps in range(len(whole) // batch + 1):
            cursor = min(steps * batch * world, size)
            resumed = ours(size, world, rank, drop_last=drop_last, epoch=2, cursor=cursor)
            assert list(resumed) == whole[steps * batch:], (rank, steps)
            assert len(resumed) == len(whole[steps * batch:])


def test_cursor_means_the_same_for_another_number_of_ranks():
    """Consumed on 2 ranks, resumed on 3: the 3 ranks deal exactly the unconsumed samples."""
    order = ResumableSampler(21, seed=7, num_replicas=1, rank=0)
    order.set_epoch(1)
    order = order.epoch_order()
    consumed = set()
    for rank in range(2):
        consumed |= set(list(ours(21, 2, rank, seed=7, epoch=1))[:6])  # 3 steps of 2
    assert consumed == set(order[:12])
    dealt = [list(ours(21, 3, rank, seed=7, epoch=1, cursor=12)) for rank in range(3)]
    assert sorted(itertools.chain(*dealt)) == sorted(order[12:])  # 9 left, 3 each: no padding
    assert not set(itertools.chain(*dealt)) & consumed


def test_any_cursor_deals_every_remaining_sample_once():
    """Read back in dealing order (rank 0's first, rank 1's first, ...), the ranks' shares
    are the unconsumed rest of the epoch's order, then at most world - 1 padding samples."""
    for world in (2, 3):
        for cursor in range(22):
            shares = [list(ours(21, world, rank, cursor=cursor)) for rank in range(world)]
            dealt = [share[i] for i in range(len(shares[0])) for share in shares]
            remaining = ours(21, 1, 0).epoch_order()[cursor:]
            assert dealt[:len(remaining)] == remaining, (world, cursor)
            assert len(dealt) - len(remaining) == -len(remaining) % world


def test_set_epoch_restarts_and_state_round_trips():
    sampler = ours(20, 2, 1, seed=3, epoch=4, cursor=8)
    state = sampler.state_dict()
    assert state == {"epoch": 4, "cursor": 8, "seed": 3}
    fresh = ResumableSampler(20, num_replicas=2, rank=1)
    fresh.load_state_dict(state)
    assert list(fresh) == list(sampler) and len(fresh) == 6
    sampler.set_epoch(5)
    assert sampler.cursor == 0 and len(sampler) == 10


def test_sample_seeds_go_with_the_same_indices_from_any_cursor():
    for world, rank, cursor in [(1, 0, 0), (2, 1, 6), (3, 2, 19)]:
        plain = ours(21, world, rank, seed=3, epoch=2, cursor=cursor)
        seeded = ResumableSampler(21, seed=3, num_replicas=world, rank=rank, sample_seeds=True)
        seeded.load_state_dict(plain.state_dict())
        assert list(seeded) == [(i, sample_seed(3, 2, i)) for i in plain]
        assert len(seeded) == len(plain) and seeded.state_dict() == plain.state_dict()
    seeds = {sample_seed(seed, epoch, i) for seed in (0, 1) for epoch in (0, 1) for i in range(50)}
    assert len(seeds) == 200 and all(0 <= s < 2**64 for s in seeds)


class Counting(Dataset):
    def __init__(self, size):
        self.size = size
        self.loaded: list[int] = []

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        self.loaded.append(index)
        return index


def test_resuming_loads_no_consumed_sample():
    dataset = Counting(20)
    sampler = ours(20, 2, 0, cursor=12)
    batches = [b.tolist() for b in DataLoader(dataset, batch_size=2, sampler=sampler)]
    whole = list(ours(20, 2, 0))
    assert sorted(dataset.loaded) == sorted(whole[6:])
    assert list(itertools.chain(*batches)) == whole[6:]


def _default_rank_body():
    sampler = ResumableSampler(21, seed=1)
    sampler.set_epoch(2)
    return sampler.rank, sampler.num_replicas, list(sampler)


def test_rank_and_world_default_to_the_group(on_ranks, world_size):
    results = on_ranks(_default_rank_body)
    assert [(r, n) for r, n, _ in results] == [(r, world_size) for r in range(world_size)]
    for rank, _, dealt in results:
        assert dealt == torch_deals(21, world_size, rank, True, 1, False, 2)[0]
    assert set(itertools.chain(*(d for _, _, d in results))) == set(range(21))
    assert dist.get_world_size() == 1  # the test process itself never joined a group


def test_the_sampler_keeps_its_own_cursor_as_steps_are_trained():
    sampler = ResumableSampler(10, shuffle=False, num_replicas=2, rank=1)
    sampler.trained(2)  # one step: 2 samples on each of 2 ranks
    assert sampler.cursor == 4 and list(sampler) == [5, 7, 9]
    sampler.trained(2)
    sampler.trained(2)  # past the end: the last step was short
    assert sampler.cursor == 10 and list(sampler) == []
    sampler.set_epoch(1)
    sampler.trained(2)
    sampler.finish_epoch()  # a short last batch that drop_last left out
    assert (sampler.epoch, sampler.cursor) == (1, 10)
