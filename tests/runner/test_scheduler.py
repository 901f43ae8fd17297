"""Learning-rate schedules: their values per iteration, resume, and their option checks."""

from __future__ import annotations

import io
import math

import pytest
import torch
from omegaconf import OmegaConf

from trainrun.runner.optim.schedulers import (
    SCHEDULERS,
    build_scheduler,
    check_scheduler,
    lr_factor,
)


def make_optimizer(*lrs: float) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups)


def lrs(cfg, total_iters: int, base_lr: float = 1.0, steps: int | None = None) -> list[float]:
    """The first group's learning rate at each iteration, stepping once per iteration."""
    optimizer = make_optimizer(base_lr)
    scheduler = build_scheduler(optimizer, cfg, total_iters)
    values = []
    for _ in range(total_iters if steps is None else steps):
        values.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return values


def test_scheduler_names():
    assert {"constant", "step", "multistep", "cosine", "linear_warmup"} <= set(SCHEDULERS)


def test_none_is_a_constant_rate():
    assert lrs(None, 5, 0.1) == [0.1] * 5


def test_constant_with_warmup():
    values = lrs({"type": "constant", "warmup_iters": 4, "warmup_start_factor": 0.2}, 6)
    assert values == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0])


def test_step():
    values = lrs({"type": "step", "step_size": 2, "gamma": 0.5}, 6)
    assert values == pytest.approx([1, 1, 0.5, 0.5, 0.25, 0.25])


def test_multistep():
    values = lrs({"type": "multistep", "milestones": [2, 5], "gamma": 0.1}, 6)
    assert values == pytest.approx([1, 1, 0.1, 0.1, 0.1, 0.01])


def test_exponential():
    assert lrs({"type": "exponential", "gamma": 0.5}, 4) == pytest.approx([1, 0.5, 0.25, 0.125])


def test_cosine_decays_to_min_lr_ratio():
    total = 10
    values = lrs({"type": "cosine", "min_lr_ratio": 0.1}, total, 2.0, steps=total + 1)
    expected = [2.0 * (0.1 + 0.9 * (1 + math.cos(math.pi * i / total)) / 2)
                for i in range(total + 1)]
    assert values == pytest.approx(expected)
    assert values[-1] == pytest.approx(0.2)


def test_cosine_after_warmup():
    values = lrs({"type": "cosine", "warmup_iters": 2, "warmup_start_factor": 0.5}, 6, steps=7)
    assert values[:3] == pytest.approx([0.5, 0.75, 1.0])
    assert values[4] == pytest.approx(0.5)  # half way through the 4 decay iterations
    assert values[6] == pytest.approx(0.0)


def test_min_lr_is_absolute_for_every_param_group():
    optimizer = make_optimizer(1.0, 0.1)
    scheduler = build_scheduler(optimizer, {"type": "linear", "min_lr": 0.05}, 4)
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.05, 0.05])


def test_poly():
    values = lrs({"type": "poly", "power": 2.0}, 4, steps=5)
    assert values == pytest.approx([1, 0.5625, 0.25, 0.0625, 0])


def test_linear_warmup_then_constant():
    values = lrs({"type": "linear_warmup", "warmup_iters": 4, "start_factor": 0.0}, 6)
    assert values == pytest.approx([0, 0.25, 0.5, 0.75, 1, 1])


def test_linear_warmup_takes_warmup_start_factor_too():
    cfg = check_scheduler({"type": "linear_warmup", "warmup_iters": 2,
                           "warmup_start_factor": 0.5})
    assert cfg == {"type": "linear_warmup", "warmup_iters": 2, "start_factor": 0.5}


def test_step_with_warmup_multiplies():
    values = lrs({"type": "step", "step_size": 2, "gamma": 0.5, "warmup_iters": 2,
                  "warmup_start_factor": 0.5}, 4)
    assert values == pytest.approx([0.5, 0.75, 0.5, 0.5])


def test_dictconfig_is_accepted():
    cfg = OmegaConf.create({"type": "multistep", "milestones": [1]})
    assert lrs(cfg, 3) == pytest.approx([1, 0.1, 0.1])


def test_defaults_are_filled():
    assert check_scheduler({"type": "cosine"}) == {
        "type": "cosine", "min_lr_ratio": 0.0, "min_lr": None, "warmup_iters": 0,
        "warmup_start_factor": 0.1}
    assert check_scheduler({"type": "step", "step_size": 3})["gamma"] == 0.1
    assert check_scheduler(None) is None


@pytest.mark.parametrize("optimizer_first", [True, False])
def test_resume_continues_the_same_rates(optimizer_first):
    cfg = {"type": "cosine", "warmup_iters": 3}
    straight = lrs(cfg, 12)
    optimizer = make_optimizer(1.0)
    scheduler = build_scheduler(optimizer, cfg, 12)
    for _ in range(5):
        optimizer.step()
        scheduler.step()
    buffer = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    resumed_optimizer = make_optimizer(1.0)
    if optimizer_first:  # building the scheduler resets the rate; loading it restores it
        resumed_optimizer.load_state_dict(state["optimizer"])
    resumed = build_scheduler(resumed_optimizer, cfg, 12)
    if not optimizer_first:
        resumed_optimizer.load_state_dict(state["optimizer"])
    resumed.load_state_dict(state["scheduler"])
    values = []
    for _ in range(7):
        values.append(resumed_optimizer.param_groups[0]["lr"])
        resumed_optimizer.step()
        resumed.step()
    assert values == straight[5:]  # exactly


def test_lr_factor_is_a_pure_function_of_the_step():
    factor = lr_factor(check_scheduler({"type": "step", "step_size": 3}), 10)
    assert [factor(s) for s in (5, 0, 3, 5)] == pytest.approx([0.1, 1, 0.1, 0.1])


BAD = [
    ({"type": "cosin"}, "scheduler.type: got 'cosin', expected one of",
     "did you mean 'cosine'?"),
    ({"gamma": 0.1}, "scheduler.type: missing", ""),
    ("cosine", "scheduler: got 'cosine', expected null or a mapping", ""),
    ({"type": "step"}, "scheduler.step_size: missing, expected an int >= 1", ""),
    ({"type": "step", "step_size": 0}, "scheduler.step_size: got 0, expected an int >= 1", ""),
    ({"type": "step", "step_size": 2, "gama": 0.5}, "unknown key 'scheduler.gama'",
     "did you mean 'scheduler.gamma'?"),
    ({"type": "step", "step_size": 2, "gamma": -1}, "scheduler.gamma: got -1", "> 0"),
    ({"type": "multistep", "milestones": []}, "scheduler.milestones: got []", "increasing"),
    ({"type": "multistep", "milestones": [3, 3]}, "scheduler.milestones: got [3, 3]", ""),
    ({"type": "cosine", "min_lr_ratio": 2}, "scheduler.min_lr_ratio: got 2",
     "expected null or a number in [0, 1]"),
    ({"type": "cosine", "min_lr": -1}, "scheduler.min_lr: got -1", ""),
    ({"type": "cosine", "min_lr": 0.1, "min_lr_ratio": 0.1}, "scheduler: got both min_lr", ""),
    ({"type": "cosine", "warmup_iters": -1}, "scheduler.warmup_iters: got -1", ""),
    ({"type": "constant", "warmup_start_factor": 1.5}, "scheduler.warmup_start_factor: got 1.5",
     ""),
    ({"type": "constant", "warmup_iters": True}, "scheduler.warmup_iters: got true", ""),
    ({"type": "linear_warmup"}, "scheduler.warmup_iters: missing", ""),
    ({"type": "linear_warmup", "warmup_iters": 2, "start_factor": 0.1,
      "warmup_start_factor": 0.2}, "scheduler: got both warmup_start_factor and start_factor", ""),
    ({"type": "linear_warmup", "warmup_iters": 2, "min_lr": 0.1},
     "unknown key 'scheduler.min_lr' for scheduler 'linear_warmup'", "it takes warmup_iters"),
]


@pytest.mark.parametrize("cfg, start, contains", BAD, ids=[str(b[0]) for b in BAD])
def test_bad_options_are_named_in_one_line(cfg, start, contains):
    with pytest.raises(ValueError) as caught:
        build_scheduler(make_optimizer(1.0), cfg, 10)
    message = str(caught.value)
    assert message.startswith(start) and contains in message and "\n" not in message


def test_warmup_must_end_before_a_decay_does():
    with pytest.raises(ValueError, match=r"^scheduler.warmup_iters: got 10, expected fewer than "
                                         r"the total iterations \(10\)"):
        build_scheduler(make_optimizer(1.0), {"type": "cosine", "warmup_iters": 10}, 10)
    with pytest.raises(ValueError, match="expected at most the total iterations"):
        build_scheduler(make_optimizer(1.0), {"type": "linear_warmup", "warmup_iters": 11}, 10)


def test_min_lr_above_the_learning_rate_is_an_error():
    with pytest.raises(ValueError, match=r"^scheduler.min_lr: got 2, expected at most"):
        build_scheduler(make_optimizer(1.0), {"type": "cosine", "min_lr": 2}, 10)


@pytest.mark.parametrize("total", [0, -1, 2.5, True])
def test_total_iters_must_be_positive(total):
    with pytest.raises(ValueError, match="^total_iters: got"):
        build_scheduler(make_optimizer(1.0), None, total)
