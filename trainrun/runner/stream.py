"""Training on a stream: a torch `IterableDataset` as ``data.train``.

A stream has no indices for a sampler to deal, so each rank, and each DataLoader worker
within a rank, takes its own share of the items as they come (`StreamShard`). The loader is
torchdata's `StatefulDataLoader`, which snapshots where every worker is with each batch it
hands over: a checkpoint keeps the state of the batches trained on, not of those prefetched.
Where the data set has ``state_dict()``/``load_state_dict()`` that snapshot holds the data
set's own state and a resumed run goes on exactly where the stream stopped; where it has
none, the resumed run reads the stream again from the start of its pass and skips the items
already trained on (exact only for a stream that yields the same items in the same order
every time).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, get_worker_info


def has_state(dataset: Any) -> bool:
    """Whether ``dataset`` can save and restore its place in the stream."""
    return callable(getattr(dataset, "state_dict", None)) and \
        callable(getattr(dataset, "load_state_dict", None))


def is_sized(dataset: Any) -> bool:
    try:
        len(dataset)
    except TypeError:
        return False
    return True


class StreamShard(IterableDataset):
    """One rank's share of ``dataset``'s stream, dealt in rounds: each round of
    ``world_size x workers`` items gives its i-th item to slot i (rank ``r``'s worker ``w``
    is slot ``r * workers + w``). An incomplete last round is dropped, so every rank and every
    worker gets as many items as the others and the ranks stay in step. Every slot reads the
    whole stream and keeps its own items.
    """

    def __init__(self, dataset: IterableDataset, rank: int, world_size: int, num_workers: int,
                 batch_size: int, drop_last: bool):
        self.dataset = dataset
        self.rank, self.world_size = rank, world_size
        self.workers = max(num_workers, 1)
        self.batch_size, self.drop_last = batch_size, drop_last

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        slot = self.rank * self.workers + (info.id if info is not None else 0)
        width = self.world_size * self.workers
        stream = iter(self.dataset)
        while True:
            round_ = list(itertools.islice(stream, width))
            if len(round_) < width:
                return
            yield round_[slot]

    def __len__(self) -> int:
        """For a sized stream: a count of items that makes the DataLoader's length the number
        of batches this rank's loader yields (each worker batches its own share). Raises
        TypeError for a stream without a length, as `len` does."""
        rounds = len(self.dataset) // (self.world_size * self.workers)  # TypeError: unsized
        per_worker = rounds // self.batch_size if self.drop_last else -(-rounds // self.batch_size)
        return self.workers * per_worker * self.batch_size


class StatefulStreamShard(StreamShard):
    """A `StreamShard` of a data set that saves its place: its state is the data set's."""

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)


def build_stream_loader(dataset: IterableDataset, key: str, rank: int, world_size: int,
                        batch_size: int, drop_last: bool, loader: dict[str, Any],
                        **kwargs: Any) -> DataLoader:
    """A `StatefulDataLoader` over this rank's `StreamShard` of ``dataset``; ``loader`` holds
    the section's DataLoader options, ``kwargs`` the rest (collate_fn, worker_init_fn, ...)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    num_workers = loader.get("num_workers", 0)
    shard = (StatefulStreamShard if has_state(dataset) else StreamShard)(
        dataset, rank, world_size, num_workers, batch_size, drop_last)
    with warnings.catch_warnings():  # torchdata 0.11 calls torch's deprecated set_vital
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return StatefulDataLoader(
            shard, batch_size=batch_size, drop_last=drop_last, num_workers=num_workers,
            pin_memory=loader.get("pin_memory", False),
            persistent_workers=loader.get("persistent_workers", False) and num_workers > 0,
            **kwargs)


def is_stream(loader: Any) -> bool:
    """Whether ``loader`` reads a `StreamShard` (and saves its place with ``state_dict``)."""
    return isinstance(getattr(loader, "dataset", None), StreamShard)


def stream_warnings(key: str, section: dict[str, Any], dataset: Any) -> list[str]:
    """What a user should know about training on ``dataset``, a stream, from the start."""
    name = section["type"]
    said = []
    if section.get("shuffle"):
        said.append(f"{key}.shuffle is ignored: {name} is an IterableDataset, read in the "
                    f"order it yields (shuffle inside the data set, e.g. with a buffer); set "
                    f"{key}.shuffle: false to silence this")
    if not has_state(dataset):
        said.append(f"{key}: {name} has no state_dict()/load_state_dict(): a resumed run "
                    f"reads the stream again from the start of its pass and skips the batches "
                    f"already trained on (exact only if it yields the same items in the same "
                    f"order every time); give it both to resume where it stopped")
    return said
