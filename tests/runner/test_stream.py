"""Streams (IterableDataset as data.train): each rank's and worker's share, the loader's
length, where a stream is refused, and the state a checkpoint keeps."""

from __future__ import annotations

import pytest
from torch.utils.data import IterableDataset

from trainrun.runner.builder import build_dataloader
from trainrun.runner.runner import Runner
from trainrun.runner.schema import ConfigError
from trainrun.runner.stream import StatefulStreamShard, StreamShard, build_stream_loader


class Numbers(IterableDataset):
    """0, 1, ... ``count - 1``; with ``sized`` it has a length."""

    def __init__(self, count: int = 23):
        self.count = count

    def __iter__(self):
        return iter(range(self.count))


class SizedNumbers(Numbers):
    def __len__(self) -> int:
        return self.count


def _items(world_size: int, num_workers: int, rank: int, count: int = 23,
           batch_size: int = 2, drop_last: bool = False) -> list[list[int]]:
    loader = build_stream_loader(SizedNumbers(count), "data.train", rank, world_size,
                                 batch_size, drop_last, {"num_workers": num_workers})
    batches = [batch.tolist() for batch in loader]
    assert len(batches) == len(loader)  # the length counts this rank's batches
    return batches


@pytest.mark.parametrize(("world_size", "num_workers"), [(2, 0), (2, 2), (3, 0)])
def test_ranks_and_workers_take_disjoint_equal_shares_of_whole_rounds(world_size, num_workers):
    width = world_size * max(num_workers, 1)
    shares = [sum(_items(world_size, num_workers, rank), []) for rank in range(world_size)]
    assert len({len(share) for share in shares}) == 1  # the ranks stay in step
    seen = sorted(sum(shares, []))
    assert seen == list(range(23 // width * width))  # every item once; the short round dropped
    if num_workers == 0:
        assert shares[1] == list(range(1, 23 // width * width, width))  # item i to rank i % N


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_sized_streams_length_is_its_batches_with_workers(drop_last):
    for rank in range(2):
        _items(2, 2, rank, count=45, batch_size=4, drop_last=drop_last)


def test_the_shard_saves_the_data_sets_state_only_where_it_has_one():
    from tests.tools.models import DigitsStream, StatefulDigitsStream

    loader = build_stream_loader(StatefulDigitsStream(), "k", 0, 1, 4, False, {})
    assert isinstance(loader.dataset, StatefulStreamShard)
    plain = build_stream_loader(DigitsStream(), "k", 0, 1, 4, False, {})
    assert type(plain.dataset) is StreamShard and not hasattr(plain.dataset, "state_dict")
    batches = iter(loader)
    next(batches), next(batches)
    assert loader.state_dict()["dataset_state"] == {"position": 8}


def test_streams_are_refused_where_they_cannot_serve(tmp_path):
    stream = {"type": "tests.tools.models.StatefulDigitsStream", "batch_size": 8}
    with pytest.raises(ConfigError, match=r"^data.val.type: tests.tools.models."
                                          r"StatefulDigitsStream is an IterableDataset; "
                                          r"streams are read for data.train"):
        build_dataloader(stream, seed=0, train=False, key="data.val")
    with pytest.raises(ConfigError, match=r"^schedule.max_epochs: data.train "
                                          r"\(StatefulDigitsStream\) is a stream without a"):
        Runner(model={"type": "DigitsMLP"}, work_dir=tmp_path / "run", train_dataloader=stream,
               optim={"type": "SGD", "lr": 0.1}, strategy="none", schedule={"max_epochs": 1})
    assert not (tmp_path / "run").exists()


def test_a_sized_stream_trains_by_epochs(tmp_path):
    runner = Runner(model={"type": "DigitsMLP"}, work_dir=tmp_path / "run",
                    train_dataloader={"type": "tests.tools.models.SizedDigitsStream",
                                      "batch_size": 100, "shuffle": False},
                    optim={"type": "SGD", "lr": 0.1}, strategy="none",
                    schedule={"max_epochs": 2}, logging={"interval": 1, "backends": ["jsonl"]})
    with runner:
        runner.train()
        assert (runner.epoch, runner.iter, runner.max_iters) == (2, 30, 30)  # 1438 / 100 -> 15
