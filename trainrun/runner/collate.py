"""Collate functions a data section can name with ``collate_fn`` (see `builder.collate_function`).

`pad_sequences` batches samples whose sequences differ in length (tokens, audio frames, ...):
torch's default collate can only stack tensors of one shape. It lives in the runner, not in
`trainrun.examples`, because it is a general tool for any data set, not an example's part.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import default_collate

from trainrun.registry import COLLATES


def _is_sequence(value: Any) -> bool:
    return isinstance(value, Tensor) and value.dim() >= 1


def pad_batch(tensors: Sequence[Tensor], pad_value: float = 0) -> tuple[Tensor, Tensor]:
    """``tensors`` (each ``(length, *rest)``, ``rest`` alike) padded along their first
    dimension to the longest with ``pad_value`` and stacked, and the mask (bool, batch x
    longest) that is True at the real positions."""
    lengths = torch.tensor([len(t) for t in tensors], dtype=torch.long)
    padded = pad_sequence(list(tensors), batch_first=True, padding_value=pad_value)
    mask = torch.arange(padded.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
    return padded, mask


def pad_sequences(batch: Sequence[Any], pad_value: float = 0,
                  keys: Sequence[str | int] | None = None) -> Any:
    """A batch of samples whose sequences (tensors of at least one dimension) may differ in
    length, padded to the batch's longest with ``pad_value``.

    ``keys`` names the sequence fields (a dict sample's keys, a tuple sample's positions); by
    default every tensor of at least one dimension in the first sample. Other fields are
    collated as torch's `default_collate` does. What comes back: for dict samples a dict with
    each sequence ``key`` padded and ``'<key>_mask'`` beside it (bool, True at real
    positions); for tuple or list samples a tuple of the fields, padded where they are
    sequences, followed by the masks in the same order; for tensor samples ``(padded, mask)``.
    """
    if not batch:
        raise ValueError("pad_sequences got an empty batch")
    first = batch[0]
    if isinstance(first, Tensor):
        return pad_batch(batch, pad_value)
    if isinstance(first, Mapping):
        fields = list(first)
    elif isinstance(first, (tuple, list)):
        fields = list(range(len(first)))
    else:
        raise TypeError(f"pad_sequences takes samples that are dicts, tuples or tensors; "
                        f"got a {type(first).__name__}")
    chosen = [f for f in fields if _is_sequence(first[f])] if keys is None else list(keys)
    missing = [f for f in chosen if f not in fields]
    if missing:
        raise KeyError(f"pad_sequences: keys {missing} are not in the samples (fields: {fields})")
    out: dict[Any, Any] = {}
    masks: dict[Any, Tensor] = {}
    for name in fields:
        column = [sample[name] for sample in batch]
        if name in chosen:
            out[name], masks[name] = pad_batch(column, pad_value)
        else:
            out[name] = default_collate(column)
    if isinstance(first, Mapping):
        return {**out, **{f"{name}_mask": mask for name, mask in masks.items()}}
    return (*out.values(), *masks.values())


COLLATES.register("default", default_collate)
COLLATES.register("pad_sequences", pad_sequences)
