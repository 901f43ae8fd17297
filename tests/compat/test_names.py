"""MMEngine's import paths: every name issue 24's table lists imports from
``trainrun.compat.mmengine``, and the names given as classes in a config work as their
strings do."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import trainrun.dist
from trainrun.compat.mmengine.hooks import CheckpointHook, EMAHook
from trainrun.compat.mmengine.model import BaseModel
from trainrun.compat.mmengine.optim import AmpOptimWrapper, MultiStepLR
from trainrun.compat.mmengine.param_scheduler import SCHEDULES
from trainrun.compat.mmengine.runner import Runner
from trainrun.runner.hooks.ema import EMAHook as TrainrunEMA
from trainrun.runner.schema import ConfigError

TABLE = {
    "runner": ["Runner", "FlexibleRunner"],
    "model": ["BaseModel", "BaseDataPreprocessor", "MMDistributedDataParallel",
              "MMFullyShardedDataParallel"],
    "evaluator": ["BaseMetric", "Evaluator"],
    "optim": ["OptimWrapper", "AmpOptimWrapper", *SCHEDULES],
    "hooks": ["Hook", "CheckpointHook", "LoggerHook", "IterTimerHook", "ParamSchedulerHook",
              "DistSamplerSeedHook", "RuntimeInfoHook", "EMAHook"],
    "dataset": ["DefaultSampler", "InfiniteSampler", "default_collate", "pseudo_collate"],
    "config": ["Config", "ConfigDict", "DictAction"],
    "registry": ["MODELS", "DATASETS", "METRICS", "HOOKS", "OPTIMIZERS", "PARAM_SCHEDULERS",
                 "RUNNERS", "FUNCTIONS"],
}


@pytest.mark.parametrize("module", TABLE)
def test_every_name_of_the_table_imports(module: str):
    loaded = importlib.import_module(f"trainrun.compat.mmengine.{module}")
    assert [name for name in TABLE[module] if not hasattr(loaded, name)] == []


def test_dist_is_trainruns_own():
    from trainrun.compat.mmengine import dist

    assert dist.all_reduce_dict is trainrun.dist.all_reduce_dict
    assert dist.get_dist_info() == (0, 1)


class Tiny(BaseModel):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def forward(self, inputs, labels, mode="tensor"):
        scores = self.layer(inputs)
        return {"loss": F.cross_entropy(scores, labels)} if mode == "loss" else scores


def tiny_runner(work_dir: Path, **changes) -> Runner:
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    return Runner(**{
        "model": Tiny(), "work_dir": str(work_dir),
        "train_dataloader": {"dataset": data, "batch_size": 4,
                             "collate_fn": {"type": "default_collate"}},
        "train_cfg": {"by_epoch": True, "max_epochs": 2},
        "optim_wrapper": {"type": AmpOptimWrapper, "dtype": "bfloat16",
                          "optimizer": {"type": torch.optim.SGD, "lr": 0.1}},
        "param_scheduler": {"type": MultiStepLR, "milestones": [1]},
        "default_hooks": {"checkpoint": {"type": CheckpointHook, "interval": 2}},
        "custom_hooks": [{"type": "EMAHook", "momentum": 0.01}], **changes})


def test_names_given_as_classes_work_as_their_strings(tmp_path: Path):
    runner = tiny_runner(tmp_path / "run")
    try:
        assert runner.precision == "bf16"
        assert type(runner.optimizer).__name__ == "SGD"
        assert [type(h) for h in runner.hooks if isinstance(h, TrainrunEMA)] == [EMAHook]
        runner.train()
        assert runner.optimizer.param_groups[0]["lr"] == pytest.approx(0.01)
    finally:
        runner.close()


def test_the_names_are_not_built_by_themselves():
    with pytest.raises(TypeError, match="param_scheduler=dict"):
        MultiStepLR(None, milestones=[1])
    with pytest.raises(TypeError, match="default_hooks"):
        CheckpointHook(interval=1)
    with pytest.raises(ConfigError, match="^EMAHook.begin_iter=10"):
        EMAHook(begin_iter=10)
