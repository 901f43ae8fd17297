"""The compat Runner: MMEngine's arguments, refused by name where trainrun cannot honour them;
``from_cfg`` with an MMEngine Python config; and trainrun's exact resume inside an epoch, with
MMEngine's loaders (no generator of their own) and a model that draws random numbers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from tests.cli import run
from trainrun.compat.mmengine.config import Config
from trainrun.compat.mmengine.dataset import DefaultSampler
from trainrun.compat.mmengine.model import BaseModel
from trainrun.compat.mmengine.param_scheduler import scheduler_factory
from trainrun.compat.mmengine.runner import FlexibleRunner, Runner, loop_section, optim_section
from trainrun.dist.launch import free_port
from trainrun.runner.hooks import LoggerHook
from trainrun.runner.schema import ConfigError


class CompatPoints(Dataset):
    """40 points of 6 features in 3 classes, as dicts."""

    def __init__(self, size: int = 40):
        generator = torch.Generator().manual_seed(3)
        self.x = torch.randn(size, 6, generator=generator)
        self.y = (self.x[:, 0] > 0).long() + (self.x[:, 1] > 0.5).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"inputs": self.x[index], "labels": self.y[index]}


class DropoutNet(BaseModel):
    """Draws from the global generator every step (dropout): a resume that restored the wrong
    random state shows in the losses."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))

    def forward(self, inputs, labels, mode="tensor"):
        scores = self.net(inputs)
        return {"loss": F.cross_entropy(scores, labels)} if mode == "loss" else (scores, labels)


def arguments(work_dir: Path, **changes) -> dict:
    """An iteration-based MMEngine run: 16 iterations of 5 batches an epoch, a checkpoint every
    4 iterations, every iteration logged."""
    return {
        "model": {"type": DropoutNet}, "work_dir": str(work_dir),
        "train_dataloader": {"dataset": {"type": CompatPoints}, "batch_size": 8,
                             "sampler": {"type": "DefaultSampler", "shuffle": True},
                             "collate_fn": {"type": "default_collate"}},
        "train_cfg": {"type": "IterBasedTrainLoop", "max_iters": 16},
        "optim_wrapper": {"optimizer": {"type": "SGD", "lr": 0.1, "momentum": 0.9}},
        "param_scheduler": {"type": "MultiStepLR", "by_epoch": False, "milestones": [10]},
        "default_hooks": {"checkpoint": {"type": "CheckpointHook", "interval": 4,
                                         "by_epoch": False},
                          "logger": {"type": "LoggerHook", "interval": 1}},
        "randomness": {"seed": 7}, **changes}


def train_losses(**kwargs) -> dict[int, float]:
    runner = Runner(**kwargs)
    runner.train()
    runner.close()
    lines = (Path(kwargs["work_dir"]) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def test_a_run_resumed_inside_an_epoch_gives_the_losses_of_the_unbroken_run(tmp_path: Path):
    straight = train_losses(**arguments(tmp_path / "straight"))
    assert sorted(straight) == list(range(1, 17))
    checkpoint = tmp_path / "straight" / "iter_12.pth"  # MMEngine's layout
    resumed = train_losses(**arguments(tmp_path / "resumed", resume=True,
                                       load_from=str(checkpoint)))
    after = {step: loss for step, loss in resumed.items() if step > 12}
    assert sorted(after) == [13, 14, 15, 16]  # iteration 13 is inside the third epoch
    assert after == {step: straight[step] for step in after}


def test_a_one_cycle_run_trains_at_the_rates_of_its_schedule(tmp_path: Path):
    """The rates (MMEngine's, as tests/compat/test_param_scheduler.py checks) are the
    run's, resumed inside the cycle too. A step's line logs the rate its scheduler step set,
    the next iteration's (the last rate stays)."""
    cycle = {"type": "OneCycleLR", "eta_max": 0.5, "by_epoch": False, "three_phase": True}
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    rates = scheduler_factory(cycle, None, None)(optimizer, 16).rates[0]

    def logged(work_dir: Path, **changes) -> dict[int, float]:
        runner = Runner(**arguments(work_dir, param_scheduler=cycle, **changes))
        runner.train()
        runner.close()
        lines = (work_dir / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["lr"] for r in map(json.loads, lines) if "loss" in r}

    straight = logged(tmp_path / "straight")
    assert straight == {step: rates[min(step, 15)] for step in range(1, 17)}
    resumed = logged(tmp_path / "resumed", resume=True,
                     load_from=str(tmp_path / "straight" / "iter_8.pth"))
    assert {step: lr for step, lr in resumed.items() if step > 8} == \
        {step: lr for step, lr in straight.items() if step > 8}


def test_from_cfg_trains_from_an_mmengine_python_config(tmp_path: Path):
    config = tmp_path / "config.py"
    config.write_text(
        "model = dict(type='tests.compat.test_runner.DropoutNet')\n"
        f"work_dir = {str(tmp_path / 'run')!r}\n"
        "train_dataloader = dict(dataset=dict(type='tests.compat.test_runner.CompatPoints'),\n"
        "                        batch_size=8,\n"
        "                        sampler=dict(type='DefaultSampler', shuffle=True),\n"
        "                        collate_fn=dict(type='default_collate'))\n"
        "train_cfg = dict(by_epoch=True, max_epochs=2)\n"
        "optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.1))\n"
        "randomness = dict(seed=1)\n")
    runner = Runner.from_cfg(Config.fromfile(config))
    runner.train()
    runner.close()
    newest = tmp_path / "run" / "epoch_2.pth"  # MMEngine's layout: in the work directory
    assert newest.is_file()
    assert (tmp_path / "run" / "last_checkpoint").read_text() == str(newest.resolve())


@pytest.mark.parametrize(("change", "named"), [
    ({"auto_scale_lr": {"enable": True, "base_batch_size": 16}}, "auto_scale_lr"),
    ({"optim_wrapper": {"optimizer": {"type": "SGD", "lr": 0.1},
                        "clip_grad": {"type": "range", "clip_value": 1}}},
     "optim_wrapper.clip_grad.type='range'"),
    ({"optim_wrapper": {"optimizer": {"type": "SGD", "lr": 0.1},
                        "clip_grad": {"type": "value", "max_norm": 1}}},
     "optim_wrapper.clip_grad.max_norm=1"),
    ({"optim_wrapper": {"optimizer": {"type": "SGD", "lr": 0.1},
                        "clip_grad": {"type": "value"}}},
     "optim_wrapper.clip_grad.clip_value: missing"),
    ({"optim_wrapper": {"optimizer": {"type": "SGD", "lr": 0.1},
                        "clip_grad": {"max_norm": 1, "clip_value": 1}}},
     "optim_wrapper.clip_grad.clip_value=1"),
    ({"optim_wrapper": {"type": "ApexOptimWrapper", "optimizer": {"type": "SGD", "lr": 0.1}}},
     "optim_wrapper.type"),
    ({"param_scheduler": {"type": "CosineRestartLR", "periods": [4]}},
     "param_scheduler[0].type"),
    ({"param_scheduler": {"type": "OneCycleLR", "eta_max": 0.1, "cycle_momentum": True}},
     "param_scheduler[0].cycle_momentum"),
    ({"param_scheduler": {"type": "OneCycleLR", "eta_max": 0.1, "by_epoch": False,
                          "total_steps": 2}}, "param_scheduler[0]: OneCycleLR total_steps (2)"),
    ({"param_scheduler": [{"type": "LinearLR", "by_epoch": False, "end": 4},
                          {"type": "MultiStepLR", "by_epoch": False, "milestonez": [8]}]},
     "param_scheduler[1]: MultiStepLR"),
    ({"default_hooks": {"visualization": {"type": "VisualizationHook"}}},
     "default_hooks.visualization"),
    ({"default_hooks": {"checkpoint": {"type": "CheckpointHook", "out_dir": "/x"}}},
     "default_hooks.checkpoint.out_dir"),
    ({"env_cfg": {"dist_cfg": {"backend": "gloo", "init_methd": "env://"}}},
     "env_cfg.dist_cfg.init_methd"),
    ({"env_cfg": {"mp_cfg": {"mp_start_methd": "fork"}}}, "env_cfg.mp_cfg.mp_start_methd"),
    ({"visualizer": {"type": "Visualizer"}}, "visualizer"),
    ({"log_processor": {"window_size": 10, "custom_cfg": [{"data_src": "loss",
                                                           "window_size": "global"}]}},
     "log_processor.custom_cfg"),
    ({"log_processor": {"num_digits": 6}}, "log_processor.num_digits"),
    ({"log_processor": {"log_with_hierarchy": True}}, "log_processor.log_with_hierarchy"),
    ({"log_processor": {"mean_pattern": r".*loss.*"}}, "log_processor.mean_pattern"),
    ({"log_processor": {"type": "MyLogProcessor"}}, "log_processor.type"),
    ({"log_processor": {"window_size": 0}}, "log_processor.window_size: got 0"),
    ({"log_processor": {"window_size": "global"}}, "log_processor.window_size: got 'global'"),
    ({"log_processor": {"by_epoch": "yes"}}, "log_processor.by_epoch: got 'yes'"),
    ({"log_processor": "LogProcessor"}, "log_processor"),
    ({"val_cfg": {}}, "val_dataloader, val_cfg and val_evaluator"),
])
def test_what_trainrun_cannot_honour_is_refused_by_name(tmp_path: Path, change: dict,
                                                        named: str):
    with pytest.raises(ConfigError) as refusal:
        Runner(**arguments(tmp_path / "run", **change))
    assert str(refusal.value).startswith(named), str(refusal.value)
    assert "\n" not in str(refusal.value)
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_env_cfg_keys_mmengine_ignores_are_said_once_and_ignored(tmp_path: Path, capfd):
    """MMEngine's runner tutorial writes ``env_cfg=dict(cudnn_benchmark=False,
    backend='nccl', mp_cfg=dict(mp_start_method='fork'))``: MMEngine reads no top-level
    ``backend`` (nor a misspelt key) and goes on, and so does trainrun, with one warning each;
    ``resource_limit`` raises the soft limit of open files, as MMEngine's does."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = soft + 1 if hard == resource.RLIM_INFINITY or soft < hard else soft
    env_cfg = {"cudnn_benchmark": False, "backend": "nccl", "cudnn_determinstic": True,
               "mp_cfg": {"mp_start_method": "fork"}, "resource_limit": wanted}
    try:
        runner = Runner(**arguments(tmp_path / "run", env_cfg=env_cfg))
        runner.close()
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == wanted
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    warnings = [line.split("WARNING ", 1)[1] for line in capfd.readouterr().err.splitlines()
                if "WARNING env_cfg." in line]
    assert warnings == [
        "env_cfg.backend='nccl' is ignored, as MMEngine ignores it (it reads cudnn_benchmark, "
        "mp_cfg, dist_cfg, resource_limit); a backend goes in env_cfg.dist_cfg.backend",
        "env_cfg.cudnn_determinstic=True is ignored, as MMEngine ignores it (it reads "
        "cudnn_benchmark, mp_cfg, dist_cfg, resource_limit)"]


@pytest.mark.parametrize(("clip_grad", "section"), [
    ({"type": "value", "clip_value": 0.5}, {"clip_value": 0.5}),
    ({"type": "value", "clip_value": 2, "foreach": False}, {"clip_value": 2, "foreach": False}),
    ({"max_norm": 1.0}, {"max_norm": 1.0}),
    ({"type": "norm", "max_norm": 3, "norm_type": 1}, {"max_norm": 3, "norm_type": 1}),
])
def test_clip_grad_maps_onto_optim_clip_grad_by_value_or_by_norm(tmp_path: Path, clip_grad,
                                                                  section):
    """MMEngine's type='value' (torch's clip_grad_value_ arguments) is trainrun's
    ``{clip_value: ...}``; type='norm' (the default) its ``{max_norm: ...}``."""
    optim_wrapper = {"optimizer": {"type": "SGD", "lr": 0.1}, "clip_grad": clip_grad}
    given = dict(clip_grad)
    assert optim_section(optim_wrapper) == (
        {"type": "SGD", "lr": 0.1, "clip_grad": section, "accumulate": 1}, "fp32")
    runner = Runner(**arguments(tmp_path / "run", optim_wrapper=optim_wrapper))
    try:
        assert runner.optim_wrapper.clip_grad == section
    finally:
        runner.close()
    assert clip_grad == given  # the user's dict is not consumed


def test_clip_grad_by_value_is_refused_with_deepspeed(tmp_path: Path):
    """DeepSpeed's engine clips the total norm only: refused before anything starts."""
    optim_wrapper = {"type": "DeepSpeedOptimWrapper", "optimizer": {"type": "SGD", "lr": 0.1},
                     "clip_grad": {"type": "value", "clip_value": 0.5}}
    with pytest.raises(ConfigError, match=r"^optim_wrapper\.clip_grad\.type='value': .*norm"):
        FlexibleRunner(**arguments(tmp_path / "run", optim_wrapper=optim_wrapper),
                       strategy={"type": "DeepSpeedStrategy"})
    assert not (tmp_path / "run").exists()


def logged_window(**kwargs) -> int:
    """The ``logging.window`` the compat Runner built from MMEngine's arguments."""
    runner = Runner(**kwargs)
    try:
        (logger,) = [hook for hook in runner.hooks if isinstance(hook, LoggerHook)]
        return logger.window
    finally:
        runner.close()


def test_log_processor_window_size_is_the_logging_window_mmengines_10_by_default(
        tmp_path: Path):
    assert logged_window(**arguments(tmp_path / "default")) == 10
    assert logged_window(**arguments(tmp_path / "none", log_processor=None)) == 10
    given = {"type": "LogProcessor", "window_size": 3, "by_epoch": False}
    assert logged_window(**arguments(tmp_path / "given", log_processor=given)) == 3
    assert logged_window(**arguments(tmp_path / "bare", log_processor={"by_epoch": True})) == 10
    assert logged_window(**arguments(tmp_path / "one", log_processor={"window_size": 1})) == 1


def test_train_cfg_maps_onto_the_schedule_with_mmengines_defaults():
    assert loop_section({"by_epoch": True, "max_epochs": 4, "val_begin": 2}) == \
        {"max_epochs": 4, "val_interval": 1, "val_begin": 2}
    assert loop_section({"type": "IterBasedTrainLoop", "max_iters": 3000}) == \
        {"max_iters": 3000, "val_interval": 1000, "val_begin": 1}


def test_a_sampler_other_than_mmengines_two_is_refused(tmp_path: Path):
    loader = {"dataset": {"type": CompatPoints}, "batch_size": 8,
              "sampler": {"type": "GroupSampler", "shuffle": True}}
    with pytest.raises(ConfigError, match=r"^train_dataloader\.sampler\.type='GroupSampler'"):
        Runner(**arguments(tmp_path / "run", train_dataloader=loader))
    by_epoch = {"train_cfg": {"by_epoch": True, "max_epochs": 2},
                "default_hooks": {"checkpoint": {"type": "CheckpointHook", "interval": 1}}}
    loader["sampler"]["type"] = "InfiniteSampler"  # an epoch-based run's data has an end
    with pytest.raises(ConfigError, match=r"^train_dataloader\.sampler\.type='InfiniteSampler'"):
        Runner(**arguments(tmp_path / "run", train_dataloader=loader, **by_epoch))


def test_round_up_false_is_refused_for_training_and_under_a_sharding_strategy(tmp_path: Path):
    """Ranks whose shares differ by a sample can run different numbers of batches: DDP's
    training waits for the missing ones, and so does every forward under FSDP."""
    exact = {"type": "DefaultSampler", "shuffle": False, "round_up": False}
    loader = {"dataset": {"type": CompatPoints}, "batch_size": 8, "sampler": exact}
    named = r"^train_dataloader\.sampler\.round_up=False: not supported .*val_dataloader"
    with pytest.raises(ConfigError, match=named):
        Runner(**arguments(tmp_path / "run", train_dataloader=loader))
    built = DataLoader(CompatPoints(), batch_size=8,
                       sampler=DefaultSampler(CompatPoints(), shuffle=False, round_up=False))
    with pytest.raises(ConfigError, match=named):  # a DataLoader built by the script too
        Runner(**arguments(tmp_path / "run", train_dataloader=built))
    val = {"val_dataloader": loader, "val_cfg": {}, "val_evaluator": {"type": "accuracy"}}
    with pytest.raises(ConfigError, match=r"^val_dataloader\.sampler\.round_up=False: .*fsdp"):
        FlexibleRunner(**arguments(tmp_path / "run", **val),
                       strategy={"type": "FSDPStrategy"})
    assert not (tmp_path / "run").exists()


def test_from_cfg_takes_the_configs_variables_and_its_wrapper_options(tmp_path: Path):
    cfg = {**arguments(tmp_path / "run"), "data_root": "data/", "find_unused_parameters": True}
    runner = Runner.from_cfg(cfg)
    try:
        assert runner.strategy.options["find_unused_parameters"] is True
    finally:
        runner.close()
    wrapper = {"type": "MMDistributedDataParallel", "bucket_cap_mb": 25, "sync_bn": True}
    with pytest.raises(ConfigError, match="^model_wrapper_cfg.sync_bn=True"):
        Runner.from_cfg({**arguments(tmp_path / "other"), "model_wrapper_cfg": wrapper})


def test_a_hook_point_trainrun_does_not_call_is_refused(tmp_path: Path):
    class PerBatch:
        def after_val_iter(self, runner, batch_idx, data_batch=None, outputs=None):
            pass

    with pytest.raises(ConfigError, match="^PerBatch.after_val_iter: a hook point"):
        Runner(**arguments(tmp_path / "run", custom_hooks=[PerBatch()]))


# a refusal before the Runner joins a process group, and one after (torch.distributed's own
# excepthook, set when a group is joined, holds stderr back until the hook it wraps returns)
REFUSALS = {
    "before": ("auto_scale_lr=dict(enable=True, base_batch_size=16)",
               "error: auto_scale_lr={'enable': True, 'base_batch_size': 16}: not supported by "
               "trainrun.compat.mmengine"),
    "after joining": ("launcher='pytorch', train_cfg=dict(by_epoch=False, max_iters=2),\n"
                      "       train_dataloader=dict(dataset=[torch.zeros(2)] * 4, batch_size=2,\n"
                      "                             sampler=dict(type='DefaultSampler')),\n"
                      "       optim_wrapper=dict(optimizer=dict(type='NoSuchOptimizer')),",
                      "error: optim.type='NoSuchOptimizer' is not an optimiser in torch.optim"),
}


@pytest.mark.parametrize("when", REFUSALS)
def test_a_script_that_does_not_catch_a_refusal_exits_2_in_one_line(tmp_path: Path, when: str):
    arguments, line = REFUSALS[when]
    script = tmp_path / "train.py"
    script.write_text(
        "import os\n"
        "import torch\n"
        "from trainrun.compat.mmengine.runner import Runner\n"
        f"os.environ.update(RANK='0', WORLD_SIZE='1', LOCAL_RANK='0', LOCAL_WORLD_SIZE='1',\n"
        f"                  MASTER_ADDR='127.0.0.1', MASTER_PORT='{free_port()}')\n"
        f"Runner(model=torch.nn.Linear(2, 2), work_dir={str(tmp_path / 'run')!r},\n"
        f"       {arguments})\n")
    done = run([sys.executable, str(script)])
    assert done.returncode == 2
    assert done.stderr.splitlines() == [line]


def test_a_refusal_rank_0_reaches_last_is_still_said_under_torchrun(tmp_path: Path):
    # rank 0 is late to the optimiser's refusal (its model hands out parameters slowly);
    # torchrun stops the other ranks once one has ended
    script = tmp_path / "train.py"
    script.write_text(
        "import os, time\n"
        "import torch\n"
        "from trainrun.compat.mmengine.runner import Runner\n"
        "class RankZeroLate(torch.nn.Linear):\n"
        "    def parameters(self, recurse=True):\n"
        "        if os.environ['RANK'] == '0':\n"
        "            time.sleep(0.5)\n"
        "        return super().parameters(recurse)\n"
        f"Runner(model=RankZeroLate(2, 2), work_dir={str(tmp_path / 'run')!r},\n"
        f"       {REFUSALS['after joining'][0]})\n")
    done = run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(free_port()), str(script)])
    assert "exitcode  : 2" in done.stderr, done.stderr[-3000:]
    assert [line for line in done.stderr.splitlines() if line.startswith("error:")] == [
        REFUSALS["after joining"][1]]
