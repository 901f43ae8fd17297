"""The optimiser's state in a checkpoint: taken from one optimiser or a dict of them by
submodule, and loaded back, refusing one that does not fit this run's optimiser."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.optim import Optimizer

from trainrun.messages import first_line

# One optimiser, or one per named submodule (what a strategy's ``setup`` returns).
Optimizers = Optimizer | dict[str, Optimizer]


def optimizer_state(optimizer: Optimizers | None) -> Any:
    """What a checkpoint holds of ``optimizer`` (one, or a dict of them by name); None
    without one."""
    if optimizer is None:
        return None
    if isinstance(optimizer, Mapping):
        return {name: opt.state_dict() for name, opt in optimizer.items()}
    return optimizer.state_dict()


class OptimizerMismatch(ValueError):
    """A checkpoint's optimiser state that this run's optimiser cannot take."""


OPTIMIZER_MISMATCH_HINT = ("optim.paramwise or optim.type changed since it was written; its "
                           "weights alone can start a run (load_from)")


def load_optimizer_state(optimizer: Optimizers | None, state: Any) -> None:
    """Load ``state`` into ``optimizer``; one that does not fit (other parameter groups, or
    another optimiser) is an `OptimizerMismatch` saying so."""
    if optimizer is None or state is None:
        return
    try:
        if isinstance(optimizer, Mapping):
            for name, opt in optimizer.items():
                opt.load_state_dict(state[name])
        else:
            optimizer.load_state_dict(state)
    except (ValueError, KeyError) as error:
        raise OptimizerMismatch(f"its optimiser state does not fit this run's optimiser "
                                f"({first_line(error)}): {OPTIMIZER_MISMATCH_HINT}") from None
