"""FlexibleRunner: MMEngine's ``strategy=dict(type='DDPStrategy' | 'FSDPStrategy' |
'DeepSpeedStrategy', ...)`` becomes trainrun's ddp, fsdp or deepspeed strategy, and on 2 gloo
ranks each gives every rank the losses the plain Runner (DDP) gives it."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy
from torch.nn import functional as F
from torch.utils.data import Dataset

from trainrun.compat.mmengine.hooks import Hook
from trainrun.compat.mmengine.model import BaseModel
from trainrun.compat.mmengine.runner import FlexibleRunner, Runner, strategy_section
from trainrun.runner.schema import ConfigError


class Blobs(Dataset):
    def __init__(self, size: int = 48):
        generator = torch.Generator().manual_seed(5)
        self.x = torch.randn(size, 8, generator=generator)
        self.y = (self.x.sum(dim=1) > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]


class Net(BaseModel):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 2)

    def forward(self, inputs, labels, mode="tensor"):
        scores = self.head(self.body(inputs))
        return {"loss": F.cross_entropy(scores, labels)} if mode == "loss" else (scores, labels)


class Losses(Hook):
    def __init__(self):
        self.losses: list[float] = []

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        self.losses.append(outputs["loss"].item())


def _losses(work_dir: str, strategy: dict | None) -> list[float]:
    """This rank's losses over 2 epochs (3 steps each), under FlexibleRunner with ``strategy``
    (None: the plain Runner)."""
    recorder = Losses()
    arguments = dict(
        model={"type": Net}, work_dir=work_dir,
        train_dataloader={"dataset": Blobs(), "batch_size": 8,
                          "collate_fn": {"type": "default_collate"}},
        train_cfg={"by_epoch": True, "max_epochs": 2},
        optim_wrapper={"optimizer": {"type": "AdamW", "lr": 0.01}},
        custom_hooks=[recorder], randomness={"seed": 3})
    if strategy is None:
        runner = Runner(**arguments)
    else:
        runner = FlexibleRunner(**arguments, strategy=strategy, launcher="none")
    runner.train()
    runner.close()
    return recorder.losses


STRATEGIES = {
    "ddp": {"type": "DDPStrategy", "model_wrapper": {"broadcast_buffers": False}},
    "fsdp": {"type": "FSDPStrategy", "model_wrapper": {
        "auto_wrap_policy": partial(size_based_auto_wrap_policy, min_num_params=500)}},
    "zero3": {"type": "DeepSpeedStrategy", "zero_optimization": {"stage": 3}},
}


@pytest.mark.parametrize("name", STRATEGIES)
def test_each_strategy_gives_every_rank_the_runners_losses(run_on, tmp_path: Path, name: str):
    plain = run_on(2)(_losses, str(tmp_path / "plain"), None)
    flexible = run_on(2)(_losses, str(tmp_path / name), STRATEGIES[name])
    assert len(plain[0]) == 6 and plain[0] != plain[1]  # each rank's own batches
    for ours, theirs in zip(flexible, plain, strict=True):
        assert ours == pytest.approx(theirs, rel=1e-6, abs=1e-7)


def test_the_strategies_map_onto_trainruns():
    assert strategy_section(STRATEGIES["fsdp"]) == ({"type": "fsdp", "wrap": {"min_params": 500}},
                                                    None)
    assert strategy_section({"type": "DeepSpeedStrategy", "bf16": {"enabled": True},
                             "zero_optimization": {"stage": 2, "overlap_comm": True}}) == \
        ({"type": "deepspeed", "zero_stage": 2,
          "config": {"zero_optimization": {"overlap_comm": True},
                     "data_types": {"buffer_dtype": "bf16"}}}, "bf16")
    assert strategy_section(None) == ({"type": "ddp"}, None)
    with pytest.raises(ConfigError, match="^strategy.type='ColossalAIStrategy'"):
        strategy_section({"type": "ColossalAIStrategy"})
    with pytest.raises(ConfigError, match="^strategy.model_wrapper.auto_wrap_policy"):
        strategy_section({"type": "FSDPStrategy", "model_wrapper": {"auto_wrap_policy": print}})
