"""The training, validation and test loops.

Training counts in epochs or in iterations (``max_epochs`` or ``max_iters``); either way it
walks the data epoch by epoch, so the sampler's epoch and cursor always say where it is.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import nullcontext
from typing import Any

import torch
from torch.utils.data import DataLoader

from trainrun.dist import at_step, phase, report_place, set_phase
from trainrun.dist.device import autocast_dtype
from trainrun.runner.hooks.guard import RollBack
from trainrun.runner.sampler import ResumableSampler
from trainrun.runner.schema import ConfigError, fields, integer, nullable
from trainrun.runner.state_parts import roll_back
from trainrun.runner.stream import is_sized, is_stream

MAX_EPOCHS = 10  # a run's length when the config gives none


def to_device(batch: Any, device: torch.device) -> Any:
    """Tensors of a (nested) batch moved to ``device``; anything else left as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return type(batch)({k: to_device(v, device) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def start_epoch(loader: DataLoader, epoch: int, seed: int, from_cursor: bool = False) -> None:
    """Point ``loader`` at ``epoch``: its sampler's order, and a loader generator of its own so
    workers' seeds depend on the epoch, not on how much of the global RNG was used."""
    sampler = loader.sampler
    if isinstance(sampler, ResumableSampler) and not from_cursor:
        sampler.set_epoch(epoch)
    elif hasattr(sampler, "set_epoch") and not isinstance(sampler, ResumableSampler):
        sampler.set_epoch(epoch)
    if loader.generator is not None:
        loader.generator.manual_seed(seed + epoch)


def pass_over(loader: DataLoader, resumed: bool) -> Iterator[Any]:
    """An iterator over ``loader``'s (rest of the) epoch.

    A loader without a generator of its own (``trainrun.compat.mmengine``'s, as MMEngine's)
    draws its base seed from the global generator when an epoch begins. A run resumed inside
    an epoch restored the global state from after that draw, so its draw is undone: the
    random numbers that follow are those of the run that was never stopped.
    """
    if not resumed or loader.generator is not None:
        return iter(loader)
    state = torch.get_rng_state()
    iterator = iter(loader)
    torch.set_rng_state(state)
    return iterator


class TrainLoop:
    """Runs epochs until ``max_epochs`` epochs or ``max_iters`` iterations are done.

    ``runner.epoch`` is the 0-based epoch being trained; it counts the finished epochs by the
    time ``after_train_epoch`` runs. ``runner.iter`` counts finished iterations.
    """

    def __init__(self, runner: Any, dataloader: DataLoader):
        self.runner = runner
        self.dataloader = dataloader
        self.resume_mid_epoch = False  # set when a checkpoint stopped inside an epoch
        self.inside_epoch = False  # an epoch is begun and not yet counted as finished
        self.epoch_steps = len(dataloader) if is_sized(dataloader) else 0  # a whole epoch's
        self.skip = 0  # batches to pass over untrained (after a rollback)

    def steps_left(self) -> int:
        """The steps a run that counts epochs has still to train: the rest of the epoch it
        resumed inside (the loader's length, its sampler put back at its place), then whole
        epochs at this run's number of ranks, which may not be the checkpoint's. A loader
        without trainrun's sampler (a stream's pass, a loader given as it is) keeps the
        schedule's count."""
        runner = self.runner
        if not isinstance(self.dataloader.sampler, ResumableSampler):
            return runner.max_iters - runner.iter
        whole = max(runner.max_epochs - runner.epoch, 0)
        if not self.resume_mid_epoch:
            return whole * self.epoch_steps
        return len(self.dataloader) + max(whole - 1, 0) * self.epoch_steps

    def run(self) -> None:
        """Train to the end of the schedule. Where the guard rolls back (`RollBack`, raised
        on every rank at the same point), the run goes back to its newest checkpoint
        (`trainrun.runner.state_parts.roll_back`) and the loop trains on from there, past the
        batches the rollback skips."""
        runner = self.runner
        runner.call_hook("before_train")
        while True:
            try:
                while not runner.train_done():
                    self.run_epoch()
                at_step(runner.iter, done=runner.iter)  # the last step, not one after it
                set_phase("after_train hooks")
                report_place()  # where the job would end if this rank hung now
                runner.call_hook("after_train")  # (its last checkpoint may roll back too)
                return
            except RollBack as back:
                self.skip = roll_back(runner, back.event)

    def run_epoch(self) -> None:
        """One epoch, or what is left of it. A step, top to bottom: the ``before_train_iter``
        hooks, the train step, the counters (``runner.iter``, the sampler's cursor, the
        schedulers), then the ``after_train_iter`` hooks in the order `hooks.base` states: the
        step's time, its log line, validation where due, your hooks, the checkpoint, and last
        the check for a stop signal. An epoch that ends calls ``after_train_epoch`` in the
        same order. A hook's `request_stop` ends the loop after the step's hooks."""
        runner, loader = self.runner, self.dataloader
        resumed = self.resume_mid_epoch
        start_epoch(loader, runner.epoch, runner.seed, from_cursor=resumed)
        self.resume_mid_epoch = False
        sampler = loader.sampler
        resumable = isinstance(sampler, ResumableSampler)  # it keeps where the epoch is
        if resumable and self.skip:  # a rollback's skip: the cursor moves, nothing is loaded
            self._skip_in_epoch(sampler)
        runner.call_hook("before_train_epoch")
        self.inside_epoch = True
        # a step's hooks, those of runner.hooks now (a hook added in an epoch runs from the next)
        before_iter = runner.hook_methods("before_train_iter")
        after_iter = runner.hook_methods("after_train_iter")
        runner.model.train()
        finished = True
        at_step(runner.iter + 1)
        set_phase("data loading")
        for batch_idx, batch in enumerate(pass_over(loader, resumed)):
            if self.skip:  # a rollback's skip, where only loading the batches passes them
                self.skip -= 1
                continue
            set_phase("hooks")
            for hook in before_iter:
                hook(runner, batch_idx, batch)
            with phase("train step"):
                outputs = runner.model.train_step(to_device(batch, runner.device),
                                                  runner.optim_wrapper)
            runner.iter += 1
            at_step(runner.iter, done=runner.iter)  # a stop in its hooks loses it too
            if resumable:
                sampler.trained(loader.batch_size or 1)
            for scheduler in runner.schedulers:
                scheduler.step()
            for hook in after_iter:
                hook(runner, batch_idx, batch, outputs)
            if runner.stop_reason is not None or (not runner.by_epoch
                                                  and runner.iter >= runner.max_iters):
                # a stream's loader counts a whole pass, not what is left of it: its pass
                # ends when a later run's loop finds nothing more in it
                finished = not is_stream(loader) and batch_idx + 1 == len(loader)
                break
            at_step(runner.iter + 1)
            set_phase("data loading")
        set_phase("hooks")
        if finished:
            if resumable:
                sampler.finish_epoch()
            runner.epoch += 1
            self.inside_epoch = False
            runner.call_hook("after_train_epoch")

    def _skip_in_epoch(self, sampler: ResumableSampler) -> None:
        """Move ``sampler`` past as many of the batches to skip as this epoch has left."""
        batch_size = self.dataloader.batch_size or 1
        passed = min(self.skip, len(self.dataloader))
        for _ in range(passed):
            sampler.trained(batch_size)
        self.skip -= passed


class EvalLoop:
    """Predicts every batch of one data set and scores it with ``metrics``; or of several
    (``dataloader`` and ``metrics`` dicts by set name), each scored with its own metrics and
    reported as ``<mode>/<name>/<metric>``. The hooks see one ``before_<mode>`` and one
    ``after_<mode>`` with every set's results."""

    def __init__(self, runner: Any, dataloader: DataLoader | Mapping[str, DataLoader],
                 metrics: list[Any] | Mapping[str, list[Any]], mode: str):
        self.runner = runner
        self.dataloader = dataloader
        self.metrics = metrics
        self.mode = mode  # 'val' or 'test'

    @torch.no_grad()
    def run(self) -> dict[str, float]:
        with phase(self.mode):
            return self._run()

    def _run(self) -> dict[str, float]:
        runner = self.runner
        runner.call_hook(f"before_{self.mode}")
        was_training = runner.model.training
        runner.model.eval()
        if isinstance(self.dataloader, Mapping):
            results = {f"{self.mode}/{name}/{key}": value
                       for name, loader in self.dataloader.items()
                       for key, value in self._score(loader, self.metrics[name]).items()}
        else:
            results = self._score(self.dataloader, self.metrics)
        runner.model.train(was_training)
        runner.call_hook(f"after_{self.mode}", results)
        return results

    def _score(self, loader: DataLoader, metrics: list[Any]) -> dict[str, float]:
        """``loader``'s data predicted and scored with ``metrics``."""
        runner = self.runner
        start_epoch(loader, 0, runner.seed)
        dtype = autocast_dtype(runner.precision)
        autocast = torch.autocast(runner.device.type, dtype) if dtype else nullcontext()
        step = runner.model.val_step if self.mode == "val" else runner.model.test_step
        for batch in loader:
            batch = to_device(batch, runner.device)
            with autocast:
                outputs = step(batch)
            for metric in metrics:
                metric.process(batch, outputs)
        size, peers = len(loader.dataset), runner.strategy.model_parallel_size
        results: dict[str, float] = {}
        for metric in metrics:  # (a metric of MMEngine's may take no replicas)
            results.update(metric.evaluate(size) if peers == 1 else
                           metric.evaluate(size, replicas=peers))
        return results


SCHEDULE = {
    "max_epochs": (None, nullable(integer(1)),
                   f"train this many epochs (one of max_epochs and max_iters; {MAX_EPOCHS} "
                   f"epochs when neither is set)"),
    "max_iters": (None, nullable(integer(1)),
                  "train this many iterations instead; then every interval counts iterations"),
    "val_interval": (1, integer(1),
                     "validate every this many epochs (iterations with max_iters) and at the "
                     "end"),
    "val_begin": (1, integer(1),
                  "validate only from this epoch (iteration with max_iters) on"),
}


def check_schedule(key: str, value: Any) -> dict[str, Any]:
    """The ``schedule`` section: how long the loop trains (epochs or iterations, one of them;
    `MAX_EPOCHS` where neither is given) and how often it validates."""
    out = fields(key, value, SCHEDULE)
    if out["max_epochs"] is not None and out["max_iters"] is not None:
        raise ConfigError(f"{key}: got both max_epochs ({out['max_epochs']}) and max_iters "
                          f"({out['max_iters']}), expected exactly one")
    if out["max_epochs"] is None and out["max_iters"] is None:
        out["max_epochs"] = MAX_EPOCHS
    return out
