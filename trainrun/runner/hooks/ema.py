"""Keeps an exponential moving average (EMA) of the model's weights beside the model.

.. code-block:: yaml

    hooks:
      - {type: EMA, momentum: 0.001, interval: 1, warmup: 100}

Every ``interval`` training steps the average moves towards the weights:
``average = (1 - momentum) * average + momentum * weights`` (MMEngine's convention: the
momentum is the weight of the new value). For the first ``warmup`` updates the momentum is at
least ``1 / (n + 1)`` at the n-th, so that the average starts as the plain mean of the weights
seen so far and the untrained starting weights fade at once instead of over 1/momentum steps.

The average is kept in fp32 and cut as the strategy cuts the parameters (``Strategy.param_shards``):
under fsdp and ZeRO-3 each rank keeps the average of its own shard only. Buffers (batch-norm
statistics) are the model's own. With ``evaluate`` (the default) validation and testing run on
the average: it is swapped into the model before them, and the trained weights, kept aside,
back after (bit for bit). A checkpoint holds the whole average under the plain model's names
(gathered on save, cut again on resume, so a resume on another number of ranks keeps it);
``tools/export.py --ema`` writes it, and ``tools/test.py`` evaluates it when the config names
this hook.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from trainrun.checkpoint.read import read_train_state
from trainrun.checkpoint.train_state import HookStates
from trainrun.runner.hooks.base import VALIDATION, Hook, every
from trainrun.runner.schema import bad_value, check_bool, expects, fields, integer, is_number


def _momentum(key: str, value: Any) -> float:
    if not (is_number(value) and 0 < value <= 1):
        raise bad_value(key, value, "a number in (0, 1]")
    return value


class EMAHook(Hook):
    """Keeps an exponential moving average (EMA) of the model's weights beside the model.

    Named ``EMA`` in a config's ``hooks``. Every ``interval`` training steps the average
    moves towards the weights: ``average = (1 - momentum) * average + momentum * weights``.
    It runs just before the validation slot: after the optimiser's step, and before
    validation, which may use the average at once. The average is kept in fp32 and cut as
    the strategy cuts the parameters (under fsdp and ZeRO-3 each rank keeps the average of its
    own shard); buffers are the model's own. A checkpoint holds the whole average under the
    plain model's names, so a resume on another number of ranks keeps it; testing a
    checkpoint (``load_from``) uses its average.

    Args:
        momentum: the weight of the new value in each update (MMEngine's convention), in
            (0, 1].
        interval: update the average every this many training steps (at least 1).
        warmup: for the first this many updates the momentum is at least ``1 / (n + 1)`` at
            the n-th, so that the average starts as the plain mean of the weights seen so
            far and the untrained starting weights fade at once instead of over 1/momentum
            steps (0: no warm-up).
        evaluate: validate and test on the average: it is swapped into the model before
            them, and the trained weights, kept aside, back after (bit for bit).

    Raises:
        ConfigError: an option out of its range (the config's checks, for Python callers).
    """

    # after the optimiser's step and before validation, which may use the average at once
    priority = VALIDATION - 1
    OPTIONS = {
        "momentum": (0.0002, expects("a number in (0, 1]", _momentum)),
        "interval": (1, integer(1)),
        "warmup": (0, integer(0)),
        "evaluate": (True, check_bool),
    }

    def __init__(self, momentum: float = 0.0002, interval: int = 1, warmup: int = 0,
                 evaluate: bool = True):
        fields("", {"momentum": momentum, "interval": interval, "warmup": warmup,
                    "evaluate": evaluate}, self.OPTIONS)  # the config's checks, for Python
        self.momentum = float(momentum)
        self.interval = interval
        self.warmup = warmup
        self.evaluate = evaluate
        self.updates = 0
        self.average: dict[str, Tensor] | None = None  # this rank's part of each parameter
        self._saved: dict[str, Tensor] | None = None  # whole, from a checkpoint, not yet cut
        self._trained: dict[str, Tensor] | None = None  # kept aside while the average is in
        self._runner: Any = None

    # ---------------------------------------------------------------- training

    def before_train(self, runner: Any) -> None:
        self._runner = runner
        strategy, model = runner.strategy, runner.model
        if self._saved is not None:  # resumed: the checkpoint's average, cut for this job
            self.average = {name: tensor.float() for name, tensor in
                            strategy.shard_params(model, self._saved).items()}
            self._saved = None
        elif self.average is None:
            self.average = {name: tensor.float().clone() for name, tensor in
                            strategy.param_shards(model).items()}

    def after_train_iter(self, runner: Any, batch_idx: int, batch: Any,
                         outputs: dict[str, Any]) -> None:
        if self.average is None or not every(runner.iter, self.interval):
            return
        self.updates += 1
        momentum = self.momentum
        if self.updates <= self.warmup:
            momentum = max(momentum, 1 / (self.updates + 1))
        weights = runner.strategy.param_shards(runner.model)
        averages = list(self.average.values())
        with torch.no_grad():
            torch._foreach_lerp_(averages, [weights[name].to(torch.float32)
                                            for name in self.average], momentum)

    # ---------------------------------------------------------------- evaluation

    def before_val(self, runner: Any) -> None:
        if self.evaluate and self.average is not None:
            self._swap_in(runner, self.average)

    def after_val(self, runner: Any, metrics: dict[str, float]) -> None:
        self._swap_out(runner)

    def before_test(self, runner: Any) -> None:
        if not self.evaluate:
            return
        average = self.average
        if average is None and not runner.training and runner.load_from:
            saved = HookStates(runner.hooks, runner.rank, runner.world_size).saved(
                self, read_train_state(runner.load_from))
            if saved is None:
                runner.logger.warning("EMA: %s holds no average of the weights (its run had no "
                                      "EMA hook): testing the trained weights", runner.load_from)
                return
            average = runner.strategy.shard_params(runner.model, saved["weights"])
        if average is not None:
            self._swap_in(runner, average)
            runner.logger.info("EMA: testing the average of the weights")

    def after_test(self, runner: Any, metrics: dict[str, float]) -> None:
        self._swap_out(runner)

    def _swap_in(self, runner: Any, average: dict[str, Tensor]) -> None:
        shards = runner.strategy.param_shards(runner.model)
        self._trained = {name: tensor.clone() for name, tensor in shards.items()}
        with torch.no_grad():
            for name, tensor in shards.items():
                tensor.copy_(average[name])
        runner.strategy.shards_written(runner.model)

    def _swap_out(self, runner: Any) -> None:
        if self._trained is None:
            return
        with torch.no_grad():
            for name, tensor in runner.strategy.param_shards(runner.model).items():
                tensor.copy_(self._trained[name])
        self._trained = None
        runner.strategy.shards_written(runner.model)

    # ---------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, Any]:
        """The update count and the whole average (gathered: every rank calls this).

        Returns:
            ``{'updates': ..., 'weights': {name: whole fp32 tensor on the CPU}}``.
        """
        if self.average is None:
            return {"updates": self.updates, "weights": self._saved or {}}
        runner = self._runner
        whole = runner.strategy.full_params(runner.model, self.average)
        return {"updates": self.updates,
                "weights": {name: tensor.detach().to("cpu", copy=True)
                            for name, tensor in whole.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a checkpoint's average; it is cut for this rank when training starts.

        Args:
            state: what ``state_dict`` returned.
        """
        self.updates = state["updates"]
        self._saved = state["weights"]  # cut for this rank in before_train
        self.average = None
