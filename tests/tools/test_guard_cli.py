"""The guard from the command line: a run whose loss turns nan ends with exit 1 and one line
naming the step, the rank and the newest good checkpoint, said once for a job of several
ranks; a bad ``guard`` key is refused (exit 2) before anything is written; a run that rolls
back, SIGKILLed and resumed, logs the straight run's losses."""

from __future__ import annotations

import pytest

from tests.cli import CONFIG, SHORT, run, torchrun
from trainrun.cli import verify_resume as vr
from trainrun.cli.train import main as train_main

# 40 steps, a checkpoint every 10; on one process, 32 samples a step: sample 800 is step 26's
DAMAGED = [*SHORT, "schedule.max_epochs=null", "schedule.max_iters=40", "checkpoint.interval=10",
           "logging.interval=10", "data.train.type=tests.tools.models.DamagedDigits",
           "data.train.shuffle=false", "data.train.bad=[800]"]


def test_a_nan_loss_ends_the_run_with_one_line_and_exit_1(tmp_path, capfd, clean_env):
    code = train_main([str(CONFIG), "--launcher", "none", "--work-dir", str(tmp_path / "run"),
                       "--cfg-options", *DAMAGED, "strategy.type=none"])
    err = capfd.readouterr().err
    assert code == 1
    assert err.splitlines()[-1] == ("rank 0, step 26: GuardStop: loss is nan; stopped (guard: "
                                    "stop); iter_20.pth is the newest good checkpoint"), err
    assert "Traceback" not in err
    assert "WARNING guard: step 26, rank 0: loss is nan; stopping" in err


def test_a_bad_guard_key_is_refused_before_anything_is_written(tmp_path, capfd, clean_env):
    code = train_main([str(CONFIG), "--launcher", "none", "--work-dir", str(tmp_path / "run"),
                       "--cfg-options", "guard.nonfinite=rollbak"])
    assert code == 2 and not (tmp_path / "run").exists()
    assert capfd.readouterr().err.strip().splitlines()[-1] == (
        "error: guard.nonfinite: got 'rollbak', expected one of stop, rollback, warn, "
        "skip_step; did you mean 'rollback'?")


@pytest.mark.slow
def test_the_line_is_said_once_for_a_job_of_two_ranks(tmp_path):
    """The damaged sample is rank 1's (its share is the odd ones, 32 a step: sample 801 is the
    401st, in step 13): both ranks stop at the same step, and rank 0 alone says so, naming
    rank 1."""
    done = run(torchrun(str(CONFIG), "--launcher", "pytorch", "--work-dir",
                        str(tmp_path / "run"), "--cfg-options", *DAMAGED[:-1],
                        "data.train.bad=[801]"))
    lines = [line for line in done.stderr.splitlines() if "GuardStop" in line]
    assert lines == ["rank 1, step 13: GuardStop: loss is nan; stopped (guard: stop); "
                     "iter_10.pth is the newest good checkpoint"], done.stderr[-3000:]
    assert "exitcode  : 1" in done.stderr


@pytest.mark.slow
@pytest.mark.usefixtures("child_env")
def test_a_rolled_back_run_killed_with_sigkill_resumes_exactly(capsys):
    """``trainrun verify-resume``: a run that rolls back at step 15 (sample 897 is rank 1's,
    in step 15), SIGKILLed after its step-10 checkpoint and resumed, rolls back alike and logs
    the straight run's losses bit for bit. (A kill after the rollback: test_guard.py.)"""
    code = vr.main([str(CONFIG), "--nproc", "2", "--steps", "20", "--cfg-options",
                    "data.train.type=tests.tools.models.DamagedDigits",
                    "data.train.shuffle=false", "data.train.bad=[897]",
                    "guard.nonfinite=rollback", "guard.skip_batches=2"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert any(line.startswith("interrupted: killed with SIGKILL after step 10")
               for line in out.splitlines()), out
    assert "exact resume: the losses of steps 1-20 match bit for bit" in out
