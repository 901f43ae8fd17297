"""Seeds: rank 0's seed on every rank, diff_rank_seed, determinism switches, RNG state that
survives a weights-only checkpoint, and DataLoader worker seeds."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import trainrun.dist as dist
from trainrun.runner.seed import rng_state, seed_worker, set_random_seed, set_rng_state


def draws() -> tuple[float, float, list[float]]:
    """One number from each of python's, numpy's and torch's global streams."""
    return random.random(), float(np.random.rand()), torch.rand(2).tolist()


def seeded_draws(seed: int) -> tuple[float, float, list[float]]:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return draws()


def test_set_random_seed_seeds_every_stream():
    assert set_random_seed(1234) == 1234
    got = draws()
    assert got == seeded_draws(1234)
    assert set_random_seed(4321) == 4321 and draws() != got
    seed = set_random_seed(None)
    assert 0 <= seed < 2**31 and draws() == seeded_draws(seed)


def _seed_body(diff_rank_seed, use_none):
    rank = dist.get_rank()
    # every rank asks for its own seed: rank 0's must win
    seed = set_random_seed(None if use_none else 100 + 10 * rank, diff_rank_seed=diff_rank_seed)
    return seed, draws()


@pytest.mark.parametrize("diff_rank_seed", [False, True])
def test_rank_zeros_seed_reaches_every_rank(run_on, diff_rank_seed):
    results = run_on(2)(_seed_body, diff_rank_seed, False)
    assert [seed for seed, _ in results] == [100, 100]  # rank 0's, even with diff_rank_seed
    for rank, (_, got) in enumerate(results):
        assert got == seeded_draws(100 + rank if diff_rank_seed else 100)


def test_a_random_seed_is_drawn_once_for_all_ranks(run_on):
    (seed0, draws0), (seed1, draws1) = run_on(2)(_seed_body, False, True)
    assert seed0 == seed1 and 0 <= seed0 < 2**31
    assert draws0 == draws1 == seeded_draws(seed0)


def test_deterministic_switches_torch_to_deterministic_algorithms(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark,
              torch.backends.cudnn.deterministic)
    assert before[0] is False
    try:
        set_random_seed(0, deterministic=False)
        assert not torch.are_deterministic_algorithms_enabled()
        set_random_seed(0, deterministic=True)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = before[1:]


def test_rng_state_round_trip_through_a_weights_only_file(tmp_path):
    set_random_seed(5)
    draws()
    np.random.randn()  # numpy's cached gaussian is part of its state
    random.gauss(0, 1)  # so is python's
    state = rng_state()
    expected = draws(), np.random.randn(), random.gauss(0, 1)
    torch.save({"rng": [state]}, tmp_path / "rng.pth")
    set_random_seed(99)
    draws()
    loaded = torch.load(tmp_path / "rng.pth", weights_only=True)["rng"][0]
    set_rng_state(loaded)
    assert (draws(), np.random.randn(), random.gauss(0, 1)) == expected
    set_rng_state(state)  # the in-memory state works as well
    assert (draws(), np.random.randn(), random.gauss(0, 1)) == expected


def test_seed_worker_seeds_numpy_and_python_from_torchs_seed():
    torch.manual_seed(2**40 + 17)  # the worker's torch seed may exceed numpy's range
    seed_worker(0)
    expected = (2**40 + 17) % 2**32
    assert np.random.rand() == np.random.RandomState(expected).rand()
    assert random.random() == random.Random(expected).random()


class Noise(Dataset):
    """Each item is a draw from numpy's global stream: what a worker's seed decides."""

    def __len__(self):
        return 8

    def __getitem__(self, index):
        return float(np.random.rand())


def _worker_draws(seed: int) -> list[float]:
    loader = DataLoader(Noise(), batch_size=2, num_workers=2, worker_init_fn=seed_worker,
                        generator=torch.Generator().manual_seed(seed))
    return [x for batch in loader for x in batch.tolist()]


def test_dataloader_workers_get_their_own_reproducible_seeds():
    first = _worker_draws(3)
    assert _worker_draws(3) == first  # reproducible from the loader's generator
    assert _worker_draws(4) != first
    # worker 0 dealt batches 0 and 2, worker 1 batches 1 and 3: their streams differ
    assert first[0:2] != first[2:4]
    assert len(set(first)) == 8
