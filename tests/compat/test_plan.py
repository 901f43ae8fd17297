"""The dry run of an MMEngine config: ``trainrun plan CONFIG.py`` checks it as the compat Runner
would (what it refuses exits 2 in one line) and prints what that Runner would run, without
joining a process group or writing anything; ``trainrun train CONFIG.py`` says how to train
it instead."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainrun import registry
from trainrun.cli.train import main as train_main
from trainrun.exits import EXIT_OK, EXIT_USAGE

PARTS = '''
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from trainrun.compat.mmengine.evaluator import BaseMetric
from trainrun.compat.mmengine.model import BaseModel
from trainrun.compat.mmengine.registry import DATASETS, METRICS, MODELS


@DATASETS.register_module()
class PlanBlobs(Dataset):
    def __init__(self, size=64, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 8, generator=g)
        self.y = torch.randint(0, 2, (size,), generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return dict(inputs=self.x[i], labels=self.y[i])


@MODELS.register_module()
class PlanTiny(BaseModel):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 2)

    def forward(self, inputs, labels, mode="tensor"):
        out = self.fc(inputs)
        return dict(loss=F.cross_entropy(out, labels)) if mode == "loss" else (out, labels)


@METRICS.register_module()
class PlanAccuracy(BaseMetric):
    def process(self, data_batch, data_samples):
        out, labels = data_samples
        self.results.append(((out.argmax(1) == labels).sum().item(), len(labels)))

    def compute_metrics(self, results):
        return dict(accuracy=sum(r[0] for r in results) / sum(r[1] for r in results))
'''

CONFIG = '''
custom_imports = dict(imports=["plan_parts"], allow_failed_imports=False)
model = dict(type="PlanTiny")
work_dir = "work_dirs/tiny"
train_dataloader = dict(batch_size=8, dataset=dict(type="PlanBlobs", size=64, seed=0),
                        sampler=dict(type="DefaultSampler", shuffle=True))
val_dataloader = dict(batch_size=8, dataset=dict(type="PlanBlobs", size=32, seed=1),
                      sampler=dict(type="DefaultSampler", shuffle=False))
val_evaluator = dict(type="PlanAccuracy")
val_cfg = dict()
train_cfg = dict(by_epoch=True, max_epochs=3, val_interval=1)
optim_wrapper = dict(optimizer=dict(type="SGD", lr=0.1, momentum=0.9))
param_scheduler = dict(type="MultiStepLR", by_epoch=True, milestones=[2], gamma=0.1)
default_hooks = dict(checkpoint=dict(type="CheckpointHook", interval=1))
randomness = dict(seed=42)
'''


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An MMEngine Python config and the module it imports, in the working directory; the
    names that module registers in trainrun's shared registries are taken out afterwards
    (tests/runner/test_reference.py reads every registered data set's options)."""
    (tmp_path / "plan_parts.py").write_text(PARTS, encoding="utf-8")
    path = tmp_path / "mm_config.py"
    path.write_text(CONFIG, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield path
    for table, name in ((registry.DATASETS, "PlanBlobs"), (registry.MODELS, "PlanTiny"),
                        (registry.METRICS, "PlanAccuracy")):
        if name in table:
            del table[name]
    sys.modules.pop("plan_parts", None)


def listing(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*")
                  if "__pycache__" not in p.parts)


def test_the_plan_says_what_the_compat_runner_would_run_and_writes_nothing(config, capsys):
    before = listing(config.parent)
    assert train_main([str(config), "--dry-run"], command_name="plan") == EXIT_OK
    out = capsys.readouterr().out
    assert out.startswith(f"plan of {config} (an MMEngine config; nothing started or written)")
    out = "\n".join(" ".join(line.split()) for line in out.splitlines())  # columns aside
    for line in ("model PlanTiny",
                 "optimiser type='SGD', lr=0.1, momentum=0.9",
                 "schedule max_epochs=3, val_interval=1, val_begin=1 (8 iterations an epoch",
                 "lr schedule MultiStepLR(by_epoch=True, milestones=[2], gamma=0.1)",
                 "train data PlanBlobs, 64 samples, batch 8 per process, DefaultSampler "
                 "shuffled",
                 "val metrics PlanAccuracy",
                 "checkpoint interval=1",
                 "start fresh",
                 "work_dir work_dirs/tiny (MMEngine's layout"):
        assert f"\n{line}" in out, line
    assert listing(config.parent) == before  # no work_dirs, no log, no checkpoint


def test_the_command_lines_options_apply_as_mmengines_tools_apply_them(config, capsys):
    assert train_main([str(config), "--dry-run", "--work-dir", "elsewhere", "--cfg-options",
                       "optim_wrapper.optimizer.lr=0.5", "randomness.diff_rank_seed=true",
                       "train_cfg.max_epochs=5"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "lr=0.5" in out and "diff_rank_seed=True" in out and "max_epochs=5" in out
    assert "work_dir elsewhere (MMEngine's layout" in " ".join(out.split())


@pytest.mark.parametrize(("argv", "message"), [
    (["--dry-run", "--cfg-options", "auto_scale_lr.base_batch_size=16"],
     "error: auto_scale_lr="),
    (["--dry-run", "--cfg-options", "param_scheduler.type=CosineRestartLR"],
     "error: param_scheduler[0].type='CosineRestartLR'"),
    (["--dry-run", "--amp"], "error: --amp: takes a trainrun config, not an MMEngine one"),
    ([], "error: {config}: an MMEngine config; `trainrun plan {config}` checks it"),
])
def test_what_the_runner_would_refuse_exits_2_in_one_line(config, capsys, argv, message):
    assert train_main([str(config), *argv]) == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert err.startswith(message.format(config=config)) and "\n" not in err, err
