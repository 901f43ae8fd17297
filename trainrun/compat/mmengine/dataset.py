"""``mmengine.dataset``: ``DefaultSampler``, ``InfiniteSampler`` and the collate functions.

``DefaultSampler`` is trainrun's resumable sampler, which deals an epoch exactly as MMEngine's
does (a permutation seeded with seed + epoch, padded by repeating it unless ``round_up`` is
False, rank r taking every N-th index from r), so a script's runs see the batches they saw
under MMEngine.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import default_collate

from trainrun.dist import sync_random_seed
from trainrun.runner.sampler import ResumableSampler


class DefaultSampler(ResumableSampler):
    """Each rank's share of a sized data set, a new order every epoch.

    With ``round_up=False`` rank r takes every N-th index of the order from r and nothing
    more, as MMEngine's does: ``len(range(r, len(dataset), N))`` samples, so the ranks' shares
    differ by one where the world size does not divide the data set, and every sample is
    scored once. The compat Runner takes it for validation and test data only (ranks with
    different numbers of batches would leave DDP waiting in training).

    Args:
        dataset: the data set (its length is what is dealt).
        shuffle: a new permutation every epoch; False: in order.
        seed: the permutations' seed; None: one drawn on rank 0 and shared.
        round_up: pad the last round to a whole multiple of the world size (MMEngine's
            default), repeating the order's first indices; False: no padding.
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int | None = None,
                 round_up: bool = True) -> None:
        super().__init__(len(dataset), shuffle=shuffle,
                         seed=sync_random_seed() if seed is None else seed)
        self.round_up = round_up

    def __len__(self) -> int:
        if self.round_up:
            return super().__len__()
        return len(range(self.rank, self._remaining(), self.num_replicas))

    def __iter__(self) -> Iterator[int]:
        if self.round_up:
            return super().__iter__()  # type: ignore[return-value]
        return iter(self.epoch_order()[self.cursor:][self.rank::self.num_replicas])


class InfiniteSampler(ResumableSampler):
    """MMEngine's sampler for iteration-based runs: an endless stream of permutations drawn
    one after another from one generator seeded with ``seed``, rank r taking every N-th index
    of the stream from r.

    trainrun walks it as one pass of ``samples`` indices per rank (the compat Runner gives the
    run's ``max_iters * batch_size``), so the loader is started once, as MMEngine starts it,
    and a resumed run picks the stream up at its place (``cursor``: the samples all ranks
    have taken).

    Args:
        dataset: the data set (its length is the permutations' length).
        shuffle: permute; False: the indices in order, over and over.
        seed: the generator's seed; None: one drawn on rank 0 and shared.
        samples: the indices each rank takes in all; None: the data set's length.
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int | None = None,
                 samples: int | None = None) -> None:
        super().__init__(len(dataset), shuffle=shuffle,
                         seed=sync_random_seed() if seed is None else seed)
        self.samples = len(dataset) if samples is None else samples

    def set_epoch(self, epoch: int) -> None:
        """The stream goes on across passes: only the pass's number is kept."""
        self.epoch = epoch

    def trained(self, batch_size: int) -> None:
        """One step of every rank's ``batch_size`` samples is taken."""
        self.cursor += batch_size * self.num_replicas

    def finish_epoch(self) -> None:
        """The pass is the whole run: there is nothing to skip."""

    def __len__(self) -> int:
        return max(self.samples - self.cursor // self.num_replicas, 0)

    def __iter__(self) -> Iterator[int]:
        start = self.cursor + self.rank
        return itertools.islice(self.stream(start), 0, len(self) * self.num_replicas,
                                self.num_replicas)

    def stream(self, start: int) -> Iterator[int]:
        """The stream's indices from position ``start`` on."""
        generator = torch.Generator()
        generator.manual_seed(self.seed)
        skipped, offset = divmod(start, self.dataset_len)
        for _ in range(skipped if self.shuffle else 0):
            torch.randperm(self.dataset_len, generator=generator)
        while True:
            order = torch.randperm(self.dataset_len, generator=generator).tolist() \
                if self.shuffle else list(range(self.dataset_len))
            yield from order[offset:]
            offset = 0


def pseudo_collate(data_batch: Sequence[Any]) -> Any:
    """A batch that keeps its samples' values as lists instead of stacking them: a list of
    dicts becomes a dict of lists, a list of tuples a list of lists (nested alike).

    Raises:
        ValueError: the samples of a batch are sequences of different lengths.
    """
    first = data_batch[0]
    if isinstance(first, Mapping):
        return type(first)({key: pseudo_collate([d[key] for d in data_batch]) for key in first})
    if isinstance(first, (list, tuple)) and not isinstance(first, str):
        if any(len(item) != len(first) for item in data_batch):
            raise ValueError("pseudo_collate: each sample of a batch must have as many fields")
        return [pseudo_collate(list(field)) for field in zip(*data_batch, strict=True)]
    return list(data_batch)


__all__ = ["DefaultSampler", "InfiniteSampler", "default_collate", "pseudo_collate"]
