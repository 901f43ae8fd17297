"""optim.paramwise through the command line, as a user runs it: a bad value of every key
(exit 2, the key named, nothing written), the groups in the dry run's plan, the warning for a
custom key matching nothing (said once on 2 processes), and an exact resume after SIGKILL on 2
processes with the groups in the checkpoint, and a resume whose groups differ from the
checkpoint's refused before anything is written."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
import torch

from tests.cli import CONFIG, SHORT, env
from tests.records import train_records
from trainrun.cli import verify_resume as vr
from trainrun.cli.train import main as train_main
from trainrun.dist.launch import free_port

PARAMWISE = ("optim.paramwise={bias_lr_mult: 2.0, bias_decay_mult: 0, "
             "custom_keys: {net.0: {lr_mult: 0.5}, backbone: {lr_mult: 0.1}}}")


@pytest.mark.parametrize(("option", "words"), [
    ("optim.paramwise=7", "optim.paramwise: got 7, expected null or a mapping"),
    ("optim.paramwise.bias_lr_mult=-1", "optim.paramwise.bias_lr_mult: got -1, expected null "
                                        "or a number >= 0"),
    ("optim.paramwise.bias_decay_mult=lots", "optim.paramwise.bias_decay_mult: got 'lots'"),
    ("optim.paramwise.norm_decay_mult=[0]", "optim.paramwise.norm_decay_mult: got [0]"),
    ("optim.paramwise.custom_keys=head", "optim.paramwise.custom_keys: got 'head', expected a "
                                         "mapping"),
    ("optim.paramwise.custom_keys={net.0: {lr_mult: -2}}",
     "optim.paramwise.custom_keys.net.0.lr_mult: got -2, expected a number >= 0"),
    ("optim.paramwise.custom_keys={net.0: {decay_mult: x}}",
     "optim.paramwise.custom_keys.net.0.decay_mult: got 'x', expected a number >= 0"),
    ("optim.paramwise.custom_keys={net.0: {lr_mul: 2}}",
     "unknown key 'optim.paramwise.custom_keys.net.0.lr_mul'; did you mean "
     "'optim.paramwise.custom_keys.net.0.lr_mult'?"),
    ("optim.paramwise.bias_lr=2", "unknown key 'optim.paramwise.bias_lr'; did you mean "
                                  "'optim.paramwise.bias_lr_mult'?"),
])
def test_a_bad_value_of_every_key_exits_2_naming_it_and_writes_nothing(tmp_path, capfd, option,
                                                                       words):
    work_dir = tmp_path / "run"
    for dry_run in ([], ["--dry-run"]):
        code = train_main([str(CONFIG), "--launcher", "none", "--work-dir", str(work_dir),
                           "--cfg-options", option, *dry_run])
        out, err = capfd.readouterr()
        assert code == 2, out + err
        assert err.startswith("error: ") and words in err, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
        assert not work_dir.exists()


def test_the_dry_run_lists_each_group_and_warns_about_a_key_matching_nothing(tmp_path, capfd):
    code = train_main([str(CONFIG), "--dry-run", "--work-dir", str(tmp_path / "run"),
                       "--cfg-options", PARAMWISE])
    out, err = capfd.readouterr()
    assert code == 0, out + err
    rows = out.splitlines()
    start = next(i for i, row in enumerate(rows) if row.lstrip().startswith("param groups"))
    assert re.fullmatch(r"  param groups +3 groups \(optim.paramwise; counted on the model "
                        r"built on the meta device\)", rows[start]), rows[start]
    assert [row.strip() for row in rows[start + 1:start + 4]] == [
        "default: lr 0.001, weight_decay 0.01; 1 tensor, 2,560 elements",
        "'net.0': lr 0.0005, weight_decay 0.01; 2 tensors, 16,640 elements",
        "bias: lr 0.002, weight_decay 0; 1 tensor, 10 elements"]
    assert rows[start + 4].lstrip().startswith("scheduler")
    assert err.strip() == ("warning: optim.paramwise.custom_keys.backbone: matches no "
                           "parameter of the model (a key is a part of a parameter's full "
                           "name); it changes nothing")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_two_processes_warn_once_and_log_the_groups(tmp_path):
    work_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(free_port()), "tools/train.py", str(CONFIG), "--launcher", "pytorch",
         "--work-dir", str(work_dir), "--cfg-options", PARAMWISE, "schedule.max_epochs=null",
         "schedule.max_iters=4", "schedule.val_interval=4", "checkpoint.interval=4"],
        capture_output=True, text=True, timeout=180, env=env(), cwd=CONFIG.parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("custom_keys.backbone: matches no parameter") == 1, done.stderr
    log = (work_dir / "train.log").read_text()
    assert "custom_keys.backbone: matches no parameter" in log
    assert ("parameter groups (optim.paramwise):\n"
            "  default: lr 0.001, weight_decay 0.01; 1 tensor, 2,560 elements\n") in log


@pytest.mark.slow
def test_digits_with_groups_and_a_schedule_resume_exactly_after_sigkill(child_env, capsys,
                                                                       tmp_path):
    code = vr.main([str(CONFIG), "--nproc", "2", "--steps", "8", "--work-dir", str(tmp_path),
                    "--cfg-options", PARAMWISE, "scheduler={type: cosine, warmup_iters: 2}"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert any(line.startswith("interrupted: killed with SIGKILL after step ")
               for line in out.splitlines()), out
    assert "exact resume: the losses of steps 1-8 match bit for bit" in out, out
    assert "/iter_4.pth at epoch 1, step 4" in (tmp_path / "resumed.log").read_text()
    # the checkpoint holds the groups, each at its own rate under the schedule
    saved = torch.load(tmp_path / "resumed" / "checkpoints" / "iter_4.pth",
                       weights_only=True)["optimizer"]["param_groups"]
    assert [(g["name"], g["initial_lr"], g["weight_decay"]) for g in saved] == [
        ("default", 0.001, 0.01), ("'net.0'", 0.0005, 0.01), ("bias", 0.002, 0.0)]
    assert saved[2]["lr"] == pytest.approx(2 * saved[0]["lr"], rel=1e-12) != saved[0]["lr"]
    # the logged lr (the first group's, the base rate under the schedule) resumed exactly too,
    # each step once (the resume took out what the killed run logged after its checkpoint)
    lrs = {name: [(r["step"], r["lr"]) for r in train_records(tmp_path / name)]
           for name in ("straight", "resumed")}
    assert lrs["straight"] == lrs["resumed"] and len({lr for _, lr in lrs["straight"]}) > 2
    assert [step for step, _ in lrs["straight"]] == list(range(1, 9))


def test_resuming_with_other_groups_is_refused_in_one_line_before_anything_is_written(
        digits_run, tmp_path, capfd):
    """--force accepts the changed config, but the checkpoint's optimiser state has one group
    where the new groups are two: exit 2 naming both and what to do, no traceback, and the
    run directory (a copy of the shared 2-process run) left as it was."""
    work_dir = tmp_path / "run"
    shutil.copytree(digits_run[0], work_dir)
    before = {p: p.read_bytes() for p in work_dir.rglob("*") if p.is_file()}
    code = train_main([str(CONFIG), "--launcher", "none", "--work-dir", str(work_dir),
                       "--resume", "--force", "--cfg-options", *SHORT,
                       "optim.paramwise={bias_decay_mult: 0}"])
    err = capfd.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    checkpoint = work_dir / "checkpoints" / "epoch_2.pth"
    assert err.strip().splitlines()[-1] == (
        f"error: resume: {checkpoint}: its optimiser state holds 1 parameter group (all "
        f"parameters: 4 tensors), this config makes 2 parameter groups (default: 2 tensors; "
        f"bias: 2 tensors): optim.paramwise (or optim.per_module) changed since it was "
        f"written; resume without that change, or start a new run from its weights alone "
        f"(load_from: {checkpoint}, in another work_dir)")
    assert {p: p.read_bytes() for p in work_dir.rglob("*") if p.is_file()} == before
