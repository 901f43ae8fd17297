"""Reading a checkpoint of any format by its path, in this process with no group.

What ``load_from``, ``trainrun export``, ``trainrun test`` and the checks before a run read:
each function takes a checkpoint or a run directory (its newest checkpoint, see
`resolve_checkpoint`) and asks the checkpoint's format (`checkpoint_format`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import Tensor

from trainrun.checkpoint.format import checkpoint_format
from trainrun.checkpoint.manager import resolve_checkpoint
from trainrun.checkpoint.manifest import verify_checkpoint
from trainrun.checkpoint.optimizer_state import Groups


def check_checkpoint_file(path: str | os.PathLike) -> Path:
    """The checkpoint ``path`` names (see `resolve_checkpoint`), after a cheap look that it
    is one and holds only tensors and plain containers: the file itself (memory-mapped, so
    its tensors are not read), a sharded checkpoint's metadata, or a DeepSpeed checkpoint's
    train state and model files. What it does not read is read with weights_only on loading,
    and its hashes are verified by the runner. Raises FileNotFoundError, ValueError or
    pickle.UnpicklingError, each with one line; DamagedCheckpoint (a ValueError) where the
    look fails on a file that does not match the checkpoint's manifest."""
    path = resolve_checkpoint(path)
    try:
        checkpoint_format(path).look_inside(path)
    except Exception:
        verify_checkpoint(path, alone=True)  # damage, where the manifest shows it, says more
        raise
    return path


def model_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of the model's state in the checkpoint ``path``, plain keys,
    from what its format records about them (the tensors themselves are not read)."""
    return checkpoint_format(path).model_shapes(path)


def saved_param_groups(path: Path) -> Groups | None:
    """The parameter groups of the optimiser state in the checkpoint ``path``, from what its
    format records about them (see `CheckpointFormat.param_groups`); None where it holds
    none, or its format does not say."""
    return checkpoint_format(path).param_groups(path)


def read_train_state(path: str | os.PathLike) -> dict[str, Any]:
    """The runner's own state in a checkpoint of any format (position, RNG states, the
    hooks' states), read in this process with no group."""
    path = resolve_checkpoint(path)
    return checkpoint_format(path).read_train_state(path)


def read_weights(path: str | os.PathLike) -> dict[str, Tensor]:
    """The model's whole state, plain keys, from a checkpoint of any format (a file, a
    sharded directory or a DeepSpeed directory), read in this process with no group."""
    path = resolve_checkpoint(path)
    return checkpoint_format(path).read_weights(path)
