"""The two contracts between a strategy and the loops, declared once.

A strategy's `setup` returns a model that meets `ModelContract` (its wrapper, or the user's
model itself), and its `optim_wrapper` an object that meets `OptimWrapperContract` (or None:
the runner then wraps the optimiser in its own `trainrun.runner.optim.OptimWrapper`). The
loops, hooks and runner call nothing else on them; every shipped strategy's objects meet both
(tests/wrappers/test_strategies.py checks it).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn


@runtime_checkable
class OptimWrapperContract(Protocol):
    """What the runner and its hooks call on the optimiser wrapper: one wrapper
    (`StepOptimWrapper`), or one per submodule (`trainrun.runner.optim.OptimWrapperDict`,
    whose model's ``train_step`` picks each submodule's)."""

    def get_lr(self) -> float:
        """The learning rate now, for the log."""

    def set_total(self, done_iters: int, max_iters: int) -> None:
        """The run's length, so that a last accumulation group cut short is stepped."""

    def state_dict(self) -> dict[str, Any]:
        """What an exact resume needs (accumulation position, loss scaler)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back `state_dict`'s state."""


@runtime_checkable
class StepOptimWrapper(OptimWrapperContract, Protocol):
    """One optimiser's wrapper, as a model's ``train_step`` uses it."""

    def optim_context(self, model: nn.Module) -> AbstractContextManager[Any]:
        """The block a training step's forward and backward run in (autocast; no gradient
        all-reduce on a step that only accumulates)."""

    def update_params(self, loss: Tensor) -> None:
        """Backward ``loss``, then (when the accumulation group is complete) clip, step the
        optimiser and zero the gradients."""


@runtime_checkable
class ModelContract(Protocol):
    """What the loops call on the model a strategy set up; they also read ``training``
    (`torch.nn.Module`'s flag; not declared here, as `issubclass` takes only methods). A model
    that reduces gradients in backward may also offer ``no_sync()``, a context without that
    reduction, which the runner's `OptimWrapper` enters on steps that only accumulate."""

    def train_step(self, data: Any, optim_wrapper: OptimWrapperContract) -> dict[str, Tensor]:
        """One training step on ``data`` (already on the device): forward, loss, and
        ``update_params(loss)`` inside ``optim_context(self)`` of the `StepOptimWrapper`
        (or of each submodule's, from a dict of them);
        returns the values to log, 'loss' among them (one rank's: the logger averages them)."""

    def val_step(self, data: Any) -> Any:
        """The predictions for ``data`` that the validation metrics score."""

    def test_step(self, data: Any) -> Any:
        """The predictions for ``data`` that the test metrics score."""

    def train(self, mode: bool = True) -> Any:
        """Training mode (dropout on), as `torch.nn.Module.train`."""

    def eval(self) -> Any:
        """Evaluation mode, as `torch.nn.Module.eval`."""
