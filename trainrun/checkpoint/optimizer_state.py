"""The optimiser's state in a checkpoint: taken from one optimiser or a dict of them by
submodule, and loaded back, refusing one that does not fit this run's optimiser; and the
parameter groups a saved state holds, compared with this run's before anything is loaded."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
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


# ---------------------------------------------------------------- parameter groups

@dataclass(frozen=True)
class GroupRecord:
    """One parameter group of an optimiser, as a checkpoint records it or a run builds it.

    Args:
        name: the name ``optim.paramwise``'s builder gave it ('default', 'bias', a custom
            key in quotes...); None where the group has none (no paramwise) or the
            checkpoint does not record it.
        tensors: how many tensors it holds; None where the checkpoint does not record them
            as the optimiser counts them (DeepSpeed's records leave frozen ones out).
    """

    name: str | None
    tensors: int | None


# Each optimiser's groups, by the submodule it optimises ('' for one optimiser of the model)
Groups = dict[str, list[GroupRecord]]


def _records(param_groups: Any) -> list[GroupRecord]:
    """The records of a torch optimiser's ``param_groups`` (live or saved: ``params`` is a
    list of tensors, of indices or of names)."""
    return [GroupRecord(group.get("name"), len(group.get("params") or []))
            for group in param_groups]


def optimizer_groups(optimizer: Optimizers | None) -> Groups | None:
    """The parameter groups of this run's ``optimizer`` (one, or a dict of them by
    submodule); None without one."""
    if optimizer is None:
        return None
    if isinstance(optimizer, Mapping):
        return {name: _records(opt.param_groups) for name, opt in optimizer.items()}
    return {"": _records(optimizer.param_groups)}


def saved_groups(state: Any) -> Groups | None:
    """The parameter groups of a saved optimiser state (a torch ``state_dict``, or a dict of
    them by submodule); None where it holds none (or none in a form known here)."""
    if not isinstance(state, Mapping):
        return None
    if "param_groups" in state:
        return {"": _records(state["param_groups"])}
    if state and all(isinstance(one, Mapping) and "param_groups" in one
                     for one in state.values()):
        return {name: _records(one["param_groups"]) for name, one in state.items()}
    return None


def describe_records(groups: list[GroupRecord]) -> str:
    """``groups`` in words: '2 parameter groups (default: 2 tensors; bias: 2 tensors)'."""
    parts = []
    for number, group in enumerate(groups, 1):
        name = group.name or ("all parameters" if len(groups) == 1 else f"group {number}")
        count = "" if group.tensors is None else \
            f": {group.tensors} tensor{'s' if group.tensors != 1 else ''}"
        parts.append(name + count)
    plural = "s" if len(groups) != 1 else ""
    return f"{len(groups)} parameter group{plural}" + (f" ({'; '.join(parts)})" if parts else "")


def _optimisers(groups: Groups) -> str:
    names = [name for name in groups if name]
    return (f"the optimisers of {', '.join(map(repr, names))} (optim.per_module)" if names
            else "one optimiser")


def groups_mismatch(saved: Groups, run: Groups) -> str | None:
    """How a checkpoint's parameter groups (``saved``) differ from those of this run's
    optimiser (``run``), in words, or None where the state fits them: the same optimisers,
    each with as many groups holding as many tensors (where both count them). What torch's
    ``load_state_dict`` would otherwise refuse once the run had begun."""
    if saved.keys() != run.keys():
        return (f"its optimiser state is of {_optimisers(saved)}, this config makes "
                f"{_optimisers(run)}")
    for name, groups in run.items():
        there = saved[name]
        if len(there) != len(groups) or any(
                a.tensors is not None and b.tensors is not None and a.tensors != b.tensors
                for a, b in zip(there, groups, strict=True)):
            whose = f"its optimiser state of {name!r}" if name else "its optimiser state"
            return (f"{whose} holds {describe_records(there)}, this config makes "
                    f"{describe_records(groups)}")
    return None
