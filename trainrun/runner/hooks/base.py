"""The hook interface: the points of a run where hooks are called, in this order.

before_run
  before_train
    before_train_epoch
      before_train_iter / after_train_iter      (once per batch)
    after_train_epoch
    (before_val / after_val whenever validation runs)
    (before_checkpoint_save whenever a checkpoint is about to be written)
  after_train
  (before_test / after_test)
after_run

Hooks run in ascending ``priority``. Every method receives the runner; the default does nothing.
``on_error`` is called instead of the rest when training ends by an exception.

A hook that keeps state defines ``state_dict()`` and ``load_state_dict(state)``: the state goes
into every checkpoint (keyed by the class's name, ``Name#2`` for a second one) and is loaded
on resume. It is rank 0's state, loaded by every rank; a hook whose state differs between
ranks sets ``state_per_rank = True``, and then each rank's own is saved and given back to it.
"""

from __future__ import annotations

import inspect
from typing import Any

from trainrun.runner.schema import ConfigError, Fields, call_mismatch, fields, unknown_key

# The order of the built-in hooks at every point, after each training step in particular: the
# step's time is taken, its numbers logged, validation runs where due, a hook of yours (NORMAL
# unless it sets its own priority), then the checkpoint (so it holds the validation's best)
# and last the check for a stop signal (which stops after that checkpoint).
# The profiler marks a step's end after all of them, so that a traced step holds its hooks.
TIMER, LOGGER, VALIDATION, NORMAL, CHECKPOINT, PREEMPTION = 10, 20, 40, 50, 60, 70
PROFILER = 80
# The built-in slots by name, for a config's ``priority: before_checkpoint`` and the like.
SLOTS = {"timer": TIMER, "logger": LOGGER, "validation": VALIDATION, "normal": NORMAL,
         "checkpoint": CHECKPOINT, "preemption": PREEMPTION}


class Hook:
    """Base class: override the points you need."""

    priority: int = NORMAL
    state_per_rank: bool = False  # see the module's docstring
    # The options a config may give (key -> (default, check), see `schema.py`); None: those
    # the constructor's signature names, bound against it.
    OPTIONS: Fields | None = None

    @classmethod
    def check_options(cls, key: str, options: dict[str, Any],
                      warnings: list[str]) -> dict[str, Any]:
        """The options a config's ``hooks`` item ``key`` gives this class, checked (and
        completed, where the class has a table of `OPTIONS`); a ConfigError names the key."""
        if cls.OPTIONS is not None:
            return fields(key, options, cls.OPTIONS)
        params = inspect.signature(cls).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            for name in options:
                if name not in params:
                    raise unknown_key(key, name, ["type", "priority", *params])
        mismatch = call_mismatch(cls, **options)
        if mismatch is not None:
            raise ConfigError(f"{key}: {cls.__name__} does not take these arguments: "
                              f"{mismatch}")
        return dict(options)

    def check(self, runner: Any) -> None:
        """Called on every rank once the run is built, before anything is written: raise
        ValueError for a setting that the built run shows to be wrong (a metric validation
        does not produce); a message ``option: ...`` is reported as the config's
        ``hooks[i].option``."""

    def before_run(self, runner: Any) -> None: ...
    def after_run(self, runner: Any) -> None: ...
    def before_train(self, runner: Any) -> None: ...
    def after_train(self, runner: Any) -> None: ...
    def before_train_epoch(self, runner: Any) -> None: ...
    def after_train_epoch(self, runner: Any) -> None: ...
    def before_train_iter(self, runner: Any, batch_idx: int, batch: Any) -> None: ...

    def after_train_iter(self, runner: Any, batch_idx: int, batch: Any,
                         outputs: dict[str, Any]) -> None: ...

    def before_val(self, runner: Any) -> None: ...
    def after_val(self, runner: Any, metrics: dict[str, float]) -> None: ...
    def before_checkpoint_save(self, runner: Any) -> None:
        """A checkpoint of the current step is about to be written (every rank): finish what
        must be on disk before a resume can start from it."""

    def before_test(self, runner: Any) -> None: ...
    def after_test(self, runner: Any, metrics: dict[str, float]) -> None: ...

    def on_error(self, runner: Any, error: BaseException) -> None:
        """Training ended by ``error`` (a failure, a stop signal, Ctrl-C): release what
        ``before_train`` took. No collectives here: another rank may be gone."""


def every(count: int, interval: int) -> bool:
    """Whether the ``count``-th event (counting from 1) falls on ``interval``."""
    return interval > 0 and count % interval == 0
