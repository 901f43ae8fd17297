"""A run's train state from its stateful parts: saved under fixed keys in a fixed order
whatever order the parts are listed (and put back) in, every rank's state of the parts that
differ by rank gathered on rank 0; the hooks' states keyed by class (a second of a class
apart), per rank where a hook says so."""

from __future__ import annotations

import logging

import pytest

from trainrun.checkpoint.train_state import LAYOUT, HookStates, StatePart, TrainState
from trainrun.dist import get_rank


def test_the_layout_is_the_one_older_checkpoints_have():
    assert LAYOUT == ("meta", "sampler", "optim_wrapper", "schedulers", "rng", "hooks",
                      "stream")


class Counter:
    """A hook with a state: rank 0's, or every rank's with ``state_per_rank``."""

    def __init__(self, value: int, per_rank: bool = False):
        self.value = value
        self.state_per_rank = per_rank

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class PerRankCounter(Counter):
    def __init__(self, value: int):
        super().__init__(value, per_rank=True)


def _save_and_load_body():
    rank = get_rank()
    loaded = []

    def part(name, every_rank=False):
        return StatePart(name, lambda: f"{name}@{rank}", lambda state: loaded.append((name, state)),
                         every_rank=every_rank)

    # listed in the order they are put back, RNG last
    state = TrainState([part("meta"), part("optim_wrapper", every_rank=True), part("stream", True),
                        part("rng", every_rank=True)])
    saved = state.state_dict()
    state.load_state_dict({**saved, "stream": None})
    return list(saved), saved, loaded


@pytest.mark.parametrize("world_size", [1, 2])
def test_parts_are_saved_in_the_layout_and_put_back_in_their_order(run_on, world_size):
    results = run_on(world_size)(_save_and_load_body)
    keys, saved, loaded = results[0]
    assert keys == ["meta", "optim_wrapper", "rng", "stream"]  # LAYOUT's order
    ranks = [f"@{r}" for r in range(world_size)]
    assert saved == {"meta": "meta@0", "optim_wrapper": [f"optim_wrapper{r}" for r in ranks],
                     "rng": [f"rng{r}" for r in ranks], "stream": [f"stream{r}" for r in ranks]}
    assert [name for name, _ in loaded] == ["meta", "optim_wrapper", "stream", "rng"]
    assert loaded[2] == ("stream", None)  # a part the checkpoint does not hold


def _hooks_body():
    rank = get_rank()
    hooks = [Counter(10 + rank), Counter(20 + rank), PerRankCounter(30 + rank), object()]
    states = HookStates(hooks, rank, 2)
    saved = states.state_dict()
    for hook in hooks[:3]:
        hook.value = -1
    states.load_state_dict(saved if rank == 0 else {})  # rank 0's copy is what is written
    mine = states.saved(hooks[2], {"hooks": saved}) if rank == 0 else None
    return [key for key, _ in states.keyed()], saved, [h.value for h in hooks[:3]], mine


def test_hook_states_are_keyed_by_class_and_per_rank_where_asked(run_on):
    keyed, saved, values, mine = run_on(2)(_hooks_body)[0]
    assert keyed == ["Counter", "Counter#2", "PerRankCounter", "object"]
    assert saved == {"Counter": {"value": 10}, "Counter#2": {"value": 20},
                     "PerRankCounter": {"per_rank": [{"value": 30}, {"value": 31}]}}
    assert values == [10, 20, 30] and mine == {"value": 30}


def test_per_rank_hook_states_of_another_world_size_start_afresh(caplog):
    hook = PerRankCounter(7)
    states = HookStates([hook], rank=0, world_size=1)
    logger = logging.getLogger("trainrun")
    logger.addHandler(caplog.handler)
    try:
        states.load_state_dict({"PerRankCounter": {"per_rank": [{"value": 1}, {"value": 2}]}})
    finally:
        logger.removeHandler(caplog.handler)
    assert hook.value == 7
    assert "PerRankCounter: the checkpoint holds the states of 2 ranks, this job has 1: its " \
           "state starts afresh" in caplog.text
    assert states.saved(hook, {"hooks": {"PerRankCounter": {"per_rank": [{}, {}]}}}) is None
