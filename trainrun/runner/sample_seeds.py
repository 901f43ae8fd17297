"""Per-sample seeds: a data set's random augmentation as a function of (seed, epoch, index).

In DataLoader workers the global random streams belong to the worker, which is seeded once
per epoch and serves whichever batches it is dealt; what a sample draws then depends on the
number of workers and on where in the epoch the loader started, so a run resumed mid-epoch
would augment differently from an unbroken one. `SeededSamples` seeds python's, numpy's and
torch's global generators before every sample with `sample_seed`, which the sampler deals
beside each index (see `ResumableSampler`'s ``sample_seeds``): the same sample of the same
epoch draws the same values whatever the stop point, the number of workers or of ranks, and
persistent workers need no per-epoch message.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

MASK64 = 2**64 - 1
GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment: 2**64 over the golden ratio


def mix64(value: int) -> int:
    """splitmix64's output function of ``value`` plus its increment: a 64-bit value whose
    bits all depend on every bit of the input (neighbouring inputs give unrelated outputs)."""
    z = (value + GOLDEN_GAMMA) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The 64-bit seed of sample ``index`` in ``epoch`` of a run seeded with ``seed``."""
    return mix64((mix64((mix64(seed & MASK64) + epoch) & MASK64) + index) & MASK64)


def seed_globals(seed: int) -> None:
    """Seed torch's default CPU generator, numpy's global one and python's ``random``.

    torch's generator keeps only the low 32 bits of a seed, numpy's legacy one takes 32 bits:
    numpy gets the high half, so the two Mersenne twisters do not run the same stream. (Not
    `torch.manual_seed`, which also seeds CUDA and costs about 70 times more.)
    """
    torch.default_generator.manual_seed(seed)
    np.random.seed(seed >> 32)
    random.seed(seed)


class SeededSamples(Dataset):
    """A map-style data set read with ``(index, seed)`` keys: the global generators are seeded
    with ``seed``, then ``dataset[index]`` is returned. Everything else (its length, its
    attributes) is the wrapped data set's."""

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        index, seed = key
        seed_globals(seed)
        return self.dataset[index]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list[Any]:
        """A batch's samples, each seeded (the wrapped data set's own ``__getitems__`` would
        read them all under one seed)."""
        return [self[key] for key in keys]

    def __getattr__(self, name: str) -> Any:
        if name == "dataset" or name.startswith("__"):  # not set yet (unpickling), or special
            raise AttributeError(name)
        return getattr(self.dataset, name)
