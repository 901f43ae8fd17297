"""``mmengine.dataset``: ``DefaultSampler`` and the collate functions.

``DefaultSampler`` is trainrun's resumable sampler, which deals an epoch exactly as MMEngine's
does (a permutation seeded with seed + epoch, padded by repeating it, rank r taking every
N-th index from r), so a script's runs see the batches they saw under MMEngine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch.utils.data import default_collate

from trainrun.dist import sync_random_seed
from trainrun.runner.sampler import ResumableSampler


class DefaultSampler(ResumableSampler):
    """Each rank's share of a sized data set, a new order every epoch.

    Args:
        dataset: the data set (its length is what is dealt).
        shuffle: a new permutation every epoch; False: in order.
        seed: the permutations' seed; None: one drawn on rank 0 and shared.
        round_up: pad the last round to a whole multiple of the world size (MMEngine's
            default); False is refused.

    Raises:
        ValueError: ``round_up`` is False.
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int | None = None,
                 round_up: bool = True) -> None:
        if not round_up:
            raise ValueError("DefaultSampler: round_up=False is not supported by "
                             "trainrun.compat.mmengine")
        super().__init__(len(dataset), shuffle=shuffle,
                         seed=sync_random_seed() if seed is None else seed)


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


__all__ = ["DefaultSampler", "default_collate", "pseudo_collate"]
