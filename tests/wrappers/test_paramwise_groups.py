"""optim.paramwise under every strategy on 2 gloo ranks: the optimiser's groups carry the
rates the rules give (before and after a resume, under a schedule), a group with lr 0 really
leaves its parameter alone, and a run crashed mid-way then resumed logs the losses of one that
never stopped, bit for bit."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.records import losses
from tests.runner.toy import CrashAfter, Killed
from trainrun.runner.runner import Runner

LR, DECAY = 0.01, 0.1
PARAMWISE = {"bias_lr_mult": 2.0, "bias_decay_mult": 0.0, "norm_decay_mult": 0.0,
             "custom_keys": {"head": {"lr_mult": 0.5, "decay_mult": 3.0},
                             "embed.weight": {"lr_mult": 0.0}}}
# (name, lr, weight decay, parameters) of each group, in the order the optimiser holds them
EXPECTED = [("'embed.weight'", 0.0, DECAY, ["embed.weight"]),
            ("bias", LR * 2.0, 0.0, ["embed.bias"]),
            ("norm", LR, 0.0, ["norm.weight", "norm.bias"]),
            ("'head'", LR * 0.5, DECAY * 3.0, ["head.1.weight", "head.1.bias"])]

STRATEGIES = {
    "ddp": "ddp",
    "fsdp": {"type": "fsdp", "wrap": {"classes": ["LayerNorm"]}},  # the norm its own unit
    "zero2": {"type": "deepspeed", "zero_stage": 2},
    "zero3": {"type": "deepspeed", "zero_stage": 3},
}


def _runner(work_dir: str, strategy: Any, **more: Any) -> Runner:
    return Runner(
        model={"type": "tests.runner.toy.NormToy"}, work_dir=work_dir,
        train_dataloader={"type": "tests.runner.toy.ToyRegression", "size": 32,
                          "batch_size": 4},
        optim={"type": "AdamW", "lr": LR, "weight_decay": DECAY, "paramwise": PARAMWISE},
        scheduler={"type": "cosine", "warmup_iters": 3}, strategy=strategy,
        schedule={"max_iters": 12}, randomness={"seed": 7},
        logging={"interval": 1, "backends": ["jsonl"]}, checkpoint={"interval": 4}, **more)


def _groups(runner: Runner) -> list[tuple[Any, ...]]:
    return [(g["name"], g["initial_lr"], g["lr"], g["weight_decay"])
            for g in runner.optimizer.param_groups]


class Record:
    """A hook keeping the optimiser's groups as training begins (after a resume loaded)."""

    priority = 99

    def __init__(self):
        self.groups: list[tuple[Any, ...]] = []

    def __getattr__(self, name):
        return lambda *args: None

    def before_run(self, runner):
        self.groups = _groups(runner)


def _weights(runner: Runner) -> dict[str, torch.Tensor]:
    """A copy of the whole model's weights (a collective under fsdp and ZeRO-3)."""
    return {k: v.clone() for k, v in runner.strategy.model_state_dict(runner.model).items()}



def _body(root: str, strategy: Any) -> dict[str, Any]:
    """On every rank: a straight run, and one that crashes after step 6 and resumes."""
    with _runner(f"{root}/straight", strategy) as run:
        built = _groups(run)
        before = _weights(run)
        run.train()
        after = _weights(run)
        straight_end = _groups(run)
    with _runner(f"{root}/crashed", strategy, hooks=[CrashAfter(6)]) as run, \
            pytest.raises(Killed):
        run.train()
    record = Record()
    with _runner(f"{root}/crashed", strategy, resume=True, hooks=[record]) as run:
        run.train()
        resumed_end = _groups(run)
    return {"built": built, "frozen": torch.equal(before["embed.weight"], after["embed.weight"]),
            "moved": not torch.equal(before["head.1.weight"], after["head.1.weight"]),
            "straight_end": straight_end, "resumed_start": record.groups,
            "resumed_end": resumed_end}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_groups_train_and_resume_exactly(run_on, tmp_path, name):
    if name.startswith("zero"):
        pytest.importorskip("deepspeed")
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(
            Path(__file__).resolve().parents[2] / ".venv" / "torch_extensions"))
    results = run_on(2)(_body, str(tmp_path), STRATEGIES[name])
    assert results[0] == results[1]  # every rank holds the same groups
    result = results[0]
    # built: each group at its rate times the warmup's first factor (0.1), from rates exact
    assert [(n, initial, decay) for n, initial, _, decay in result["built"]] == \
        [(n, lr, decay) for n, lr, decay, _ in EXPECTED]
    assert [lr for *_, lr, _ in result["built"]] == \
        pytest.approx([lr * 0.1 for _, lr, _, _ in EXPECTED], rel=1e-12)
    assert result["frozen"] and result["moved"]  # lr 0 left its parameter, the others moved
    # the resumed run starts at step 4's rates (the checkpoint's) and ends where the
    # straight run ended
    assert result["resumed_start"] != result["built"]
    assert result["resumed_end"] == result["straight_end"]
    straight, resumed = losses(f"{tmp_path}/straight"), losses(f"{tmp_path}/crashed")
    log = (tmp_path / "crashed" / "train.log").read_text()
    assert "resumed from" in log and "step 4\n" in log, log
    assert sorted(resumed) == list(range(1, 13)) and resumed == straight  # bit for bit
    assert "parameter groups (optim.paramwise):\n  'embed.weight': lr 0, weight_decay 0.1; " \
        "1 tensor, 32 elements\n" in log


def _separate_body(root: str) -> dict[str, Any]:
    """separate_ddp, one optimiser per submodule: shared rules for ``a``, ``b``'s own."""
    def runner(name: str, **more: Any) -> Runner:
        return Runner(
            model={"type": "tests.runner.toy.TwoNets"}, work_dir=f"{root}/{name}",
            train_dataloader={"type": "tests.runner.toy.ToyRegression", "size": 32,
                              "batch_size": 4},
            optim={"type": "SGD", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.01,
                   "paramwise": {"bias_lr_mult": 2.0, "bias_decay_mult": 0.0},
                   "per_module": {"a": None, "b": {"paramwise": {
                       "custom_keys": {"b.weight": {"lr_mult": 0.5}}}}}},
            strategy="separate_ddp", schedule={"max_iters": 12}, randomness={"seed": 7},
            logging={"interval": 1, "backends": ["jsonl"]}, checkpoint={"interval": 4},
            **more)

    def groups(run: Runner) -> dict[str, list[tuple[Any, ...]]]:
        return {name: [(g["name"], g["lr"], g["weight_decay"]) for g in opt.param_groups]
                for name, opt in run.optimizer.items()}

    with runner("straight") as run:
        built = groups(run)
        run.train()
    with runner("crashed", hooks=[CrashAfter(6)]) as run, pytest.raises(Killed):
        run.train()
    with runner("crashed", resume=True) as run:
        run.train()
        resumed = groups(run)
    return {"built": built, "resumed": resumed}


def test_separate_optimisers_group_each_submodule_and_resume_exactly(run_on, tmp_path):
    results = run_on(2)(_separate_body, str(tmp_path))
    assert results[0] == results[1]
    assert results[0]["built"] == results[0]["resumed"] == {
        "a": [("default", 0.1, 0.01), ("bias", 0.2, 0.0)],
        "b": [("default", 0.1, 0.01), ("'b.weight'", 0.05, 0.01)]}
    straight, resumed = losses(f"{tmp_path}/straight"), losses(f"{tmp_path}/crashed")
    assert sorted(resumed) == list(range(1, 13)) and resumed == straight  # bit for bit
