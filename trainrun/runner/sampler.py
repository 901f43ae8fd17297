"""A distributed sampler that can start in the middle of an epoch.

It deals indices to ranks exactly as torch's `DistributedSampler` does (the same
permutation for the same seed and epoch; rank r takes positions r, r + N, ...), but its
position is a global sample cursor: resuming skips the consumed indices without loading a
single batch, and the cursor means the same thing for any number of ranks. With
``sample_seeds`` it deals ``(index, seed)`` pairs, the seed a function of (seed, epoch, index)
only, for `SeededSamples` to read the sample with.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from trainrun.dist import get_dist_info
from trainrun.runner.sample_seeds import sample_seed


def batches_per_epoch(dataset_length: int, world_size: int, batch_size: int,
                      drop_last: bool) -> int:
    """Batches per epoch on each rank: the data set is padded to a multiple of the world size
    (as torch's DistributedSampler does), then each rank's share is cut into batches."""
    per_rank = math.ceil(dataset_length / world_size)
    return per_rank // batch_size if drop_last else math.ceil(per_rank / batch_size)


class ResumableSampler(Sampler[int | tuple[int, int]]):
    """Indices of one rank's share of ``dataset_len`` samples, from ``cursor`` onwards; with
    ``sample_seeds``, ``(index, sample_seed(seed, epoch, index))`` pairs."""

    def __init__(self, dataset_len: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, num_replicas: int | None = None,
                 rank: int | None = None, sample_seeds: bool = False):
        default_rank, default_world = get_dist_info()
        self.dataset_len = dataset_len
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.num_replicas = num_replicas if num_replicas is not None else default_world
        self.rank = rank if rank is not None else default_rank
        self.sample_seeds = sample_seeds
        self.epoch = 0
        self.cursor = 0  # samples of this epoch, over all ranks, already consumed

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning."""
        self.epoch = epoch
        self.cursor = 0

    def trained(self, batch_size: int) -> None:
        """One step of this epoch is trained: each rank's batch of ``batch_size`` samples."""
        self.cursor = min(self.cursor + batch_size * self.num_replicas, self.dataset_len)

    def finish_epoch(self) -> None:
        """This epoch is trained to its end (a last batch that drop_last left out included)."""
        self.cursor = self.dataset_len

    def epoch_order(self) -> list[int]:
        """The whole epoch's order, the same on every rank (torch's DistributedSampler's)."""
        if not self.shuffle:
            return list(range(self.dataset_len))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_len, generator=generator).tolist()

    def _remaining(self) -> int:
        return max(self.dataset_len - self.cursor, 0)

    def __len__(self) -> int:
        if self.drop_last:
            return self._remaining() // self.num_replicas
        return math.ceil(self._remaining() / self.num_replicas)

    def __iter__(self) -> Iterator[int | tuple[int, int]]:
        order = self.epoch_order()
        remaining = order[self.cursor:]
        total = len(self) * self.num_replicas
        if total > len(remaining):  # pad by wrapping around, as DistributedSampler does
            padding = total - len(remaining)
            remaining += (order * math.ceil(padding / len(order)))[:padding]
        share = remaining[:total][self.rank::self.num_replicas]
        if self.sample_seeds:
            seed, epoch = self.seed, self.epoch
            return ((index, sample_seed(seed, epoch, index)) for index in share)
        return iter(share)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = state["epoch"]
        self.cursor = state["cursor"]
        self.seed = state["seed"]
