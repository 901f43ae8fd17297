"""The hook interface: the points of a run where hooks are called (``Hook`` lists them in
the order of a run), and the order of the built-in hooks at each point.

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
# step's time is taken, its numbers logged, the guard looks at them where due (a run that went
# wrong numerically stops or rolls back before it validates or saves), validation runs where
# due, a hook of yours (NORMAL unless it sets its own priority), then the checkpoint (so it
# holds the validation's best) and last the check for a stop signal (which stops after that
# checkpoint). The profiler marks a step's end after all of them, so that a traced step holds
# its hooks.
TIMER, LOGGER, GUARD, VALIDATION, NORMAL, CHECKPOINT, PREEMPTION = 10, 20, 30, 40, 50, 60, 70
PROFILER = 80
# The built-in slots by name, for a config's ``priority: before_checkpoint`` and the like.
SLOTS = {"timer": TIMER, "logger": LOGGER, "guard": GUARD, "validation": VALIDATION,
         "normal": NORMAL, "checkpoint": CHECKPOINT, "preemption": PREEMPTION}


class Hook:
    """Base class: override the points you need.

    Every hook point is called on every rank, with the runner first, in ascending
    ``priority`` (ties keep the order of the list: built-in hooks first, then yours). Work
    that only one rank should do (writing a file, logging) is the hook's to restrict, e.g. to
    ``runner.rank == 0``; a hook point that runs a collective must run it on every rank. The
    points, in the order of a run::

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

    ``on_error`` is called instead of the rest when training ends by an exception.

    Priorities: the built-in hooks take the slots timer (10), logger (20), guard (30),
    validation (40), normal (50, a hook's default), checkpoint (60) and preemption (70); the
    profiler runs after all of them (80). After each training step that means: the step's
    time is taken, its numbers logged, the guard looks at them where due, validation runs
    where due, your hook, then the checkpoint (so that it holds the validation's best) and
    last the check for a stop signal. A config's ``hooks``
    item may set ``priority`` to a number or to ``before_<slot>`` / ``after_<slot>`` (e.g.
    ``before_checkpoint``), which wins over the class's own.

    State: a hook that keeps state defines ``state_dict()`` (returning something picklable)
    and ``load_state_dict(state)``. The state goes into every checkpoint (keyed by the
    class's name, ``Name#2`` for a second one of the class) and is loaded on resume, before
    ``before_run``. It is rank 0's state, loaded by every rank; a hook whose state differs
    between ranks sets ``state_per_rank = True``, and then each rank's own is saved and given
    back to it (on resume with another number of ranks, it starts afresh, with a warning).
    ``state_dict`` is called on every rank at every checkpoint, so it may run collectives.

    Options: a hook built from a config gets the item's other keys as constructor
    arguments, checked by ``check_options`` before anything runs; ``OPTIONS``, a table of
    them, makes the check (and the config reference) exact.

    Attributes:
        priority: when the hook runs among the others (lower first); ``NORMAL`` (50) by
            default.
        state_per_rank: save every rank's ``state_dict`` rather than rank 0's only.
    """

    priority: int = NORMAL
    state_per_rank: bool = False  # see the module's docstring
    # The options a config may give (key -> (default, check), see `schema.py`); None: those
    # the constructor's signature names, bound against it.
    OPTIONS: Fields | None = None

    @classmethod
    def check_options(cls, key: str, options: dict[str, Any],
                      warnings: list[str]) -> dict[str, Any]:
        """The options a config's ``hooks`` item ``key`` gives this class, checked (and
        completed, where the class has a table of ``OPTIONS``); a ConfigError names the key.

        Without a table, the options are bound against the constructor's signature.

        Args:
            key: the item's place in the config (``hooks[0]``), for messages.
            options: the item's keys other than ``type`` and ``priority``.
            warnings: a list the check may append warnings to.

        Returns:
            The options, defaults filled in where the class has a table.

        Raises:
            ConfigError: an option the class does not take, a missing one, or a value its
                table refuses.
        """
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
        ``hooks[i].option``.

        Args:
            runner: the built ``Runner`` (no checkpoint loaded yet, nothing written).

        Raises:
            ValueError: a setting the run cannot use; the runner reports it as a ConfigError
                naming the hook's item.
        """

    def before_run(self, runner: Any) -> None:
        """``Runner.train`` starts, after resuming (or loading weights); every rank.

        Args:
            runner: the ``Runner``.
        """

    def after_run(self, runner: Any) -> None:
        """``Runner.train`` ends (not after a failure: then ``on_error``); every rank.

        Args:
            runner: the ``Runner``.
        """

    def before_train(self, runner: Any) -> None:
        """The training loop starts, after ``before_run``; every rank.

        Args:
            runner: the ``Runner`` (``runner.iter``: the step training starts from).
        """

    def after_train(self, runner: Any) -> None:
        """The training loop ended (its schedule done, or ``request_stop``); every rank.

        Args:
            runner: the ``Runner``.
        """

    def before_train_epoch(self, runner: Any) -> None:
        """An epoch (or the rest of one, after a resume) starts; every rank.

        Args:
            runner: the ``Runner`` (``runner.epoch``: the epoch, counting from 0).
        """

    def after_train_epoch(self, runner: Any) -> None:
        """An epoch was trained to its end; every rank.

        Args:
            runner: the ``Runner`` (``runner.epoch`` now counts the finished epochs).
        """

    def before_train_iter(self, runner: Any, batch_idx: int, batch: Any) -> None:
        """A training step is about to run; every rank.

        Args:
            runner: the ``Runner`` (``runner.iter``: the steps finished so far).
            batch_idx: the batch's index in this pass over the loader, counting from 0.
            batch: the batch as the loader gave it (not yet moved to the device).
        """

    def after_train_iter(self, runner: Any, batch_idx: int, batch: Any,
                         outputs: dict[str, Any]) -> None:
        """A training step ran (the optimiser and the schedulers stepped where due); every
        rank.

        Args:
            runner: the ``Runner`` (``runner.iter`` counts this step).
            batch_idx: the batch's index in this pass over the loader, counting from 0.
            batch: the batch as the loader gave it.
            outputs: what the model's ``train_step`` returned: the values to log by name
                (tensors; ``loss`` among them), this rank's.
        """

    def before_val(self, runner: Any) -> None:
        """Validation is about to run (within training, or from ``Runner.val``); every rank.

        Args:
            runner: the ``Runner`` (``runner.training`` says which).
        """

    def after_val(self, runner: Any, metrics: dict[str, float]) -> None:
        """Validation ran; every rank, each with the same metrics.

        Args:
            runner: the ``Runner``.
            metrics: the metrics by name (for several validation sets,
                ``val/<name>/<metric>``), as rank 0 computed them.
        """

    def before_checkpoint_save(self, runner: Any) -> None:
        """A checkpoint of the current step is about to be written (every rank): finish what
        must be on disk before a resume can start from it.

        Args:
            runner: the ``Runner``.
        """

    def before_test(self, runner: Any) -> None:
        """Testing is about to run (``Runner.test``); every rank.

        Args:
            runner: the ``Runner``.
        """

    def after_test(self, runner: Any, metrics: dict[str, float]) -> None:
        """Testing ran; every rank, each with the same metrics.

        Args:
            runner: the ``Runner``.
            metrics: the test metrics by name, as rank 0 computed them.
        """

    def on_error(self, runner: Any, error: BaseException) -> None:
        """Training ended by ``error`` (a failure, a stop signal, Ctrl-C): release what
        ``before_train`` took. No collectives here: another rank may be gone.

        Called on the ranks where training raised, instead of the remaining hook points; an
        exception it raises itself is logged, not raised (``error`` is what the user needs).

        Args:
            runner: the ``Runner``.
            error: the exception that ends training; it is raised again after every hook's
                ``on_error``.
        """


def every(count: int, interval: int) -> bool:
    """Whether the ``count``-th event (counting from 1) falls on ``interval``.

    Args:
        count: the event's number, counting from 1.
        interval: every how many events; 0 or less: never.

    Returns:
        True when ``count`` is a multiple of a positive ``interval``.
    """
    return interval > 0 and count % interval == 0
