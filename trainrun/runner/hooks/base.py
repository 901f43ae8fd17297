"""The hook interface: the points of a run where hooks are called, in this order.

before_run
  before_train
    before_train_epoch
      before_train_iter / after_train_iter      (once per batch)
    after_train_epoch
    (before_val / after_val whenever validation runs)
  after_train
  (before_test / after_test)
after_run

Hooks run in ascending ``priority``. Every method receives the runner; the default does nothing.
"""

from __future__ import annotations

from typing import Any

# The order of the built-in hooks at every point, after each training step in particular: the
# step's time is taken, its numbers logged, validation runs where due, a hook of yours (NORMAL
# unless it sets its own priority), then the checkpoint (so it holds the validation's best)
# and last the check for a stop signal (which stops after that checkpoint).
TIMER, LOGGER, VALIDATION, NORMAL, CHECKPOINT, PREEMPTION = 10, 20, 40, 50, 60, 70


class Hook:
    """Base class: override the points you need."""

    priority: int = NORMAL

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
    def before_test(self, runner: Any) -> None: ...
    def after_test(self, runner: Any, metrics: dict[str, float]) -> None: ...


def every(count: int, interval: int) -> bool:
    """Whether the ``count``-th event (counting from 1) falls on ``interval``."""
    return interval > 0 and count % interval == 0
