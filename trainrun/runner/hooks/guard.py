"""Runs that go wrong numerically (the ``guard`` section): a loss, a gradient norm, weights or
optimiser state that are not finite, and loss spikes, caught before they cost a checkpoint.

Each training step the hook keeps references to the step's watched values: the logged values
whose name holds "loss" (all of them where none does) and the gradient norms the optimiser
wrapper measured, on their device. Nothing is read then, so a step that does not log pays no
host-device sync. At the steps the logger logs, and before every checkpoint, the values kept
since the last look come to the host in one copy, each rank finds the first that went wrong,
and the ranks agree on the earliest (one all_reduce of one number; the details travel only
when something went wrong). Before every checkpoint the weights and the optimiser state each
rank holds are looked at too. So every checkpoint was looked at clean before it was written,
none holds a value that is not finite, and a checkpoint that is not good never prunes a good
one; the step that went wrong is known exactly, within a logging interval of when it was.

What follows an event is the config's: ``nonfinite`` for values that are not finite,
``spike.action`` for a loss above ``spike.factor`` times its median over the last
``spike.window`` steps of this rank:

- ``stop``: the run ends with `GuardStop` (exit 1, one line naming the step, the rank and the
  value); the newest checkpoint, which was written before the event, is in charge.
- ``warn``: a warning, and training goes on; no checkpoint is written while the weights or
  the optimiser state are not finite.
- ``rollback``: every rank reloads the newest checkpoint, which is from before the event, in
  the same processes, skips the data from there to the bad step and ``skip_batches`` batches
  more, and trains on (`RollBack`, which the training loop catches); after ``max_rollbacks``
  rollbacks to the same checkpoint (none written since), it stops.
- ``skip_step`` (``nonfinite`` only): the optimiser wrapper skips each step whose gradients
  are not finite, as fp16's gradient scaler does; that reads one number a step on the host.

Every event and rollback is a warning in ``train.log``, a ``"mode": "guard"`` line in
``metrics.jsonl`` (a rollback's is ``"mode": "rollback"``) and a point on the trackers.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from trainrun.dist import all_gather_object, all_reduce, get_rank, is_distributed
from trainrun.runner.hooks.base import GUARD, Hook, every
from trainrun.runner.hooks.logger import LoggerHook
from trainrun.runner.logging import get_logger
from trainrun.runner.optim.wrapper import each_wrapper, grad_norms
from trainrun.runner.schema import choice, expects, fields, integer, nullable, number, section

NONFINITE_ACTIONS = ("stop", "rollback", "warn", "skip_step")
SPIKE_ACTIONS = ("rollback", "stop", "warn")
SKIP_BATCHES = 200  # batches skipped past the bad one after a rollback
MAX_ROLLBACKS = 3  # rollbacks with no checkpoint written between them, then a stop
SPIKE_FACTOR, SPIKE_WINDOW = 3.0, 100
SPIKE_FIRST = 10  # a loss is judged once this many steps (or the window, if fewer) came before
# what a look before a checkpoint finds, beside the watched values
WEIGHTS, OPTIMIZER_STATE = "weights", "optimizer state"


@dataclass(frozen=True)
class Event:
    """A step that went wrong, as the ranks agree on it.

    Attributes:
        step: the training step (counting from 1) whose value went wrong.
        kind: ``'nonfinite'`` or ``'spike'``.
        name: the value: a logged loss's name, ``grad_norm``, ``weights`` or ``optimizer
            state``.
        value: the value (nan, inf; for weights and optimiser state their largest magnitude).
        rank: the rank it was found on (the lowest, where several found it at that step).
        median: for a spike, the median loss it is measured against; else None.
        window: for a spike, how many steps that median is over.
    """

    step: int
    kind: str
    name: str
    value: float
    rank: int
    median: float | None = None
    window: int = 0

    def describe(self) -> str:
        """The event in words, e.g. ``loss is nan``."""
        if self.kind == "spike":
            return (f"{self.name} {self.value:.6g} is {self.value / self.median:.1f} times "
                    f"its median over the last {self.window} steps ({self.median:.6g})")
        if self.name in (WEIGHTS, OPTIMIZER_STATE):
            return f"the {self.name} hold {self.value} values"
        return f"{self.name} is {self.value}"

    def record(self, action: str) -> dict[str, Any]:
        """Its ``metrics.jsonl`` line."""
        record = {"step": self.step, "mode": "guard", "event": self.kind, "name": self.name,
                  "value": self.value, "rank": self.rank, "action": action}
        if self.median is not None:
            record["median"] = self.median
        return record


class GuardStop(Exception):  # noqa: N818 - a stop the config asks for
    """The guard stopped training: a value was not finite, or the loss spiked (`Event`), and
    the config says ``stop`` (or the rollbacks in a row ran out). Every rank raises it at the
    same step.

    Attributes:
        event: what went wrong.
        step: the step it went wrong at.
        rank: the rank it was found on.
        detail: what went wrong, what was done and which checkpoint is in charge, in words
            (the message without the step and the rank).
    """

    def __init__(self, event: Event, newest: str | None, why: str):
        self.event, self.step, self.rank = event, event.step, event.rank
        keep = (f"{newest} is the newest good checkpoint" if newest else
                "the run has no checkpoint from before it")
        self.detail = f"{event.describe()}; {why}; {keep}"
        super().__init__(f"step {event.step}, rank {event.rank}: {self.detail}")


class RollBack(Exception):  # noqa: N818 - a turn the training loop takes, never raised out
    """Raised on every rank at the same point to have the training loop reload the newest
    checkpoint (`trainrun.runner.state_parts.roll_back`); ``event``: what went wrong."""

    def __init__(self, event: Event):
        super().__init__(event.describe())
        self.event = event


class GuardHook(Hook):
    """Watches every step for values that are not finite and for loss spikes; see the
    module's docstring. The runner builds it from the ``guard`` section (and
    `Runner.save_checkpoint` asks it before every save).

    Args:
        nonfinite: what a value that is not finite makes the run do: ``'stop'``,
            ``'rollback'``, ``'warn'`` or ``'skip_step'``.
        spike: None (no spike watch), or ``{'factor', 'window', 'action'}``: a loss above
            ``factor`` times its median over the last ``window`` steps is a spike, and
            ``action`` (``'rollback'``, ``'stop'`` or ``'warn'``) follows.
        skip_batches: the batches a rollback skips past the bad one.
        max_rollbacks: the rollbacks with no checkpoint written between them, after which the
            run stops.
        interval: look at the watched values every this many steps (the logging interval),
            at the last step and before every checkpoint.
    """

    priority = GUARD  # after the logger's line, before validation and checkpoints
    state_per_rank = True  # each rank's own losses make its spike window

    def __init__(self, nonfinite: str = "stop", spike: Mapping[str, Any] | None = None,
                 skip_batches: int = SKIP_BATCHES, max_rollbacks: int = MAX_ROLLBACKS,
                 interval: int = 10):
        self.nonfinite = nonfinite
        self.spike = dict(spike) if spike is not None else None
        self.skip_batches = skip_batches
        self.max_rollbacks = max_rollbacks
        self.interval = interval
        self.rollbacks = 0  # in a row: to the checkpoint of `_rolled_to`
        self._rolled_to: tuple[Any, int] | None = None  # (path, step) they went back to
        self._skipped = 0  # batches they skipped past it
        self.skipped_steps = 0  # steps skip_step skipped in the run
        # (step, {name: value on its device}) of the steps not looked at yet
        self._pending: list[tuple[int, dict[str, Any]]] = []
        window = self.spike["window"] if self.spike else 0
        self._losses: deque[float] = deque(maxlen=window)  # this rank's last finite losses

    # ------------------------------------------------------------------ hook points

    def before_train(self, runner: Any) -> None:
        """Under ``skip_step``, have the optimiser wrappers skip steps whose gradients are not
        finite."""
        self._pending.clear()
        if self.nonfinite == "skip_step":
            for wrapper in each_wrapper(runner.optim_wrapper):
                wrapper.skip_nonfinite = True

    def after_train_iter(self, runner: Any, batch_idx: int, batch: Any,
                         outputs: dict[str, Any]) -> None:
        """Keep the step's watched values (references, no copy); look at them at a logged
        step."""
        watched = _losses(outputs)
        if runner.precision != "fp16":  # fp16's scaler skips steps whose norm overflows
            watched.update(grad_norms(runner.optim_wrapper))
        self._pending.append((runner.iter, watched))
        if every(runner.iter, self.interval) or runner.iter == runner.max_iters:
            self.look(runner)

    def may_save(self, runner: Any) -> bool:
        """Before a checkpoint (every rank): look at the values since the last look, then at
        the weights and the optimiser state, and act on what went wrong.

        Args:
            runner: the runner, about to save.

        Returns:
            Whether the checkpoint may be written (False where the weights or the optimiser
            state are not finite and the run goes on, under ``warn``).

        Raises:
            GuardStop: the config says stop (or the rollbacks in a row ran out).
            RollBack: the config says roll back.
        """
        self.look(runner)
        return self._act(runner, agree(_state_not_finite(runner))) is None  # else warned

    # ------------------------------------------------------------------ looking

    def look(self, runner: Any) -> Event | None:
        """Look at the steps not looked at yet, agree with the other ranks on the first
        event, say it and act on it. Every rank calls this at the same points.

        Args:
            runner: the runner training.

        Returns:
            The event the ranks agreed on, where the run goes on after it; else None.

        Raises:
            GuardStop: the config says stop (or the rollbacks in a row ran out).
            RollBack: the config says roll back.
        """
        self._report_skipped(runner)
        return self._act(runner, agree(self._first_event(runner.rank)))

    def _act(self, runner: Any, event: Event | None) -> Event | None:
        """Say ``event`` and do what the config says; returns it where the run goes on."""
        if event is None:
            return None
        state = event.name in (WEIGHTS, OPTIMIZER_STATE)
        action = self.nonfinite if event.kind == "nonfinite" else self.spike["action"]
        if action == "skip_step" and not state:
            return None  # the step was skipped, and said so (`_report_skipped`)
        if action == "rollback" and self.in_a_row(runner) >= self.max_rollbacks:
            self._record(runner, event, "stop")
            raise GuardStop(event, _newest(runner), f"stopped after {self.rollbacks} "
                            f"rollbacks in a row (guard.max_rollbacks)")
        self._record(runner, event, action)
        if action == "rollback":
            raise RollBack(event)
        if action == "stop":
            raise GuardStop(event, _newest(runner), "stopped (guard: stop)")
        if action == "skip_step":  # the weights themselves went wrong
            raise GuardStop(event, _newest(runner), "stopped: skipping steps did not keep "
                            "them finite")
        return event

    def _first_event(self, rank: int) -> Event | None:
        """This rank's first event among the steps not looked at yet (one copy to the host
        for each device), its spike window brought up to date with their losses."""
        pending, self._pending = self._pending, []
        if not pending:
            return None
        names = [(step, name) for step, values in pending for name in values]
        numbers = iter(_on_host([value for _, values in pending for value in values.values()]))
        by_step: dict[int, dict[str, float]] = {}
        for step, name in names:
            by_step.setdefault(step, {})[name] = next(numbers)
        found = None
        for step, values in by_step.items():
            if found is None:
                found = self._judge(step, values, rank)
            loss = _spike_loss(values)
            if loss is not None and math.isfinite(loss):
                self._losses.append(loss)
        return found

    def _judge(self, step: int, values: dict[str, float], rank: int) -> Event | None:
        """The event one step's values make, if any: a value that is not finite first, then
        a loss spike against the losses before it."""
        for name, value in values.items():
            if not math.isfinite(value):
                return Event(step, "nonfinite", name, value, rank)
        loss = _spike_loss(values)
        if self.spike is None or loss is None:
            return None
        if len(self._losses) < min(SPIKE_FIRST, self.spike["window"]):
            return None
        median = statistics.median(self._losses)
        if median > 0 and loss > self.spike["factor"] * median:
            return Event(step, "spike", "loss", loss, rank, median, len(self._losses))
        return None

    # ------------------------------------------------------------------ saying it

    def _record(self, runner: Any, event: Event, action: str) -> None:
        """The event in train.log, metrics.jsonl and on the trackers (rank 0)."""
        if runner.rank != 0:
            return
        if action == "warn":
            state = event.name in (WEIGHTS, OPTIMIZER_STATE)
            then = "training goes on" + (", this checkpoint is not written" if state else "")
        else:
            then = "rolling back" if action == "rollback" else "stopping"
        _say(runner, event.record(action), f"guard: step {event.step}, rank {event.rank}: "
             f"{event.describe()}; {then}")

    def _report_skipped(self, runner: Any) -> None:
        """The steps the optimiser wrappers skipped since the last look (all ranks know the
        same), said by rank 0."""
        skipped = sorted({step for wrapper in each_wrapper(runner.optim_wrapper)
                          for step in _take_skipped(wrapper)})
        if not skipped:
            return
        self.skipped_steps += len(skipped)
        if runner.rank != 0:
            return
        for step in skipped:
            _say(runner, {"step": step, "mode": "guard", "event": "nonfinite",
                          "name": "gradients", "action": "skip_step",
                          "skipped_steps": self.skipped_steps}, None)
        steps = ", ".join(map(str, skipped))
        get_logger().warning("guard: step%s %s skipped: gradients not finite (%d skipped in "
                             "all)", "s" if len(skipped) > 1 else "", steps, self.skipped_steps)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """This rank's spike window and the steps skipped so far (every rank's is saved)."""
        return {"losses": list(self._losses), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back this rank's spike window and the count of skipped steps; the rollbacks
        in a row, and the batches they skipped, are this process's own (a rollback loads a
        checkpoint too).

        Args:
            state: what ``state_dict`` returned on this rank.
        """
        self._losses.clear()
        self._losses.extend(state.get("losses", ()))
        self.skipped_steps = state.get("skipped_steps", 0)
        self._pending.clear()

    def in_a_row(self, runner: Any) -> int:
        """The rollbacks in a row: those to the newest checkpoint the run stands on (a
        checkpoint written since the last rollback ends the row).

        Args:
            runner: the runner training.

        Returns:
            How many rollbacks went back to that checkpoint.
        """
        return self.rollbacks if runner.checkpoints.published == self._rolled_to else 0

    def skip_after(self, event: Event, checkpoint: tuple[Any, int]) -> int:
        """Count a rollback from ``event`` to ``checkpoint``; the batches to skip from the
        checkpoint's place in the data: those the rolled-back steps trained on (after the
        batches an earlier rollback to it skipped), the bad step's, and `skip_batches` more.

        Args:
            event: what went wrong.
            checkpoint: ``(path, step)`` of the checkpoint rolled back to.

        Returns:
            The batches the training loop skips before it trains on.
        """
        if checkpoint != self._rolled_to:  # the first rollback to it
            self.rollbacks, self._skipped, self._rolled_to = 0, 0, checkpoint
        self.rollbacks += 1
        self._skipped += event.step - checkpoint[1] + self.skip_batches
        return self._skipped


def agree(mine: Event | None) -> Event | None:
    """The first event over the ranks, given this rank's (every rank calls this): the lowest
    step; at one step a rank's own value (its loss: its data made it) before the gradient
    norm every rank shares, then the lowest rank. One all_reduce of one number, and the
    events themselves only where some rank has one."""
    if not is_distributed():
        return mine
    first = torch.tensor([math.inf if mine is None else float(mine.step)], dtype=torch.float64)
    all_reduce(first, op="min")
    if math.isinf(first.item()):
        return None
    found = [event for event in all_gather_object(mine) or () if event is not None]
    return min(found, key=lambda event: (event.step, event.name.startswith("grad_norm"),
                                         event.rank))


def _say(runner: Any, record: dict[str, Any], message: str | None) -> None:
    """``record`` to metrics.jsonl and the trackers, ``message`` as a warning (rank 0)."""
    logger_hook = next((hook for hook in runner.hooks if isinstance(hook, LoggerHook)), None)
    if logger_hook is not None:
        logger_hook.log_event(runner, record, message)
        return
    runner.metrics_file.write(record)
    if message:
        get_logger().warning(message)


def _spike_loss(values: Mapping[str, float]) -> float | None:
    """The loss a spike is judged on: ``loss``, or the sum of the values whose name holds
    "loss" where the model logs no ``loss`` (``loss_cls`` and ``loss_bbox``)."""
    if "loss" in values:
        return values["loss"]
    parts = [value for key, value in values.items() if "loss" in key]
    return sum(parts) if parts else None


def _losses(outputs: Mapping[str, Any]) -> dict[str, Any]:
    """The step's values the guard watches: those whose name holds "loss" (every floating
    value where none does), detached."""
    numbers = {key: value.detach() if isinstance(value, Tensor) else value
               for key, value in outputs.items()
               if isinstance(value, float) or (isinstance(value, Tensor) and value.numel() == 1
                                              and value.is_floating_point())}
    losses = {key: value for key, value in numbers.items() if "loss" in key}
    return losses or numbers


def _on_host(values: list[Any]) -> list[float]:
    """``values`` (tensors of one element, or numbers) as floats: one copy for each
    accelerator's (a CPU tensor is read as it is, which costs least there). A DTensor (a
    gradient norm under fsdp) is made whole first, on every rank alike."""
    values = [v.full_tensor() if hasattr(v, "full_tensor") else v for v in values]
    out = [float(v) if not isinstance(v, Tensor) or v.device.type == "cpu" else None
           for v in values]
    by_device: dict[torch.device, list[int]] = {}
    for index, value in enumerate(values):
        if out[index] is None:
            by_device.setdefault(value.device, []).append(index)
    for indices in by_device.values():
        stacked = torch.stack([values[i].reshape(()) for i in indices])
        for index, copied in zip(indices, stacked.tolist(), strict=True):
            out[index] = copied
    return out  # type: ignore[return-value]


def _state_not_finite(runner: Any) -> Event | None:
    """Where the weights or the optimiser state this rank holds are not all finite: an
    event at the current step naming which, with their largest magnitude."""
    held = runner.strategy.state_tensors(runner.model, runner.optimizer)
    for kind, name in (("params", WEIGHTS), ("optim", OPTIMIZER_STATE)):
        largest = largest_magnitude(held.get(kind, ()))
        if largest is not None and not math.isfinite(largest):
            return Event(runner.iter, "nonfinite", name, largest, get_rank())
    return None


def largest_magnitude(tensors: Iterable[Tensor | None]) -> float | None:
    """The largest magnitude in floating-point ``tensors`` (this rank's part of a sharded
    one), nan where one holds nan; None where there are none. One read a device."""
    local = [getattr(t, "_local_tensor", t) for t in tensors
             if t is not None and t.is_floating_point()]
    local = [t for t in local if t.numel()]
    if not local:
        return None
    return nn.utils.get_total_norm(local, math.inf).item()


def _newest(runner: Any) -> str | None:
    """The name of the newest checkpoint this run stands on, if any."""
    published = runner.checkpoints.published
    return published[0].name if published is not None else None


def _take_skipped(wrapper: Any) -> list[int]:
    skipped = getattr(wrapper, "skipped", None)
    if not skipped:
        return []
    taken = list(skipped)
    skipped.clear()
    return taken


# ---------------------------------------------------------------- the config section

SPIKE = {
    "factor": (SPIKE_FACTOR, number(above=1),
               "a loss above this many times its median over the window is a spike"),
    "window": (SPIKE_WINDOW, integer(2), "the steps (of each rank) the median is over"),
    "action": ("rollback", choice(*SPIKE_ACTIONS), "what a spike makes the run do"),
}


def check_spike(key: str, value: Any) -> dict[str, Any]:
    return fields(key, value, SPIKE)


GUARD_KEYS = {
    "nonfinite": ("stop", choice(*NONFINITE_ACTIONS),
                  "what a loss, gradient norm, weight or optimiser state that is not finite "
                  "makes the run do: stop (exit 1, the newest good checkpoint in charge), "
                  "rollback (reload it and skip the bad data), warn, or skip_step (skip each "
                  "step whose gradients are not finite)"),
    "spike": (None, nullable(expects("a mapping", check_spike)),
              "null (off), or {factor, window, action}: a loss above factor times its median "
              "over the last window steps, and what it makes the run do (rollback, stop, "
              "warn)"),
    "skip_batches": (SKIP_BATCHES, integer(0),
                     "after a rollback, the batches skipped past the bad one (those between "
                     "the checkpoint and it are skipped too)"),
    "max_rollbacks": (MAX_ROLLBACKS, integer(1),
                      "rollbacks with no checkpoint written between them, then the run stops"),
}


check_guard = section(GUARD_KEYS)  # the ``guard`` section
