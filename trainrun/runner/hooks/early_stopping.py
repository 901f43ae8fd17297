"""Ends training once a validation metric has stopped improving.

After every validation during training the hook compares ``metric`` with the best value so
far: better by more than ``min_delta`` (higher for rule 'greater', lower for 'less') is an
improvement; a validation without one counts, and ``patience`` of them in a row stop the run
after that validation's step (``Runner.request_stop``): the step's hooks run, a checkpoint of that
step is written, and the run ends as a finished one (exit 0) with one line saying why. The
value every rank decides on is rank 0's, so all of them stop after the same validation. Best
value, its step and the count are in every checkpoint: a resumed run stops where the
unbroken one does.
"""

from __future__ import annotations

from typing import Any

from trainrun.dist import broadcast_object_list
from trainrun.messages import closest
from trainrun.runner.hooks.base import NORMAL, Hook
from trainrun.runner.hooks.checkpoint import best_rule_for, improves
from trainrun.runner.logging import get_logger
from trainrun.runner.schema import (
    REQUIRED,
    check_text,
    choice,
    fields,
    integer,
    nullable,
    number,
)

RULES = ("greater", "less")


class EarlyStoppingHook(Hook):
    """Ends training once a validation metric has stopped improving.

    Named ``EarlyStopping`` in a config's ``hooks``. After every validation during training,
    a value better than the best so far by more than ``min_delta`` is an improvement; a
    validation without one counts, and ``patience`` of them in a row stop the run after that
    validation's step (``Runner.request_stop``): the step's hooks run, a checkpoint of that
    step is written, and the run ends as a finished one (exit 0) with one line saying why.
    Every rank decides on rank 0's value, so all of them stop after the same validation. The
    best value, its step and the count are in every checkpoint: a resumed run stops where
    the unbroken one does. A metric that validation does not produce turns early stopping off
    with a warning (refused before the run starts where the metrics name what they compute).

    Args:
        metric: the validation metric to watch, as validation reports it (``accuracy``, or
            ``val/<set>/<metric>`` for several validation sets).
        rule: ``'greater'`` (higher is better) or ``'less'``; None: from the metric's name
            (``'less'`` where it contains 'loss', else ``'greater'``).
        patience: how many validations in a row without improvement stop the run (at
            least 1).
        min_delta: how much better than the best a value must be to count as an improvement
            (at least 0).

    Raises:
        ConfigError: an option out of its range (the config's checks, for Python callers).
    """

    priority = NORMAL  # see hooks/base.py for the order
    OPTIONS = {
        "metric": (REQUIRED, check_text),
        "rule": (None, nullable(choice(*RULES))),
        "patience": (5, integer(1)),
        "min_delta": (0.0, number(at_least=0)),
    }

    def __init__(self, metric: str, rule: str | None = None, patience: int = 5,
                 min_delta: float = 0.0):
        fields("", {"metric": metric, "rule": rule, "patience": patience,
                    "min_delta": min_delta}, self.OPTIONS)  # the config's checks, for Python
        self.metric = metric
        self.rule = rule or best_rule_for(metric)  # a loss: lower is better
        self.patience = patience
        self.min_delta = float(min_delta)
        self.best: float | None = None
        self.best_step: int | None = None
        self.count = 0  # validations since the best one

    @classmethod
    def check_options(cls, key: str, options: dict[str, Any],
                      warnings: list[str]) -> dict[str, Any]:
        out = super().check_options(key, options, warnings)
        if out["rule"] is None:
            out["rule"] = best_rule_for(out["metric"])
        return out

    def check(self, runner: Any) -> None:
        """A run without validation, or whose metrics (where they say their names) lack
        ``metric``, is refused before it starts.

        Args:
            runner: the built ``Runner``.

        Raises:
            ValueError: the run has no validation data, or its metrics' ``names`` lack
                ``metric`` (the message suggests the closest).
        """
        if getattr(runner, "val_dataloader", None) is None:
            raise ValueError(f"metric: {self.metric!r} is a validation metric, and this run "
                             f"has no validation (data.val is null)")
        known = [getattr(m, "names", None) for m in getattr(runner, "val_metrics", [])]
        if not known or any(names is None for names in known):
            return  # a metric that does not say what it computes: found out at validation
        produced = [name for names in known for name in names]
        if self.metric not in produced:
            hint = closest(self.metric, produced)
            raise ValueError(f"metric: got {self.metric!r}, expected one of the validation "
                             f"metrics: {', '.join(produced)}"
                             + (f"; did you mean {hint!r}?" if hint else ""))

    def before_train(self, runner: Any) -> None:
        if self.count >= self.patience:  # resumed from the checkpoint this hook stopped at
            runner.request_stop(self._reason(runner))

    def after_val(self, runner: Any, metrics: dict[str, float]) -> None:
        if not runner.training or self.metric is None:
            return
        if self.metric not in metrics:
            get_logger().warning("EarlyStopping: metric %r is not among the validation "
                                 "metrics %s; early stopping is off", self.metric, list(metrics))
            self.metric = None
            return
        value = [float(metrics[self.metric])]
        broadcast_object_list(value)  # rank 0's: every rank decides alike
        if improves(value[0], self.best, self.rule, self.min_delta):
            self.best, self.best_step, self.count = value[0], runner.iter, 0
        else:
            self.count += 1
        if self.count >= self.patience:
            runner.request_stop(self._reason(runner))

    def _reason(self, runner: Any) -> str:
        by = f" by more than {self.min_delta:g}" if self.min_delta else ""
        if self.best is None:
            what = f"{self.metric} has been nan"
        else:
            what = (f"{self.metric} has not improved on {self.best:.6g} (step "
                    f"{self.best_step}){by}")
        return (f"early stopping at step {runner.iter}: {what} for {self.count} "
                f"validation{'s' if self.count != 1 else ''}")

    def state_dict(self) -> dict[str, Any]:
        """The best value so far, its step and the validations since it.

        Returns:
            ``{'best': ..., 'best_step': ..., 'count': ...}``.
        """
        return {"best": self.best, "best_step": self.best_step, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's best value and count.

        Args:
            state: what ``state_dict`` returned.
        """
        self.best, self.best_step = state["best"], state["best_step"]
        self.count = state["count"]
