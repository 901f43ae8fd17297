"""The parameter groups a checkpoint's optimiser state holds, read by each format without
reading its tensors, and compared with a run's before a resume loads anything: another
number of groups (optim.paramwise changed) is refused in one line naming both sides and what
to do, for a torch file (none, ddp), a DCP directory (fsdp, end to end in one process) and
DeepSpeed's records."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from tests.records import loss_list
from tests.runner.toy import ToyModel
from trainrun.checkpoint import DCPDirectory, DeepSpeedDirectory, TorchFile
from trainrun.checkpoint.deepspeed_dir import TAG
from trainrun.checkpoint.optimizer_state import (
    GroupRecord,
    groups_mismatch,
    optimizer_groups,
)
from trainrun.checkpoint.resume import StartPoint, UnusableCheckpoint
from trainrun.checkpoint.train_state import TRAIN_STATE
from trainrun.runner.runner import Runner
from trainrun.runner.schema import ConfigError

BIAS_APART = {"bias_decay_mult": 0}  # two groups: 'default' (weights), 'bias'


def _optimizer(model: ToyModel, paramwise: dict | None) -> torch.optim.Optimizer:
    params = model.parameters() if paramwise is None else [
        {"params": [p for n, p in model.named_parameters() if not n.endswith("bias")],
         "name": "default"},
        {"params": [p for n, p in model.named_parameters() if n.endswith("bias")],
         "name": "bias", "weight_decay": 0.0}]
    return torch.optim.AdamW(params, lr=0.01)


def test_a_run_s_groups_are_named_and_counted():
    model = ToyModel()
    assert optimizer_groups(_optimizer(model, None)) == {"": [GroupRecord(None, 4)]}
    assert optimizer_groups({"net": _optimizer(model, BIAS_APART)}) == {
        "net": [GroupRecord("default", 2), GroupRecord("bias", 2)]}
    assert optimizer_groups(None) is None


def test_a_torch_file_s_groups_are_read_and_another_number_refused(tmp_path):
    model = ToyModel()
    checkpoint = tmp_path / "iter_1.pth"
    torch.save({"model": model.state_dict(),
                "optimizer": _optimizer(model, None).state_dict()}, checkpoint)
    saved = TorchFile.param_groups(checkpoint)
    assert saved == {"": [GroupRecord(None, 4)]}
    run = optimizer_groups(_optimizer(model, BIAS_APART))
    assert groups_mismatch(saved, saved) is None
    assert groups_mismatch(saved, run) == (
        "its optimiser state holds 1 parameter group (all parameters: 4 tensors), this config "
        "makes 2 parameter groups (default: 2 tensors; bias: 2 tensors)")
    start = StartPoint(tmp_path)
    shapes = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    with pytest.raises(UnusableCheckpoint) as refused:
        start.check_fits(("resume", checkpoint), shapes, run)
    assert str(refused.value) == (
        f"resume: {checkpoint}: its optimiser state holds 1 parameter group (all parameters: "
        f"4 tensors), this config makes 2 parameter groups (default: 2 tensors; bias: 2 "
        f"tensors): optim.paramwise (or optim.per_module) changed since it was written; "
        f"resume without that change, or start a new run from its weights alone (load_from: "
        f"{checkpoint}, in another work_dir)")
    start.check_fits(("resume", checkpoint), shapes, optimizer_groups(_optimizer(model, None)))
    start.check_fits(("load", checkpoint), shapes, run)  # weights only: groups do not matter
    torch.save({"model": model.state_dict()}, checkpoint)
    assert TorchFile.param_groups(checkpoint) is None  # no optimiser state: nothing to load
    start.check_fits(("resume", checkpoint), shapes, run)


def test_the_same_number_of_groups_holding_other_tensors_is_refused_too():
    saved = {"": [GroupRecord("default", 3), GroupRecord("bias", 1)]}
    run = {"": [GroupRecord("default", 2), GroupRecord("'net.0'", 2)]}
    assert groups_mismatch(saved, run) == (
        "its optimiser state holds 2 parameter groups (default: 3 tensors; bias: 1 tensor), "
        "this config makes 2 parameter groups (default: 2 tensors; 'net.0': 2 tensors)")
    uncounted = {"": [GroupRecord(None, None), GroupRecord(None, None)]}  # DeepSpeed's records
    assert groups_mismatch(uncounted, run) is None
    assert groups_mismatch({"a": saved[""], "b": saved[""]}, {"a": saved[""]}) == (
        "its optimiser state is of the optimisers of 'a', 'b' (optim.per_module), this config "
        "makes the optimisers of 'a' (optim.per_module)")
    assert groups_mismatch({"a": saved[""]}, {"a": run[""][:1]}) == (
        "its optimiser state of 'a' holds 2 parameter groups (default: 3 tensors; bias: 1 "
        "tensor), this config makes 1 parameter group (default: 2 tensors)")


def test_a_dcp_directory_s_groups_are_counted_from_its_metadata_and_named(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = ToyModel()
    optimizer = _optimizer(model, BIAS_APART)
    model_state, optim_state = get_state_dict(model, [optimizer])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that there is no group
        dcp.save({"model": model_state, "optimizer": optim_state},
                 checkpoint_id=str(tmp_path / "iter_1.pth"), no_dist=True)
    assert DCPDirectory.param_groups(tmp_path / "iter_1.pth") == {
        "": [GroupRecord("default", 2), GroupRecord("bias", 2)]}


def test_deepspeed_s_records_give_the_number_of_groups(tmp_path):
    checkpoint = tmp_path / "iter_1.pth"
    (checkpoint / TAG).mkdir(parents=True)
    torch.save({"meta": {"iter": 1}}, checkpoint / TRAIN_STATE)
    states = checkpoint / TAG / "mp_rank_00_model_states.pt"
    # ZeRO 1-3: the shapes of each group's trainable parameters
    torch.save({"module": {}, "param_shapes": [{"w": torch.Size([5, 2])},
                                               {"b": torch.Size([5])}]}, states)
    assert DeepSpeedDirectory.param_groups(checkpoint) == {"": [GroupRecord(None, None)] * 2}
    # no ZeRO: the optimiser's own state
    model = ToyModel()
    torch.save({"module": {}, "param_shapes": None,
                "optimizer": _optimizer(model, None).state_dict()}, states)
    assert DeepSpeedDirectory.param_groups(checkpoint) == {"": [GroupRecord(None, None)]}
    assert groups_mismatch(DeepSpeedDirectory.param_groups(checkpoint), optimizer_groups(
        _optimizer(model, BIAS_APART))) == (
        "its optimiser state holds 1 parameter group (all parameters), this config makes 2 "
        "parameter groups (default: 2 tensors; bias: 2 tensors)")


def _fsdp_runner(work_dir: Path, paramwise: dict | None, resume: bool) -> Runner:
    optim = {"type": "AdamW", "lr": 0.01, **({"paramwise": paramwise} if paramwise else {})}
    return Runner(model={"type": "tests.runner.toy.ToyModel"}, work_dir=work_dir,
                  train_dataloader={"type": "tests.runner.toy.ToyRegression", "size": 32,
                                    "batch_size": 4},
                  optim=optim, strategy="fsdp", schedule={"max_iters": 4 if resume else 2},
                  randomness={"seed": 3}, logging={"interval": 1, "backends": []},
                  checkpoint={"interval": 2}, resume=resume)


def test_fsdp_resuming_with_other_groups_is_refused_before_anything_is_written(tmp_path):
    runner = _fsdp_runner(tmp_path, BIAS_APART, resume=False)
    runner.train()
    runner.close()
    written = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    checkpoint = tmp_path / "checkpoints" / "iter_2.pth"
    with pytest.raises(ConfigError) as refused:
        _fsdp_runner(tmp_path, None, resume=True)
    assert str(refused.value) == (
        f"resume: {checkpoint}: its optimiser state holds 2 parameter groups (default: 2 "
        f"tensors; bias: 2 tensors), this config makes 1 parameter group (all parameters: 4 "
        f"tensors): optim.paramwise (or optim.per_module) changed since it was written; resume "
        f"without that change, or start a new run from its weights alone (load_from: "
        f"{checkpoint}, in another work_dir)")
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == written
    _fsdp_runner(tmp_path, BIAS_APART, resume=True).close()  # the same groups resume


@pytest.mark.parametrize(("before", "after", "lacking"), [
    ("AdamW", "SGD", "momentum, dampening, which SGD needs"),
    ("SGD", "AdamW", "betas, eps, which AdamW needs"),
])
def test_resuming_under_another_optimiser_type_is_refused_before_a_step(tmp_path, before,
                                                                        after, lacking):
    """torch loads another type's state into an optimiser without a word, and its first
    step fails (a KeyError); the resume refuses it, naming what the groups lack. (The
    command line refuses the change before anything is written, --force or not:
    tests/tools/test_bad_input.py.)"""
    def runner(optim_type, resume):
        return Runner(model={"type": "tests.runner.toy.ToyModel"}, work_dir=tmp_path,
                      train_dataloader={"type": "tests.runner.toy.ToyRegression", "size": 32,
                                        "batch_size": 4},
                      optim={"type": optim_type, "lr": 0.01}, strategy="none",
                      schedule={"max_iters": 4 if resume else 2},
                      logging={"interval": 1, "backends": []}, checkpoint={"interval": 2},
                      resume=resume)

    with runner(before, resume=False) as first:
        first.train()
    with runner(after, resume=True) as second, pytest.raises(ConfigError) as refused:
        second.train()
    checkpoint = tmp_path / "checkpoints" / "iter_2.pth"
    assert str(refused.value) == (
        f"resume: {checkpoint}: its optimiser state is another type's: its parameter groups "
        f"lack {lacking}: optim.type changed since it was written; resume without that "
        f"change, or start a new run from its weights alone (load_from: {checkpoint}, in "
        f"another work_dir)")
    assert [step for step, _ in loss_list(tmp_path)] == [1, 2]  # no step was taken
