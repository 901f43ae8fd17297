"""Choosing, and verifying, the checkpoint a run starts from.

A run resumes (``resume``: its newest intact checkpoint, or the one named) or starts from the
weights of another (``load_from``). Both are chosen, verified against their manifests and
checked against the model before anything is written, so a checkpoint the run cannot use is
refused at once (`UnusableCheckpoint`, or the runner's config error).
"""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Callable
from pathlib import Path

from trainrun.checkpoint.format import is_checkpoint
from trainrun.checkpoint.manager import checkpoints_in, newest_first, resolve_checkpoint
from trainrun.checkpoint.manifest import DamagedCheckpoint, verify_checkpoint
from trainrun.checkpoint.optimizer_state import Groups, groups_mismatch
from trainrun.checkpoint.read import model_shapes, saved_param_groups
from trainrun.dist import broadcast_object_list, is_main_process
from trainrun.messages import first_line

log = logging.getLogger("trainrun")

# ('resume', checkpoint), or ('load', checkpoint) for its weights alone
Start = tuple[str, Path]


class UnusableCheckpoint(ValueError):
    """A checkpoint to start from that the run cannot use: missing, damaged, or written by
    another model. The message is one line naming the config key (``resume`` or
    ``load_from``)."""


def newest_intact(directory: Path, skipped: Callable[[DamagedCheckpoint], None]
                  ) -> tuple[Path, bool] | None:
    """The newest checkpoint in ``directory`` that is not damaged (see `newest_first`), and
    whether it was verified (False: it has no manifest); ``skipped`` is told of each damaged
    one passed over. None: ``directory`` has no checkpoint. Every rank must call this (the
    verification is shared); all get the same answer. Raises ValueError if every checkpoint
    is damaged."""
    found = [None]
    if is_main_process():
        found[0] = [str(path) for path in newest_first(directory)]
    broadcast_object_list(found)
    damaged = []
    for candidate in map(Path, found[0]):
        try:
            return candidate, verify_checkpoint(candidate)
        except DamagedCheckpoint as error:
            skipped(error)
            damaged.append(str(error))
    if damaged:
        raise ValueError(f"no intact checkpoint in {directory}: {'; '.join(damaged)}")
    return None


def model_mismatch(model: dict[str, tuple[int, ...]],
                   checkpoint: dict[str, tuple[int, ...]]) -> str | None:
    """The first tensor of ``model`` (name -> shape) that the checkpoint's do not fit, said in
    words, or None when every one fits."""
    for key, shape in model.items():
        if key not in checkpoint:
            return f"the model's {key} is not in it"
        if checkpoint[key] != shape:
            return (f"{key} has shape {list(checkpoint[key])} there, the model's "
                    f"{list(shape)}")
    return None


class StartPoint:
    """Chooses the checkpoint a run starts from and verifies each checkpoint it loads against
    its manifest, once (every rank must call its methods: the verification is shared).

    Args:
        directory: the run's ``checkpoints`` directory, where ``resume: true`` looks.
        refusal: the exception (a subclass of ValueError) a checkpoint the run cannot use
            raises, given its one-line message: the runner's ``ConfigError``, so that it is
            refused as a config is; by default `UnusableCheckpoint`.
    """

    def __init__(self, directory: Path,
                 refusal: type[ValueError] = UnusableCheckpoint) -> None:
        self.directory = directory
        self.refusal = refusal
        self._intact: set[Path] = set()  # checkpoints verified against their manifests

    def choose(self, resume: bool | str | os.PathLike, load_from: str | os.PathLike | None
               ) -> Start | None:
        """What the run starts from, verified: ('resume', checkpoint), ('load', checkpoint)
        for weights only, or None.

        Resuming from a run directory (``resume`` True, or its path) goes back from its
        newest checkpoint to the newest intact one, saying what it skipped; with none there
        yet, the run starts from the beginning (or from ``load_from``).

        Args:
            resume: False, True (this run's newest) or a checkpoint or run directory.
            load_from: a checkpoint or run directory whose weights alone start the run, or
                None.

        Returns:
            How and from what the run starts, or None.

        Raises:
            ValueError: ``refusal``, for a damaged checkpoint named by path, a run directory
                whose checkpoints are all damaged, or a path that names no checkpoint.
        """
        if resume:
            given = None if resume is True else Path(resume)
            if given is not None and is_checkpoint(given):
                return "resume", self.verified("resume", given)
            try:
                if given is not None:
                    resolve_checkpoint(given)  # a directory whose `last` names a checkpoint
                directory = checkpoints_in(given) if given else self.directory
                found = newest_intact(directory, _log_skipped)
            except (FileNotFoundError, ValueError) as error:
                raise self.refusal(f"resume: {error}") from None
            if found is not None:
                _log_if_unverified(*found)
                self._intact.add(found[0])
                return "resume", found[0]
            log.info("resume: no checkpoint in %s yet; starting from the beginning",
                     self.directory)
        if load_from:
            try:
                path = resolve_checkpoint(load_from)
            except FileNotFoundError as error:
                raise self.refusal(f"load_from: {error}") from None
            return "load", self.verified("load_from", path)
        return None

    def verified(self, key: str, path: Path) -> Path:
        """``path``, once verified against its manifest (once for this start point).

        Args:
            key: the config key that named it (``resume`` or ``load_from``), for messages.
            path: the checkpoint.

        Returns:
            ``path``.

        Raises:
            ValueError: ``refusal``, for a damaged checkpoint (the message names ``key``,
                the checkpoint and the file that failed).
        """
        if path not in self._intact:
            try:
                _log_if_unverified(path, verify_checkpoint(path))
            except DamagedCheckpoint as error:
                raise self.refusal(f"{key}: {error}") from None
            self._intact.add(path)
        return path

    def check_fits(self, start: Start | None, shapes: dict[str, tuple[int, ...]],
                   groups: Groups | None = None) -> None:
        """Refuse a checkpoint to start from that another model wrote: a tensor missing, or of
        another shape, against ``shapes`` (the model's), read from the checkpoint's records
        of its tensors. A checkpoint to resume is also refused where its optimiser state
        holds other parameter groups than ``groups`` (``optim.paramwise`` changed since it
        was written), which loading it would find only once the run had begun.

        Args:
            start: what ``choose`` returned.
            shapes: the shape of every tensor of the model's state, by name.
            groups: the parameter groups of this run's optimiser(s) (``Strategy.optimizer_groups``);
                None: no optimiser, nothing to check.

        Raises:
            ValueError: ``refusal``, naming the first tensor that does not fit, the groups
                that differ (what the checkpoint holds, what this config makes, and what to
                do), or why the checkpoint's records cannot be read.
        """
        if start is None:
            return
        kind, path = start
        key = "resume" if kind == "resume" else "load_from"
        try:
            mismatch = model_mismatch(shapes, model_shapes(path))
            saved = saved_param_groups(path) if kind == "resume" and groups else None
        except (OSError, ValueError, pickle.UnpicklingError) as error:  # unreadable, or unsafe
            raise self.refusal(f"{key}: {first_line(error)}") from None
        if mismatch is not None:
            raise self.refusal(f"{key}: {path} was written by another model: {mismatch}")
        differ = None if saved is None or groups is None else groups_mismatch(saved, groups)
        if differ is not None:
            raise self.refusal(
                f"{key}: {path}: {differ}: optim.paramwise (or optim.per_module) changed "
                f"since it was written; resume without that change, or start a new run "
                f"from its weights alone (load_from: {path}, in another work_dir)")


def _log_skipped(error: DamagedCheckpoint) -> None:
    if is_main_process():
        log.warning("resume: skipped: %s", error)


def _log_if_unverified(path: Path, verified: bool) -> None:
    if not verified:
        log.info("%s has no manifest of hashes (written before checkpoints were hashed): "
                 "loading it unverified", path)
