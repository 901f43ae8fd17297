"""A run's train state: everything but model and optimiser that an exact resume needs.

It is put together from the run's stateful parts (its position, the optimiser wrapper, the
schedulers, the sampler, a stream, the hooks, the RNG states), each a `StatePart` the runner
lists: its key in the checkpoint, how to get its state on this rank, whether every rank's is
kept (gathered on rank 0, which writes the train state), and how to put it back. The keys
and their order in a saved train state are fixed (`LAYOUT`): older checkpoints have them,
and a checkpoint's bytes depend on them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trainrun.dist import gather_object

log = logging.getLogger("trainrun")

# The runner's own state (rank 0's) inside a checkpoint that is a directory (dcp, deepspeed).
TRAIN_STATE = "train_state.pt"

# The keys of a saved train state, in the order they are written.
LAYOUT = ("meta", "sampler", "optim_wrapper", "schedulers", "rng", "hooks", "stream")


@dataclass
class StatePart:
    """One stateful part of a run, as its train state holds it.

    Args:
        name: its key in the train state (one of ``LAYOUT``).
        state: this rank's state now.
        load: puts back what a checkpoint holds under ``name`` (None where it holds none).
        every_rank: keep every rank's state (a list by rank, gathered on rank 0), for a part
            whose state differs between ranks; else this rank's (rank 0's is written).
    """

    name: str
    state: Callable[[], Any]
    load: Callable[[Any], None]
    every_rank: bool = False


class TrainState:
    """A run's train state, from its stateful parts.

    Args:
        parts: the parts, in the order they are put back on resuming (the saved keys keep
            ``LAYOUT``'s order whatever it is).
    """

    def __init__(self, parts: Sequence[StatePart]) -> None:
        self.parts = list(parts)

    def state_dict(self) -> dict[str, Any]:
        """Every part's state by its name, in ``LAYOUT``'s order; rank 0's holds every rank's
        state of the ``every_rank`` parts, which this gathers: every rank must call it.

        Returns:
            The train state (complete on rank 0).
        """
        states = {part.name: gather_object(part.state(), dst=0) if part.every_rank
                  else part.state() for part in self.parts}
        return {name: states[name] for name in sorted(states, key=_saved_place)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put every part back from ``state`` (a saved train state), in the parts' order.

        Args:
            state: what ``state_dict`` returned when the checkpoint was written.
        """
        for part in self.parts:
            part.load(state.get(part.name))


def _saved_place(name: str) -> int:
    return LAYOUT.index(name) if name in LAYOUT else len(LAYOUT)


class HookStates:
    """The hooks' part of a train state: each hook's ``state_dict()`` by its key, rank 0's,
    or every rank's (``{'per_rank': [...]}``) for a hook whose ``state_per_rank`` is True.

    A hook's key is its class's name, and for a second hook of one class ``Name#2`` (and so
    on, in the order of the hooks), so that two of a kind keep their states apart; a first
    one keeps the key older checkpoints used.

    Args:
        hooks: the run's hooks, in their order.
        rank: this process's rank.
        world_size: the number of ranks of the job.
    """

    def __init__(self, hooks: Sequence[Any], rank: int, world_size: int) -> None:
        self.hooks = hooks
        self.rank = rank
        self.world_size = world_size

    def keyed(self) -> list[tuple[str, Any]]:
        """Each hook with the key of its state in a checkpoint."""
        seen: dict[str, int] = {}
        keyed = []
        for hook in self.hooks:
            name = type(hook).__name__
            seen[name] = seen.get(name, 0) + 1
            keyed.append((name if seen[name] == 1 else f"{name}#{seen[name]}", hook))
        return keyed

    def part(self) -> StatePart:
        """The train state's ``hooks`` part."""
        return StatePart("hooks", self.state_dict, self.load_state_dict)

    def state_dict(self) -> dict[str, Any]:
        """The hooks' states by key (gathered for a ``state_per_rank`` hook: every rank calls
        this)."""
        states = {}
        for key, hook in self.keyed():
            if not hasattr(hook, "state_dict"):
                continue
            if _per_rank(hook):
                states[key] = {"per_rank": gather_object(hook.state_dict(), dst=0)}
            else:
                states[key] = hook.state_dict()
        return states

    def load_state_dict(self, states: Mapping[str, Any]) -> None:
        """Each hook's state from a checkpoint: its own rank's for a ``state_per_rank`` hook
        (where the world size is the one that saved it; otherwise it starts afresh, said in
        a warning)."""
        for key, hook in self.keyed():
            if not hasattr(hook, "load_state_dict") or key not in states:
                continue
            state = states[key]
            if _per_rank(hook):
                per_rank = state["per_rank"]
                if len(per_rank) != self.world_size:
                    log.warning("%s: the checkpoint holds the states of %d ranks, this job has "
                                "%d: its state starts afresh", key, len(per_rank),
                                self.world_size)
                    continue
                state = per_rank[self.rank]
            hook.load_state_dict(state)

    def saved(self, hook: Any, train_state: Mapping[str, Any]) -> Any:
        """What ``train_state`` (a checkpoint's) holds of ``hook``'s state: this rank's for a
        ``state_per_rank`` hook saved by as many ranks; None: nothing."""
        key = next(key for key, each in self.keyed() if each is hook)
        state = train_state.get("hooks", {}).get(key)
        if isinstance(state, Mapping) and "per_rank" in state:
            per_rank = state["per_rank"]
            return per_rank[self.rank] if len(per_rank) == self.world_size else None
        return state


def _per_rank(hook: Any) -> bool:
    return getattr(hook, "state_per_rank", False) is True
