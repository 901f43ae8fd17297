"""How a strategy writes its checkpoints and reads them back to resume: `Checkpointing`.

``Strategy`` inherits these defaults: one torch file from rank 0 (the format
``'torch_file'``), which suits strategies whose every rank holds the whole model. A strategy
whose checkpoints are in a format of its own (a directory, every rank writing its part)
overrides ``save_checkpoint``, ``save_checkpoint_async`` and ``load_checkpoint``, names the
format in ``FORMAT`` (reading it is the format's part, in ``trainrun.checkpoint``) and says in
``WRITER_RANK`` which files each rank writes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from trainrun.checkpoint.files import BackgroundWriter, files_written_by, save_state_file
from trainrun.checkpoint.format import checkpoint_format, load_state_file
from trainrun.checkpoint.optimizer_state import (
    Groups,
    Optimizers,
    load_optimizer_state,
    optimizer_groups,
    optimizer_state,
)
from trainrun.dist import barrier, is_main_process


class Checkpointing:
    """Writing a strategy's checkpoints (every rank calls these, through the checkpoint
    manager) and restoring model and optimiser from one to resume. A base of ``Strategy``,
    whose ``model_state_dict`` and ``load_model_state_dict`` they use; ``WRITER_RANK`` (which
    files of a checkpoint each rank writes) and ``FORMAT`` (the format that reads it) are
    documented with ``Strategy``."""

    WRITER_RANK: ClassVar[re.Pattern[str] | None] = None
    FORMAT: ClassVar[str] = "torch_file"
    _background: BackgroundWriter | None = None  # checkpoint files written in the background
    model_state_dict: Callable[[nn.Module], dict[str, torch.Tensor]]
    load_model_state_dict: Callable[[nn.Module, dict[str, torch.Tensor]], None]

    def save_checkpoint(self, path: str, model: nn.Module, optimizer: Optimizers | None,
                        extra: dict[str, Any]) -> None:
        """Write model, optimiser and ``extra`` to ``path``; called on every rank.

        This default writes one file from rank 0, which suits strategies whose every rank
        holds the whole model. Sharded strategies write a directory, every rank its part.

        Args:
            path: where to write (the checkpoint manager's temporary name; it publishes the
                checkpoint once every rank's part is on disk).
            model: the model ``setup`` returned.
            optimizer: the optimiser ``setup`` returned, or None.
            extra: the runner's own state (position, RNG states, schedulers, hooks' states).
        """
        if is_main_process():
            save_state_file(path, self._whole_state(model, optimizer, extra))
        barrier()

    def own_files(self, path: str | os.PathLike, rank: int) -> list[Path]:
        """The files of the checkpoint at ``path`` (a file, or a directory) that ``rank`` wrote:
        the ones it can fsync and hash from its own page cache (another rank's may be on
        another node).

        Args:
            path: the checkpoint.
            rank: the writer's rank.

        Returns:
            The files ``WRITER_RANK`` gives to ``rank`` (all of them to rank 0 where it is
            None).
        """
        return files_written_by(Path(path), rank, self.WRITER_RANK)

    def save_checkpoint_async(self, path: str, model: nn.Module, optimizer: Optimizers | None,
                              extra: dict[str, Any]) -> Future:
        """``save_checkpoint`` that returns once the state is copied in memory: the write goes
        on in a background thread, and the future ends when this rank's part is on disk.
        Called on every rank; training may change the model as soon as this returns.

        Args:
            path: where to write, as for ``save_checkpoint``.
            model: the model ``setup`` returned.
            optimizer: the optimiser ``setup`` returned, or None.
            extra: the runner's own state.

        Returns:
            A future that ends (or raises) when this rank's part is written.
        """
        if self._background is None:
            self._background = BackgroundWriter()
        return self._background.save(path, self._whole_state(model, optimizer, extra)
                                     if is_main_process() else None)

    def _whole_state(self, model: nn.Module, optimizer: Optimizers | None,
                     extra: dict[str, Any]) -> dict[str, Any]:
        """What a one-file checkpoint holds: model, optimiser and the runner's ``extra``."""
        return {"model": self.model_state_dict(model), "optimizer": optimizer_state(optimizer),
                **extra}

    def load_checkpoint(self, path: str, model: nn.Module,
                        optimizer: Optimizers | None) -> dict[str, Any]:
        """Restore model and optimiser from ``path`` on every rank; returns the extra state.

        This default reads a checkpoint in any format whole (what another strategy wrote
        too: its optimiser state by position or by parameter name), which suits strategies
        whose every rank holds the whole model.

        Args:
            path: the checkpoint (in any format).
            model: the model ``setup`` returned.
            optimizer: the optimiser ``setup`` returned, or None.

        Returns:
            The ``extra`` state ``save_checkpoint`` was given.

        Raises:
            OptimizerMismatch: the saved optimiser state does not fit this run's optimiser.
            ValueError: the file is not a readable checkpoint, or is truncated.
        """
        state = load_state_file(path)
        self.load_model_state_dict(model, state.pop("model"))
        load_optimizer_state(optimizer, state.pop("optimizer", None), self.unwrap(model))
        return state

    def resume_refusal(self, path: Path, precision: str, accumulate: int) -> str | None:
        """Why this strategy cannot carry on exactly from the checkpoint ``path``, which
        another strategy wrote in another format, or None where it can (or ``path`` is in its
        own format): checked before anything is written.

        Args:
            path: the checkpoint to resume.
            precision: this run's ``'fp32'``, ``'bf16'`` or ``'fp16'``.
            accumulate: this run's micro-steps per optimiser step.

        Returns:
            The reason and what to do, in words, or None.
        """
        written = checkpoint_format(path)
        if written.name == self.FORMAT:
            return None
        return written.whole_refusal(path, precision, accumulate)

    def optimizer_groups(self, optimizer: Optimizers | None) -> Groups | None:
        """The parameter groups of this run's optimiser as the user's config made them: what
        a resume checks a checkpoint's against before anything is written.

        Args:
            optimizer: the optimiser ``setup`` returned, or None.

        Returns:
            Each optimiser's groups, by submodule ('' for one optimiser); None without one.
        """
        return optimizer_groups(optimizer)

    def _end_background_writes(self) -> None:
        """Wait for the background writes asked for to end (``Strategy.teardown``)."""
        if self._background is not None:
            self._background.close()
