"""What a checkpoint format is, and which one a checkpoint on disk is in.

A format is one way a checkpoint lies on disk (one torch file, a DCP directory, a DeepSpeed
directory) and knows how to read it in one process with no group: what ``load_from``,
``trainrun export``, ``trainrun test`` and the checks before a run need. Adding one is a file
with a `CheckpointFormat` subclass plus one ``FORMATS.register`` line (``trainrun.registry``;
trainrun/checkpoint/__init__.py registers the shipped ones); a strategy names the format it
writes (``Strategy.FORMAT``). Nothing here imports a strategy.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar

import torch

from trainrun.checkpoint.optimizer_state import Groups
from trainrun.registry import FORMATS

# The format a checkpoint that no other registered format owns is read in: one torch file.
FALLBACK = "torch_file"


class CheckpointFormat(ABC):
    """One on-disk form of a checkpoint, and how it is read in this process with no group.

    Every method is a classmethod: a format holds no state. A new format implements ``owns``,
    ``look_inside``, ``read_state`` and ``model_shapes``; ``read_weights`` and
    ``read_train_state`` take their parts of ``read_state`` unless overridden (a format that
    can read the weights alone, or the train state alone, does so more cheaply);
    ``param_groups`` says nothing unless overridden (a resume then finds a mismatch of the
    optimiser's groups only as it loads them).

    Attributes:
        name: the format's name, as it is registered in ``FORMATS`` and as
            ``Strategy.FORMAT`` names it.
    """

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def owns(cls, path: Path) -> bool:
        """Whether ``path`` is a checkpoint in this format (a cheap look: no tensor is read).

        Args:
            path: a file or directory.

        Returns:
            True for a checkpoint in this format.
        """

    @classmethod
    @abstractmethod
    def look_inside(cls, path: Path) -> None:
        """A cheap look that ``path`` is a readable checkpoint holding only tensors and plain
        containers (its tensors' data is not read).

        Args:
            path: the checkpoint.

        Raises:
            ValueError: not a readable checkpoint (damaged, truncated, written by something
                else).
            pickle.UnpicklingError: it holds something other than tensors and plain
                containers.
        """

    @classmethod
    @abstractmethod
    def read_state(cls, path: Path) -> dict[str, Any]:
        """The whole checkpoint as one plain state (model, optimiser, the runner's state).

        Args:
            path: the checkpoint.

        Returns:
            The state, with the model's under ``'model'`` and the optimiser's under
            ``'optimizer'``.
        """

    @classmethod
    @abstractmethod
    def model_shapes(cls, path: Path) -> dict[str, tuple[int, ...]]:
        """The shape of every tensor of the model's state, from what the format records about
        them (the tensors themselves are not read).

        Args:
            path: the checkpoint.

        Returns:
            Each tensor's shape, by the plain model's keys.
        """

    @classmethod
    def param_groups(cls, path: Path) -> Groups | None:
        """The parameter groups of the optimiser state in the checkpoint, from what the format
        records about them (the state's tensors are not read): what a resume checks against
        this run's optimiser before anything is written.

        Args:
            path: the checkpoint.

        Returns:
            Each optimiser's groups, by submodule ('' for one optimiser); None where the
            checkpoint holds no optimiser state, or the format does not say.
        """
        return None

    @classmethod
    def whole_refusal(cls, path: Path, precision: str, accumulate: int) -> str | None:
        """Why a strategy that writes another format cannot carry on exactly from ``path``
        read whole (`read_state`), or None where it can: what a resume under another
        strategy checks before anything is written. None unless overridden.

        Args:
            path: the checkpoint.
            precision: the resuming run's ``'fp32'``, ``'bf16'`` or ``'fp16'``.
            accumulate: the resuming run's micro-steps per optimiser step.

        Returns:
            The reason and what to do, in words, or None.
        """
        return None

    @classmethod
    def read_weights(cls, path: Path) -> dict[str, torch.Tensor]:
        """The whole model's state, plain keys, read in this process with no group.

        Args:
            path: the checkpoint.

        Returns:
            The weights by the plain model's keys.
        """
        state = cls.read_state(path)
        return state.get("model", state)

    @classmethod
    def read_train_state(cls, path: Path) -> dict[str, Any]:
        """The runner's own state in the checkpoint (position, RNG states, the hooks' states),
        read in this process with no group.

        Args:
            path: the checkpoint.

        Returns:
            Everything but the model's and the optimiser's state.
        """
        state = cls.read_state(path)
        return {key: value for key, value in state.items() if key not in ("model", "optimizer")}


def checkpoint_format(path: str | os.PathLike) -> type[CheckpointFormat]:
    """The format of the checkpoint ``path``: the first registered format (``FORMATS``) that
    owns it, else the torch-file format (``FALLBACK``), which reads any other file.

    Args:
        path: a checkpoint file or directory.

    Returns:
        The format's class.
    """
    path = Path(path)
    fallback = FORMATS[FALLBACK]
    for candidate in FORMATS.values():
        if candidate is not fallback and candidate.owns(path):
            return candidate
    return fallback


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a checkpoint itself (a file, or a directory in a registered
    format), not a directory holding checkpoints."""
    path = Path(path)
    return path.exists() and (not path.is_dir() or checkpoint_format(path) is not
                              FORMATS[FALLBACK])


def load_state_file(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's content, refusing anything but tensors and plain containers; a
    checkpoint in a directory format comes back whole, as one plain state."""
    return checkpoint_format(path).read_state(Path(path))
