"""The optimiser's state in a checkpoint: taken from one optimiser or a dict of them by
submodule, and loaded back, refusing one that does not fit this run's optimiser; the same
state with its parameters by name, the form that carries between strategies; and the
parameter groups a saved state holds, compared with this run's before anything is loaded."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn
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


def load_optimizer_state(optimizer: Optimizers | None, state: Any,
                         model: nn.Module | None = None) -> None:
    """Load ``state`` into ``optimizer``; one that does not fit (other parameter groups, or
    another optimiser) is an `OptimizerMismatch` saying so.

    Args:
        optimizer: this run's optimiser (one, or a dict of them by submodule), or None.
        state: the saved state, its parameters by position (torch's own form) or by name
            (`named_optimizer_state`'s), or None.
        model: the plain model ``optimizer`` updates, which names its parameters: needed
            where ``state`` holds them by name.
    """
    if optimizer is None or state is None:
        return
    if is_named(state):
        if model is None or isinstance(optimizer, Mapping):
            raise OptimizerMismatch("its optimiser state holds parameters by name, which only "
                                    "one optimiser over a model can take")
        state = in_optimizer_order(state, optimizer_order(optimizer, model))
    try:
        if isinstance(optimizer, Mapping):
            for name, opt in optimizer.items():
                opt.load_state_dict(state[name])
        else:
            optimizer.load_state_dict(state)
    except (ValueError, KeyError) as error:
        raise OptimizerMismatch(f"its optimiser state does not fit this run's optimiser "
                                f"({first_line(error)}): {OPTIMIZER_MISMATCH_HINT}") from None


def another_type(optimizer: Optimizers | None) -> str | None:
    """What is wrong with ``optimizer`` after a state was loaded into it whose parameter groups
    lack a hyperparameter of its type (another type's state: torch loads it without a word,
    and the first step fails, as SGD on AdamW's groups without ``momentum``); None if none.

    Args:
        optimizer: this run's optimiser (one, or a dict of them by submodule), or None.
    """
    named = optimizer.items() if isinstance(optimizer, Mapping) else [("", optimizer)]
    for name, opt in named:
        defaults = getattr(opt, "defaults", None) or {}  # (DeepSpeed's own has none)
        for group in getattr(opt, "param_groups", None) or []:
            missing = [key for key in defaults if key not in group]
            if missing:
                which = f"{name}'s " if name else ""
                return (f"its optimiser state is another type's: its parameter groups lack "
                        f"{', '.join(missing)}, which {which}{type(opt).__name__} needs")
    return None


# ---------------------------------------------------------------- parameters by name

def is_named(state: Any) -> bool:
    """Whether a saved optimiser state holds its parameters by name (as
    ``torch.distributed.checkpoint.state_dict`` and DeepSpeed's universal checkpoint do), not by
    position (torch's ``Optimizer.state_dict``)."""
    return isinstance(state, Mapping) and any(
        isinstance(key, str) for group in state.get("param_groups") or []
        for key in group.get("params") or [])


def parameter_names(model: nn.Module) -> dict[int, str]:
    """Each parameter of ``model`` (by ``id``) and its name; a parameter shared by two
    modules (tied weights) has the first name ``named_parameters`` gives it."""
    return {id(param): name for name, param in model.named_parameters()}


def optimizer_order(optimizer: Optimizer, model: nn.Module) -> list[list[str]]:
    """The names of ``optimizer``'s parameters, group by group, in its order.

    Args:
        optimizer: an optimiser over ``model``'s parameters.
        model: the plain model.

    Returns:
        Each group's parameter names.

    Raises:
        OptimizerMismatch: the optimiser holds a tensor that is not one of the model's.
    """
    names = parameter_names(model)
    try:
        return [[names[id(param)] for param in group["params"]]
                for group in optimizer.param_groups]
    except KeyError:
        raise OptimizerMismatch("this run's optimiser updates a tensor that is not a parameter "
                                "of the model, so its state cannot be matched by name") from None


def named_optimizer_state(state: Mapping[str, Any], order: list[list[str]]) -> dict[str, Any]:
    """``state`` with its parameters by name: what carries an optimiser's state from one
    strategy to another, whichever way each holds its parameters.

    A state by position is named after this run's optimiser, the n-th parameter it holds
    being the n-th saved (what torch's ``load_state_dict`` assumes too).

    Args:
        state: a saved optimiser state, by position or by name.
        order: the names of this run's optimiser's parameters, group by group
            (`optimizer_order`).

    Returns:
        The state, by name.

    Raises:
        OptimizerMismatch: the state holds another number of parameters.
    """
    if is_named(state):
        return dict(state)
    order = [name for group in order for name in group]
    saved = [key for group in state["param_groups"] for key in group["params"]]
    if len(saved) != len(order):
        raise OptimizerMismatch(f"its optimiser state holds {len(saved)} parameters, this run's "
                                f"optimiser {len(order)}: {OPTIMIZER_MISMATCH_HINT}")
    name = dict(zip(saved, order, strict=True))
    return {"state": {name[key]: value for key, value in state["state"].items()},
            "param_groups": [{**group, "params": [name[key] for key in group["params"]]}
                             for group in state["param_groups"]]}


def in_optimizer_order(state: Mapping[str, Any], order: list[list[str]]) -> dict[str, Any]:
    """A state by name (`named_optimizer_state`) with each group's parameters in the order
    this run's optimiser holds them, which its ``load_state_dict`` matches by position.

    Args:
        state: a saved optimiser state by name.
        order: the names of this run's optimiser's parameters, group by group
            (`optimizer_order`).

    Returns:
        The state, ready for ``optimizer.load_state_dict``.

    Raises:
        OptimizerMismatch: a group holds other parameters than this run's.
    """
    if len(order) != len(state["param_groups"]):
        raise OptimizerMismatch(f"its optimiser state holds {len(state['param_groups'])} "
                                f"parameter groups, this run's optimiser {len(order)}: "
                                f"{OPTIMIZER_MISMATCH_HINT}")
    groups = []
    for number, (names, saved) in enumerate(zip(order, state["param_groups"], strict=True), 1):
        differ = sorted(set(names) ^ set(saved["params"]))
        if differ:
            raise OptimizerMismatch(
                f"its optimiser state's group {number} holds other parameters than this run's "
                f"({', '.join(differ[:3])} in one of them only): {OPTIMIZER_MISMATCH_HINT}")
        groups.append({**saved, "params": names})
    return {"state": dict(state["state"]), "param_groups": groups}


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
