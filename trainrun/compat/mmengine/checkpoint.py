"""Checkpoints that cross between MMEngine and trainrun.compat.mmengine, both ways.

- MMEngine to trainrun: a checkpoint MMEngine wrote is read by trainrun's checkpoint format
  'mmengine' (``trainrun.checkpoint.mmengine_file``), so the compat Runner's ``load_from``
  (weights) and ``resume=True, load_from=<file>`` (model, optimiser, position) take it as they
  take trainrun's own; `load_checkpoint` is MMEngine's function of that name, on either kind.
  An iteration-counting run resumed from MMEngine's file goes on with the data where
  MMEngine's ``IterBasedTrainLoop`` would (`continue_as_mmengine`).
- trainrun to MMEngine: MMEngine's ``load_checkpoint`` (and its Runner's ``load_from``) take a
  file's ``state_dict`` entry as the weights, and without one the whole file, which then loads
  nothing (a warning only). `MMEngineDDP`, the strategy the compat Runner trains with, writes
  trainrun's checkpoint with that entry added: the model's own tensors again, which torch
  stores once. trainrun's own runs (strategy 'ddp') write what they always wrote.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from trainrun.checkpoint.format import checkpoint_format
from trainrun.checkpoint.mmengine_file import MMEngineFile
from trainrun.checkpoint.optimizer_state import Optimizers
from trainrun.checkpoint.read import read_weights
from trainrun.runner.sampler import ResumableSampler
from trainrun.wrappers.ddp import DDPStrategy

log = logging.getLogger("trainrun")

# The key under which MMEngine's load_checkpoint looks for the weights.
MMENGINE_WEIGHTS = "state_dict"


class MMEngineDDP(DDPStrategy):
    """Strategy 'ddp' (its name, options and training are the same) whose checkpoints MMEngine
    loads too: each holds the model's weights under ``state_dict`` as well as ``model``.

    Args:
        options: ``DDPStrategy``'s options.
    """

    def _whole_state(self, model: nn.Module, optimizer: Optimizers | None,
                     extra: dict[str, Any]) -> dict[str, Any]:
        state = super()._whole_state(model, optimizer, extra)
        return {**state, MMENGINE_WEIGHTS: state["model"]}


def continue_as_mmengine(runner: Any, path: str | os.PathLike) -> None:
    """After ``runner`` resumed from ``path``: where that is MMEngine's file and the run counts
    iterations, put the data where MMEngine's ``IterBasedTrainLoop`` goes on, and leave
    anything else as trainrun's resume left it.

    MMEngine's iteration loop walks its loader without end (the sampler's epoch going up at
    each pass) and, resumed after ``iter`` iterations, skips ``iter`` batches; its checkpoint's
    ``epoch`` is 0. trainrun's run would start its first epoch again: here its epoch becomes
    ``iter // batches per epoch`` and the sampler's cursor the batches after it. A run that
    counts epochs needs nothing: MMEngine's epoch loop starts the checkpoint's epoch at its
    beginning, as trainrun's resume from a file without a sampler state does.

    Args:
        runner: the compat Runner, just resumed (``Runner.resume``).
        path: the checkpoint it resumed from.
    """
    loop = getattr(runner, "train_loop", None)
    if runner.by_epoch or loop is None or checkpoint_format(path) is not MMEngineFile:
        return
    loader = runner.train_dataloader
    sampler = loader.sampler
    if not isinstance(sampler, ResumableSampler):  # a loader given as it is: its own order
        return
    sampler.set_epoch(0)  # a whole epoch's batches, whatever the cursor was
    epoch, done = divmod(runner.iter, len(loader))
    sampler.set_epoch(epoch)
    for _ in range(done):
        sampler.trained(loader.batch_size or 1)
    runner.epoch = epoch
    loop.resume_mid_epoch = True


def load_checkpoint(model: nn.Module, filename: str | os.PathLike,
                    map_location: str | torch.device | None = None,
                    strict: bool = False,
                    revise_keys: Sequence[tuple[str, str]] = ((r"^module\.", ""),),
                    logger: Any = None) -> dict[str, Any]:
    """``mmengine.runner.load_checkpoint``: load a checkpoint's weights into ``model``.

    The checkpoint is any trainrun reads (one of its own, a sharded one, or MMEngine's),
    read with ``weights_only``; a run directory means its newest checkpoint. As MMEngine does,
    a wrapped model's ``module`` is loaded, ``revise_keys`` rename the weights first, and
    names that do not match are a warning unless ``strict``.

    Args:
        model: the model (or a wrapper with ``module``).
        filename: the checkpoint, or a run directory.
        map_location: the device to put the tensors on (they are read onto the CPU first).
        strict: refuse missing or unexpected names.
        revise_keys: ``(pattern, replacement)`` pairs applied to every name, in order.
        logger: accepted for MMEngine's signature; trainrun logs to its own logger.

    Returns:
        ``{'state_dict': <the weights as loaded>}``.

    Raises:
        RuntimeError: ``strict`` and the names do not match.
        FileNotFoundError: no checkpoint there.
    """
    weights = read_weights(filename)
    for pattern, replacement in revise_keys:
        weights = {re.sub(pattern, replacement, key): value for key, value in weights.items()}
    if map_location is not None:
        weights = {key: value.to(map_location) for key, value in weights.items()}
    module = getattr(model, "module", model)
    result = module.load_state_dict(weights, strict=strict)
    if not strict and (result.missing_keys or result.unexpected_keys):
        log.warning(
            "load_checkpoint %s: the model and the checkpoint's weights do not match: "
            "missing %s, unexpected %s", filename, result.missing_keys or "none",
            result.unexpected_keys or "none")
    return {MMENGINE_WEIGHTS: weights}


__all__ = ["MMENGINE_WEIGHTS", "MMEngineDDP", "continue_as_mmengine", "load_checkpoint"]
