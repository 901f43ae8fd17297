"""MMEngine's learning-rate schedulers, reproduced: the rate of every iteration equals, to the
last bit, what MMEngine 0.10.7's own schedulers give when stepped as its ParamSchedulerHook
steps them (by-iteration ones after every iteration, by-epoch ones after every epoch)."""

from __future__ import annotations

import pytest
import torch

from trainrun.compat.mmengine.param_scheduler import scheduler_factory

# MMEngine's own schedulers warn about their step order outside its runner, and its import
# about torch.jit: neither concerns the rates
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

EPOCH, EPOCHS = 5, 6  # iterations per epoch, epochs

CASES = {
    "multistep by epoch": {"type": "MultiStepLR", "milestones": [2, 4], "gamma": 0.5},
    "step by iteration": {"type": "StepLR", "by_epoch": False, "step_size": 7, "gamma": 0.3},
    "exponential": {"type": "ExponentialLR", "gamma": 0.9},
    "linear alone, by epoch (MMEngine's flexible-runner example)": {"type": "LinearLR"},
    "warmup then cosine": [
        {"type": "LinearLR", "start_factor": 0.01, "by_epoch": False, "begin": 0, "end": 8},
        {"type": "CosineAnnealingLR", "T_max": 5, "eta_min": 1e-4, "begin": 1, "end": 6}],
    "cosine converted to iterations": {"type": "CosineAnnealingLR", "T_max": EPOCHS,
                                       "convert_to_iter_based": True},
    "poly with a constant start": [
        {"type": "ConstantLR", "factor": 0.5, "by_epoch": False, "end": 4},
        {"type": "PolyLR", "power": 2.0, "eta_min": 1e-3, "by_epoch": False}],
}


def mmengine_rates(cfg) -> list[float]:
    """The rate of each iteration under MMEngine itself."""
    from mmengine.optim import OptimWrapper
    from mmengine.registry import PARAM_SCHEDULERS

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    wrapper = OptimWrapper(optimizer)
    schedulers = []
    for item in cfg if isinstance(cfg, list) else [cfg]:
        item = dict(item)
        item.setdefault("end", EPOCHS if item.get("by_epoch", True) else EPOCH * EPOCHS)
        schedulers.append(PARAM_SCHEDULERS.build(
            item, default_args={"optimizer": wrapper, "epoch_length": EPOCH}))
    rates = []
    for i in range(EPOCH * EPOCHS):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        for scheduler in schedulers:
            if not scheduler.by_epoch:
                scheduler.step()
        if (i + 1) % EPOCH == 0:
            for scheduler in schedulers:
                if scheduler.by_epoch:
                    scheduler.step()
    return rates


def our_rates(cfg) -> list[float]:
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    scheduler = scheduler_factory(cfg, EPOCH, EPOCHS)(optimizer, EPOCH * EPOCHS)
    rates = []
    for _ in range(EPOCH * EPOCHS):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("cfg", CASES.values(), ids=CASES.keys())
def test_every_rate_is_mmengines(cfg):
    pytest.importorskip("mmengine", reason="MMEngine (the oracle) comes with the bench extra")
    assert our_rates(cfg) == mmengine_rates(cfg)


def test_a_resumed_scheduler_finds_the_rate_of_its_step():
    cfg = CASES["warmup then cosine"]
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    scheduler = scheduler_factory(cfg, EPOCH, EPOCHS)(optimizer, EPOCH * EPOCHS)
    for _ in range(11):
        optimizer.step()
        scheduler.step()
    state = scheduler.state_dict()
    assert "rates" not in state
    fresh = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    again = scheduler_factory(cfg, EPOCH, EPOCHS)(fresh, EPOCH * EPOCHS)
    again.load_state_dict(state)
    assert fresh.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] == our_rates(cfg)[11]
