"""Saves checkpoints every ``interval`` epochs (or iterations), the best on a validation
metric, and the last one at the end of training."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from trainrun.checkpoint.manager import MAX_KEEP
from trainrun.messages import closest, is_int
from trainrun.runner.hooks.base import CHECKPOINT, Hook, every
from trainrun.runner.logging import get_logger
from trainrun.runner.schema import (
    ConfigError,
    check_bool,
    check_text,
    choice,
    fields,
    integer,
    nullable,
    rule,
)

AUTO = "auto"  # checkpoint.save_best: the first metric the first validation reports


def best_rule_for(metric: str) -> str:
    """Whether a higher value of ``metric`` is better ('greater') or a lower one ('less': a
    loss, however it is spelt), where the config does not say."""
    return "less" if "loss" in metric.lower() else "greater"


def improves(value: float, best: float | None, rule: str, min_delta: float = 0.0) -> bool:
    """Whether ``value`` betters ``best`` under ``rule`` ('greater' or 'less') by more than
    ``min_delta``: nan never does; any value betters no best yet."""
    if math.isnan(value):
        return False
    if best is None:
        return True
    return value > best + min_delta if rule == "greater" else value < best - min_delta


class CheckpointHook(Hook):
    priority = CHECKPOINT  # see hooks/base.py for the order

    def __init__(self, interval: int = 1, save_last: bool = True, save_best: str | None = None,
                 best_rule: str | None = None, background: bool = False):
        self.interval = interval
        self.background = background  # periodic saves written while training goes on
        self.save_last = save_last
        self.save_best = save_best  # 'auto': the first metric of the first validation
        self.best_rule = best_rule
        self.greater = (best_rule or best_rule_for(save_best or "")) == "greater"
        self.best_value: float | None = None
        self.best_path: str | None = None
        self._saved_at: int | None = None

    def _save(self, runner: Any, background: bool = False) -> None:
        if self._saved_at != runner.iter:
            runner.save_checkpoint(background=background)
            self._saved_at = runner.iter

    def after_train_epoch(self, runner: Any) -> None:
        if runner.by_epoch and every(runner.epoch, self.interval):
            self._save(runner, self.background)

    def after_train_iter(self, runner: Any, batch_idx: int, batch: Any,
                         outputs: dict[str, Any]) -> None:
        if self.background:
            runner.checkpoints.poll()  # publishes a background save once it is on disk
        if not runner.by_epoch and every(runner.iter, self.interval):
            self._save(runner, self.background)

    def after_train(self, runner: Any) -> None:
        if self.save_last or getattr(runner, "stop_reason", None):  # stopped early: saved too
            self._save(runner)  # in the foreground: the job ends next
        runner.checkpoints.finish()

    def after_val(self, runner: Any, metrics: dict[str, float]) -> None:
        if not (self.save_best and runner.training):
            return
        if self.save_best == AUTO and metrics:
            self.save_best = next(iter(metrics))
            self.greater = (self.best_rule or best_rule_for(self.save_best)) == "greater"
        if self.save_best not in metrics:
            get_logger().warning("checkpoint.save_best=%r is not among the validation metrics "
                                 "%s; no best checkpoint is kept", self.save_best, list(metrics))
            self.save_best = None
            return
        value = metrics[self.save_best]
        if not improves(value, self.best_value, "greater" if self.greater else "less"):
            return
        previous, previous_value = self.best_path, self.best_value
        self.best_value = value
        metric = self.save_best.replace("/", "_")  # val/<set>/<metric> names no directory
        path = runner.save_checkpoint(name=f"best_{metric}_{runner.checkpoint_tag()}",
                                      update_last=False)
        if path is None:  # the guard kept it from being written: the best so far stays
            self.best_value = previous_value
            return
        self.best_path = str(path)
        if previous and previous != self.best_path:
            runner.checkpoints.remove(Path(previous))
        get_logger().info("new best %s %.6g saved", self.save_best, value)

    def state_dict(self) -> dict[str, Any]:
        return {"best_value": self.best_value, "best_path": self.best_path}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_value = state.get("best_value")
        self.best_path = state.get("best_path")


CHECKPOINT = {
    "interval": (1, integer(0),
                 "save every this many epochs (iterations with schedule.max_iters); 0: no "
                 "periodic checkpoints"),
    "max_keep": (MAX_KEEP, rule("an int >= 1, or -1 to keep all",
                                lambda v: is_int(v) and (v >= 1 or v == -1)),
                 "periodic checkpoints kept, the oldest removed first (-1: all)"),
    "save_last": (True, check_bool, "save a checkpoint at the end of training"),
    "save_best": (None, nullable(check_text),
                  "keep best_<metric>_*.pth of the best value of this validation metric "
                  "(e.g. accuracy, or val/<set>/<metric> with several sets; auto: the first "
                  "metric the validation reports)"),
    "best_rule": (None, nullable(choice("greater", "less")),
                  "whether greater or less is better for save_best (default: less for a "
                  "name with 'loss' in it, else greater)"),
    "async": (False, check_bool,
              "write periodic checkpoints in the background while training goes on (not "
              "under deepspeed)"),
}


def check_checkpoint_section(key: str, value: Any, warnings: list[str]) -> dict[str, Any]:
    """The ``checkpoint`` section (this hook's options and the manager's ``max_keep``), with
    ``best_rule`` filled from the metric's name where ``save_best`` is set."""
    out = fields(key, value, CHECKPOINT)
    if out["save_best"] is None:
        if out["best_rule"] is not None:
            warnings.append(f"{key}.best_rule is ignored without {key}.save_best")
            out["best_rule"] = None
    elif out["best_rule"] is None and out["save_best"] != AUTO:  # auto: once it is known
        out["best_rule"] = best_rule_for(out["save_best"])
    return out


def check_best_metric(key: str, save_best: str | None, val_sets: list[str] | None) -> None:
    """With several validation sets (``val_sets``, their names) the metric ``save_best``
    names must be one of a set, ``val/<name>/<metric>``: a ConfigError naming ``key``
    otherwise. (Which metrics a set reports is known only once it is scored: a metric name
    no set reports is warned about then, as with one set.)"""
    if save_best in (None, AUTO) or not val_sets:
        return
    prefix, _, rest = save_best.partition("/")
    name, _, metric = rest.partition("/")
    if prefix == "val" and name in val_sets and metric:
        return
    hint = closest(name, val_sets, cutoff=0.5) if prefix == "val" else None
    raise ConfigError(
        f"{key}: got {save_best!r}, expected val/<name>/<metric> with <name> one of the "
        f"validation sets ({', '.join(val_sets)}), e.g. 'val/{val_sets[0]}/accuracy'"
        + (f"; did you mean 'val/{hint}/{metric}'?" if hint and metric else ""))
