"""MMEngine's learning-rate schedulers, reproduced: the rate of every iteration equals, to the
last bit, what MMEngine 0.10.7's own schedulers give when stepped as its ParamSchedulerHook
steps them (by-iteration ones after every iteration, by-epoch ones after every epoch)."""

from __future__ import annotations

import pytest
import torch

from trainrun.compat.mmengine.param_scheduler import scheduler_factory
from trainrun.runner.schema import ConfigError

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
    "one cycle by iteration": {"type": "OneCycleLR", "eta_max": 0.5, "by_epoch": False},
    "one cycle by epoch": {"type": "OneCycleLR", "eta_max": 0.5, "pct_start": 0.5},
    "one cycle converted to iterations, its total_steps too": {
        "type": "OneCycleLR", "eta_max": 0.5, "total_steps": EPOCHS, "pct_start": 0.25,
        "div_factor": 10.0, "final_div_factor": 100.0, "convert_to_iter_based": True},
    "one cycle in three phases, linear, converted": {
        "type": "OneCycleLR", "eta_max": 0.5, "three_phase": True, "anneal_strategy": "linear",
        "convert_to_iter_based": True},
    "one cycle in three phases, from begin to end": {
        "type": "OneCycleLR", "eta_max": 0.5, "three_phase": True, "by_epoch": False,
        "begin": 4, "end": 27},
    "one cycle longer than the run": {"type": "OneCycleLR", "eta_max": 0.5, "by_epoch": False,
                                      "total_steps": 50},
    "one cycle one step shorter than the run (MMEngine's last step goes past its end)": {
        "type": "OneCycleLR", "eta_max": 0.5, "by_epoch": False, "total_steps": EPOCH * EPOCHS - 1},
    "warmup, then one cycle": [
        {"type": "LinearLR", "start_factor": 0.1, "by_epoch": False, "end": 7},
        {"type": "OneCycleLR", "eta_max": 0.5, "by_epoch": False, "begin": 5}],
    "one cycle, then a cosine from its start (MMEngine's initial_lr)": [
        {"type": "OneCycleLR", "eta_max": 0.5, "by_epoch": False, "end": 15},
        {"type": "CosineAnnealingLR", "eta_min_ratio": 0.1, "begin": 3}],
}


def sgd(lrs: tuple[float, ...]) -> torch.optim.SGD:
    """SGD with a parameter group for each rate (the first is also the default)."""
    return torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)], "lr": lr}
                            for lr in lrs], lr=lrs[0], momentum=0.9)


def mmengine_rates(cfg, lrs=(0.1,)) -> list[list[float]]:
    """Each group's rate at each iteration under MMEngine itself."""
    from mmengine.optim import OptimWrapper
    from mmengine.registry import PARAM_SCHEDULERS

    optimizer = sgd(lrs)
    wrapper = OptimWrapper(optimizer)
    schedulers = []
    for item in cfg if isinstance(cfg, list) else [cfg]:
        item = dict(item)
        item.setdefault("end", EPOCHS if item.get("by_epoch", True) else EPOCH * EPOCHS)
        schedulers.append(PARAM_SCHEDULERS.build(
            item, default_args={"optimizer": wrapper, "epoch_length": EPOCH}))
    rates = []
    for i in range(EPOCH * EPOCHS):
        rates.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        for scheduler in schedulers:
            if not scheduler.by_epoch:
                scheduler.step()
        if (i + 1) % EPOCH == 0:
            for scheduler in schedulers:
                if scheduler.by_epoch:
                    scheduler.step()
    return rates


def our_rates(cfg, lrs=(0.1,)) -> list[list[float]]:
    optimizer = sgd(lrs)
    scheduler = scheduler_factory(cfg, EPOCH, EPOCHS)(optimizer, EPOCH * EPOCHS)
    rates = []
    for _ in range(EPOCH * EPOCHS):
        rates.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("cfg", CASES.values(), ids=CASES.keys())
def test_every_rate_is_mmengines(cfg):
    pytest.importorskip("mmengine", reason="MMEngine (the oracle) comes with the bench extra")
    assert our_rates(cfg) == mmengine_rates(cfg)


def test_one_cycle_takes_an_eta_max_for_each_parameter_group():
    """And, as MMEngine's wrapper adds a group where there are several, one more for it."""
    pytest.importorskip("mmengine", reason="MMEngine (the oracle) comes with the bench extra")
    cfg = [{"type": "OneCycleLR", "eta_max": [0.5, 0.2, 0.3], "by_epoch": False},
           {"type": "CosineAnnealingLR", "eta_min_ratio": 0.5, "by_epoch": False, "begin": 20}]
    rates = our_rates(cfg, lrs=(0.1, 0.01))
    assert rates == mmengine_rates(cfg, lrs=(0.1, 0.01))
    assert rates[0] == pytest.approx([0.5 / 25, 0.2 / 25])  # each group its own eta_max
    short = [{**cfg[0], "eta_max": [0.5, 0.2]}]
    with pytest.raises(ValueError, match="expected 3 values"):
        mmengine_rates(short, lrs=(0.1, 0.01))
    with pytest.raises(ConfigError, match=r"^param_scheduler\[0\]\.eta_max=\[0\.5, 0\.2\]: 2 "
                                          r"values for 2 parameter groups; give one number, or 3"):
        our_rates(short, lrs=(0.1, 0.01))


def refusal(cfg) -> str:
    """Our ConfigError's message for a OneCycleLR config, checked to be one line."""
    with pytest.raises(ConfigError) as error:
        scheduler_factory({"type": "OneCycleLR", **cfg}, EPOCH, EPOCHS)(sgd((0.1,)),
                                                                         EPOCH * EPOCHS)
    assert "\n" not in str(error.value)
    return str(error.value)


@pytest.mark.parametrize(("cfg", "named"), [
    ({"by_epoch": False, "total_steps": EPOCH * EPOCHS - 2}, "total_steps (28) is smaller"),
    ({"total_steps": EPOCHS - 2}, "total_steps (4) is smaller"),  # stepped after each epoch
    ({"by_epoch": False, "end": 20, "pct_start": 0.05}, "pct_start (0.05) with total_steps (20)"
                                                        " leaves phase 1"),
    ({"total_steps": 6.0, "convert_to_iter_based": True}, "total_steps (30.0) must be a positive"),
])
def test_where_mmengine_stops_the_run_the_config_is_refused(cfg, named):
    pytest.importorskip("mmengine", reason="MMEngine (the oracle) comes with the bench extra")
    with pytest.raises((ValueError, ZeroDivisionError)):
        mmengine_rates({"type": "OneCycleLR", "eta_max": 0.5, **cfg})
    assert refusal({"eta_max": 0.5, **cfg}).startswith(f"param_scheduler[0]: OneCycleLR {named}")


@pytest.mark.parametrize(("cfg", "named"), [
    ({}, "param_scheduler[0]: OneCycleLR needs eta_max"),
    ({"eta_max": 0.5, "pct_start": 0.0}, "param_scheduler[0]: OneCycleLR pct_start (0.0)"),
    ({"eta_max": 0.5, "pct_start": 1.0}, "param_scheduler[0]: OneCycleLR pct_start (1.0)"),
    ({"eta_max": 0.5, "pct_start": 1.5}, "param_scheduler[0]: OneCycleLR pct_start (1.5)"),
    ({"eta_max": 0.5, "total_steps": 0}, "param_scheduler[0]: OneCycleLR total_steps (0)"),
    ({"eta_max": 0.5, "anneal_strategy": "exp"},
     "param_scheduler[0]: OneCycleLR anneal_strategy ('exp')"),
    ({"eta_max": 0.5, "div_factor": 0}, "param_scheduler[0]: OneCycleLR div_factor (0)"),
    ({"eta_max": [0.5, 0.2]}, "param_scheduler[0].eta_max=[0.5, 0.2]: 2 values for 1 "),
    ({"eta_max": [0.5, "x"]}, "param_scheduler[0].eta_max=[0.5, 'x']: give positive numbers"),
    ({"eta_max": 0.5, "cycle_momentum": True},
     "param_scheduler[0].cycle_momentum=True: not supported by trainrun.compat.mmengine; "
     "MMEngine 0.10.7's OneCycleLR cycles the learning rate only"),
    ({"max_lr": 0.5}, "param_scheduler[0].max_lr=0.5: not supported"),
    ({"eta_max": 0.5, "steps_per_epoch": 5}, "param_scheduler[0].steps_per_epoch=5"),
])
def test_a_bad_one_cycle_option_is_refused_by_name(cfg, named):
    assert refusal(cfg).startswith(named)


@pytest.mark.parametrize("case", ["warmup then cosine", "warmup, then one cycle"])
def test_a_resumed_scheduler_finds_the_rate_of_its_step(case):
    cfg = CASES[case]
    optimizer = sgd((0.1,))
    scheduler = scheduler_factory(cfg, EPOCH, EPOCHS)(optimizer, EPOCH * EPOCHS)
    for _ in range(11):
        optimizer.step()
        scheduler.step()
    state = scheduler.state_dict()
    assert "rates" not in state
    fresh = sgd((0.1,))
    again = scheduler_factory(cfg, EPOCH, EPOCHS)(fresh, EPOCH * EPOCHS)
    again.load_state_dict(state)
    assert fresh.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] == our_rates(cfg)[11][0]
