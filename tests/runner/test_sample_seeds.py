"""Per-sample seeds: a training loader with workers reads every sample with the same random
draws whatever the number of workers, persistent or not, the stop point or the number of
ranks; draws differ between epochs; loaders without workers are left as they were."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from trainrun.runner.builder import build_dataloader
from trainrun.runner.loops import start_epoch
from trainrun.runner.sample_seeds import SeededSamples, sample_seed

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker")

SEED, SIZE, BATCH = 5, 22, 4
DATASET = "tests.runner.test_sample_seeds.Augmenting"


class Augmenting(Dataset):
    """Draws from torch's, numpy's and python's global generators for every sample."""

    def __init__(self, size: int = SIZE):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"index": torch.tensor(index), "torch": torch.rand(()),
                "numpy": torch.tensor(np.random.rand()), "python": torch.tensor(random.random())}


def loader(num_workers: int, persistent: bool = False, train: bool = True) -> DataLoader:
    cfg = {"type": DATASET, "batch_size": BATCH, "num_workers": num_workers,
           "persistent_workers": persistent}
    return build_dataloader(cfg, SEED, train=train)


def draws(batches) -> dict[int, tuple[float, float, float]]:
    """Every sample's three draws, by index."""
    out = {}
    for batch in batches:
        for i, index in enumerate(batch["index"].tolist()):
            out[index] = (batch["torch"][i].item(), batch["numpy"][i].item(),
                          batch["python"][i].item())
    return out


def epoch_draws(data: DataLoader, epoch: int) -> dict[int, tuple[float, float, float]]:
    start_epoch(data, epoch, SEED)
    return draws(data)


def test_any_number_of_workers_persistent_or_not_draws_the_same_per_sample():
    expected = [epoch_draws(loader(1), epoch) for epoch in (0, 1)]
    assert sorted(expected[0]) == list(range(SIZE))
    assert all(expected[0][i][k] != expected[1][i][k] for i in range(SIZE) for k in range(3))
    for workers in (2, 3):
        for persistent in (False, True):
            data = loader(workers, persistent)  # persistent: the same workers read both epochs
            assert [epoch_draws(data, epoch) for epoch in (0, 1)] == expected, (workers,
                                                                                persistent)


def test_a_loader_resumed_mid_epoch_draws_what_an_unbroken_one_draws():
    expected = epoch_draws(loader(2), 1)
    resumed = loader(3)
    resumed.sampler.load_state_dict({"epoch": 1, "cursor": 3 * BATCH, "seed": SEED})
    start_epoch(resumed, 1, SEED, from_cursor=True)
    rest = draws(resumed)
    assert len(rest) == SIZE - 3 * BATCH
    assert rest == {index: expected[index] for index in rest}


def test_only_training_loaders_with_workers_are_seeded_per_sample():
    seeded = loader(2)
    assert isinstance(seeded.dataset, SeededSamples)
    assert len(seeded.dataset) == SIZE and seeded.dataset.size == SIZE  # the data set's own
    assert seeded.sampler.state_dict() == {"epoch": 0, "cursor": 0, "seed": SEED}
    first = next(iter(seeded.sampler))
    assert first == (first[0], sample_seed(SEED, 0, first[0]))
    for plain in (loader(0), loader(2, train=False)):
        assert isinstance(plain.dataset, Augmenting)
        assert all(isinstance(index, int) for index in plain.sampler)


def _read_on_ranks() -> dict[int, tuple[float, float, float]]:
    """This rank's share of epoch 1. The pool's processes are daemons, which may not start
    DataLoader workers: the built loader's data set and sampler are read here, in process
    (what workers change is the test above's)."""
    built = loader(2)
    start_epoch(built, 1, SEED)
    return draws(DataLoader(built.dataset, batch_size=BATCH, sampler=built.sampler))


def test_every_rank_draws_for_a_sample_what_one_process_draws(run_on):
    expected = epoch_draws(loader(2), 1)
    shares = run_on(2)(_read_on_ranks)
    assert set(shares[0]).isdisjoint(shares[1])
    assert {**shares[0], **shares[1]} == expected
