"""tools/verify_resume.py on the digits config: an exact resume on 2 processes, a model whose
randomness the checkpoint misses, a bad option; then its parts one by one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.runner.toy import flip_byte, rehash
from tests.tools.test_train_cli import CONFIG, REPO, env, run
from trainrun.cli import verify_resume as vr
from trainrun.cli.processes import alive

# ---------------------------------------------------------------- end to end

@pytest.fixture
def child_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tool run in process, its runs started with the command-line tests' environment
    (the test models importable, one thread a process); saves the tool's own start-up."""
    wanted = env()
    for key in set(os.environ) - set(wanted):
        monkeypatch.delenv(key)
    for key, value in wanted.items():
        monkeypatch.setenv(key, value)


# (SIGKILL and --resume under fsdp and ZeRO-3 chosen with --cfg-options, as a sweep would, is
# tests/tools/test_ema_cli.py's first test, which also carries an EMA hook through the resume)


@pytest.mark.slow
def test_augmentation_in_two_workers_resumes_exactly_after_a_kill_mid_epoch(child_env, capsys,
                                                                            tmp_path):
    """A data set drawing from torch, numpy and random in ``__getitem__``, read by 2 workers
    on each of 2 ranks: the step-13 checkpoint lies inside the first epoch (20 steps), and the
    resumed run goes on into the second."""
    code = vr.main([str(CONFIG), "--nproc", "2", "--steps", "26", "--work-dir", str(tmp_path),
                    "--cfg-options", "data.train.type=tests.tools.models.NoisyDigits",
                    "data.train.num_workers=2"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "killed with SIGKILL after step " in out
    resumed_log = (tmp_path / "resumed.log").read_text()
    assert "/iter_13.pth at epoch 1, step 13" in resumed_log, resumed_log[-2000:]
    assert out.splitlines()[-2] == "exact resume: the losses of steps 1-26 match bit for bit"


@pytest.mark.slow
def test_a_run_that_stops_early_is_judged_up_to_its_stop(child_env, capsys, tmp_path):
    """EarlyStopping ends the straight run at step 4 of 12 (validations every 2 steps, the
    first the best): the kill comes after the step-2 checkpoint, and the resumed run must stop
    at step 4 too."""
    code = vr.main([str(CONFIG), "--nproc", "1", "--steps", "12", "--work-dir", str(tmp_path),
                    "--cfg-options", "schedule.val_interval=2", "hooks=[{type: EarlyStopping, "
                    "metric: accuracy, patience: 1, min_delta: 0.5}]"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert ("straight: stopped by itself at step 4 of 12: the resume is judged over steps "
            "1-4, killed after the step-2 checkpoint") in out
    assert "resumed: training steps 3-4 from the checkpoint ..." in out
    assert ("exact resume: the losses of steps 1-4 match bit for bit, and both runs stopped "
            "by themselves at step 4") in out


@pytest.mark.slow
def test_a_generator_the_checkpoint_misses_is_reported_at_its_first_step(child_env, capsys,
                                                                          tmp_path):
    code = vr.main([str(CONFIG), "--steps", "6", "--work-dir", str(tmp_path), "--cfg-options",
                    "model.type=tests.tools.models.UnsavedNoiseDigitsMLP"])
    out, err = capsys.readouterr()
    assert code == 1, out + err
    lines = out.splitlines()
    verdict = [i for i, line in enumerate(lines) if line.startswith("resume is NOT exact")]
    assert len(verdict) == 1, out
    first = lines[verdict[0]]
    assert first.startswith("resume is NOT exact: step 4: straight "), first
    straight, resumed = first.split("straight ")[1].split(" vs resumed ")
    assert float(straight) != float(resumed)
    assert lines[verdict[0] + 1].startswith("  step 5: straight ")
    assert lines[verdict[0] + 2].startswith("  step 6: straight ")
    assert "steps 1-3 match" in lines[verdict[0] + 3]
    assert "random generator the checkpoint does not save" in lines[verdict[0] + 4]
    assert lines[-1] == f"run directories kept in {tmp_path}"  # a --work-dir is kept
    assert (tmp_path / "resumed" / "metrics.jsonl").is_file()


@pytest.mark.slow
def test_a_resumed_run_refusing_a_damaged_checkpoint_is_reported_with_its_line(
        child_env, capsys, tmp_path):
    """The resumed run's one-line error comes first in the report (under torchrun the tail
    of its output is torchrun's own report): here, the damage of the only checkpoint."""
    checkpoints = tmp_path / "resumed" / "checkpoints"
    checkpoints.mkdir(parents=True)
    damaged = checkpoints / "iter_2.pth"
    torch.save({"meta": {"iter": 2}}, damaged)
    rehash(damaged)
    flip_byte(damaged)
    (checkpoints / "last").write_text("iter_2.pth\n")
    with pytest.raises(vr.RunFailed) as failed:
        vr.run_resumed(vr.make_plan([str(CONFIG), "--steps", "4"]), tmp_path, 0)
    assert vr._report_failure(failed.value, keep=True) == 1
    report = capsys.readouterr().err.splitlines()
    assert report[0] == (f"error: the resumed run failed (exit 2): resume: no intact checkpoint "
                         f"in {checkpoints}: {damaged} is damaged: iter_2.pth: sha256 mismatch "
                         "(against iter_2.pth.sha256)")
    assert report[1] == "its last lines:"


def test_a_bad_option_exits_2_with_one_line_before_any_run(tmp_path):
    done = run([sys.executable, str(REPO / "tools" / "verify_resume.py"), str(CONFIG),
                "--work-dir", str(tmp_path / "runs"), "--cfg-options", "optim.lrr=0.1"])
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == ["error: unknown key 'optim.lrr'; did you mean "
                                        "'optim.lr'?"]
    assert done.stdout == "" and not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- in process

@pytest.mark.parametrize(("args", "expected"), [
    (["nope.yaml"], "error: config file not found: 'nope.yaml'"),
    ([str(CONFIG), "--cfg-options", "schedule.val_interval=0"], "schedule.val_interval"),
    ([str(CONFIG), "--steps", "1"], "--steps: expected at least 2, got 1"),
    ([str(CONFIG), "--nproc", "two"], "--nproc: expected an integer, got 'two'"),
])
def test_usage_errors_exit_2(capsys, args, expected):
    assert vr.main(args) == 2
    assert expected in capsys.readouterr().err


def test_a_work_dir_with_runs_in_it_is_refused(tmp_path, capsys):
    (tmp_path / "straight").mkdir()
    assert vr.main([str(CONFIG), "--work-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: --work-dir: {tmp_path / 'straight'} exists; " \
                                      f"expected a new or empty directory\n"


def test_every_run_gets_the_users_options_between_the_tools(capsys):
    plan = vr.make_plan([str(CONFIG), "--nproc", "2", "--steps", "10", "--cfg-options",
                         "schedule.val_interval=5", "optim.lr=0.01", "logging.interval=10"])
    assert capsys.readouterr().err == ("warning: --cfg-options logging.interval=10 is "
                                       "replaced: this tool sets logging.interval itself\n")
    cmd = vr.train_command(plan, Path("/runs/x"), resume=True)
    assert cmd[1:6] == ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port"]
    options = cmd[cmd.index("--cfg-options") + 1:]
    assert options[:4] == ["schedule.val_interval=10", "schedule.val_interval=5",
                           "optim.lr=0.01", "logging.interval=10"]
    assert {"schedule.max_iters=10", "checkpoint.interval=5", "logging.interval=1",
            "resume=false"} <= set(options[4:])
    assert cmd[cmd.index("--launcher") + 1] == "pytorch" and "--resume" in cmd
    alone = vr.train_command(vr.make_plan([str(CONFIG)]), Path("/runs/x"))
    assert alone[:4] == [sys.executable, "-m", "trainrun", "train"] and "--resume" not in alone
    assert alone[alone.index("--launcher") + 1] == "none"


def test_rewind_removes_the_later_checkpoints_files_and_directories(tmp_path):
    for name in ("iter_5.pth", "iter_10.pth.sha256", "iter_10.pth", "best_accuracy_iter_10.pth",
                 "iter_12.pth", "iter_12.pth.sha256"):  # one-file checkpoints, their manifests
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "iter_15.pth").mkdir()  # a sharded checkpoint
    (tmp_path / "iter_15.pth" / "shard").write_bytes(b"x")
    (tmp_path / "last").write_text("iter_15.pth\n")
    assert vr.rewind(tmp_path, 10) == ["iter_12.pth", "iter_12.pth.sha256", "iter_15.pth"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "best_accuracy_iter_10.pth", "iter_10.pth", "iter_10.pth.sha256", "iter_5.pth", "last"]
    assert (tmp_path / "last").read_text() == "iter_10.pth\n"
    with pytest.raises(RuntimeError, match="no iter_20 checkpoint"):
        vr.rewind(tmp_path, 20)


def test_metrics_records_from_an_offset_skip_a_line_cut_short(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 2.5, "time": 0.1}\n{"step": 2, "lo')
    offset = vr.end_line(metrics)
    assert offset == metrics.stat().st_size and vr.end_line(metrics) == offset
    with open(metrics, "a") as f:
        f.write('{"step": 2, "loss": 2.25, "time": 0.3}\n{"step": 2, "mode": "val", "a": 1}\n')
    assert vr.by_step(vr.read_records(metrics)) == {1: {"loss": 2.5}, 2: {"loss": 2.25}}
    assert vr.by_step(vr.read_records(metrics, offset)) == {2: {"loss": 2.25}}
    assert vr.last_validation(vr.read_records(metrics)) == {"step": 2, "mode": "val", "a": 1}


def test_the_first_mismatch_names_the_step_the_key_and_both_values(capsys):
    plan = vr.make_plan([str(CONFIG), "--steps", "6"])
    straight = {s: {"loss": 2.0 + s / 10, "lr": 0.001} for s in range(1, 7)}
    resumed = {s: dict(v) for s, v in straight.items() if s > 3}
    assert vr.check_resumed(plan, straight, resumed) is None
    resumed[5]["lr"] = 0.002
    assert vr.check_resumed(plan, straight, resumed) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "resume is NOT exact: step 5: lr: straight 0.001 vs resumed 0.002"
    assert out[1] == "  step 6: lr: straight 0.001 vs resumed 0.001 (equal)"
    del resumed[6]
    resumed[5]["lr"] = 0.001
    assert vr.check_resumed(plan, straight, resumed) == 1
    assert capsys.readouterr().out.startswith(
        "resume is NOT exact: step 6: step: straight 6 vs resumed missing")
    assert vr.check_resumed(plan, straight, straight) == 1  # did not resume: began at step 1
    assert "began at step 1, not at step 4" in capsys.readouterr().out


def test_differences_before_the_checkpoint_are_not_blamed_on_the_resume(capsys):
    plan = vr.make_plan([str(CONFIG), "--steps", "6"])
    straight = {s: {"loss": 1.0} for s in range(1, 7)}
    rerun = {**straight, 2: {"loss": 1.0000000000000002}}
    assert vr.check_rerun(plan, straight, rerun) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "resume is NOT exact: step 2: straight 1.0 vs interrupted 1.0000000000000002"
    assert "before the step-3 checkpoint" in out[-2] and "deterministic: true" in out[-1]
    assert vr.check_validation(plan, {"step": 6, "mode": "val", "accuracy": 0.5},
                               {"step": 6, "mode": "val", "accuracy": 0.5}) is None
    assert vr.check_validation(plan, {"step": 6, "accuracy": 0.5}, None) == 1
    assert "validation: accuracy: straight 0.5 vs resumed missing" in capsys.readouterr().out


# ---------------------------------------------------------------- the kill

SPAWNS_A_SESSION = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
print("started", flush=True)
time.sleep(60)
"""


def test_kill_tree_reaches_children_in_sessions_of_their_own():
    proc = subprocess.Popen([sys.executable, "-c", SPAWNS_A_SESSION], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline() == "started\n"
    tree = vr.process_tree(proc.pid)
    assert len(tree) == 2
    vr.kill_tree(proc.pid)
    assert proc.wait(timeout=10) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in tree):
        assert time.monotonic() < deadline, "a process of the tree survived"
        time.sleep(0.01)


def test_the_job_is_killed_once_last_appears_or_left_to_end(tmp_path):
    saves = f"import pathlib, time; pathlib.Path({str(tmp_path)!r}, 'last').write_text('x'); " \
            "time.sleep(60)"
    proc = vr.start([sys.executable, "-c", saves], tmp_path / "a.log")
    assert vr.kill_after_checkpoint(proc, tmp_path) is True
    (tmp_path / "last").unlink()
    proc = vr.start([sys.executable, "-c", "pass"], tmp_path / "b.log")
    assert vr.kill_after_checkpoint(proc, tmp_path) is False and proc.returncode == 0
    assert (tmp_path / "b.log").read_text().startswith(f"$ {sys.executable} -c pass")

