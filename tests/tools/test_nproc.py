"""``trainrun train CONFIG --nproc N`` (and ``tools/train.py``, ``tools/dist_train.sh``): the
config checked here, then N workers under torch's elastic launcher; a failing worker's own
line ends the output, with its exit code. Real processes, real torchrun. (A bad config that
starts no worker is among the cases of tests/tools/test_bad_input.py.)"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli import CONFIG, TRAIN, env
from tests.records import train_records
from tests.tools.newcomer import user_project
from trainrun.cli.launch import Report, launch_command, worst_ending
from trainrun.cli.processes import alive, descendants
from trainrun.cli.train import train_parser, worker_args

# 22 steps: 20 make an epoch on 2 ranks (40 on one), so step 21 is in epoch 2 only on 2
FEW = ["schedule.max_epochs=null", "schedule.max_iters=22", "schedule.val_interval=22",
       "checkpoint.interval=22", "logging.interval=1"]


def nproc(*args: str, cwd: Path | None = None,
          timeout: float = 120) -> subprocess.CompletedProcess:
    """``python tools/train.py ARGS`` with its output and errors as one stream, in order."""
    return subprocess.run([sys.executable, str(TRAIN), *args], cwd=cwd, env=env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)


# ---------------------------------------------------------------- in this process

def test_the_workers_get_every_option_but_nproc():
    """Every option of ``trainrun train`` reaches the workers (a new option left out of
    ``worker_args`` fails here), under ``--launcher pytorch``."""
    given = ["cfg.yaml", "--launcher", "none", "--work-dir", "runs/x", "--resume", "ck.pth",
             "--force", "--amp", "--nproc", "3", "--dry-run", "--world-size", "3",
             "--local-rank", "1", "--cfg-options", "optim.lr=0.1", "model.hidden=8"]
    parser = train_parser()
    args = parser.parse_args(given)
    defaults = parser.parse_args(["cfg.yaml"])
    unset = [name for name, value in vars(args).items() if value == getattr(defaults, name)]
    assert unset == ["config"], f"give the test a value for {unset}"
    passed = parser.parse_args(worker_args(args))
    expected = {**vars(args), "launcher": "pytorch", "nproc": None, "local_rank": None}
    assert vars(passed) == expected
    assert parser.parse_args(worker_args(parser.parse_args(["c.yaml", "--resume"]))).resume \
        is True
    assert launch_command(2, ["c.yaml", "--launcher", "pytorch"]) == [
        "--standalone", "--nproc_per_node", "2", "-m", "trainrun", "train", "c.yaml",
        "--launcher", "pytorch"]


def test_the_line_of_the_first_failure_ends_the_job():
    failing = Report(1, 1, "rank 1, step 3: RuntimeError: boom", time=2.0)
    told = Report(0, 1, "error: stopping every rank: rank 1 failed at step 3", peer=True,
                  time=1.0)
    assert worst_ending([told, failing]) == (1, "rank 1, step 3: RuntimeError: boom")
    assert worst_ending([told]) == (1, told.line)  # rank 1 left nothing: the peer's word
    preempted = [Report(0, 75, "preempted: stopped by SIGTERM after step 9", time=2.0),
                 Report(1, 75, None, time=1.0)]  # rank 0 speaks for the job
    assert worst_ending(preempted, signum=signal.SIGTERM) == (75, preempted[0].line)
    assert worst_ending([Report(0, 0, None)], failure=(1, -9)) == (137,
                                                                    "rank 1: killed by SIGKILL")
    assert worst_ending([], failure=(0, 3)) == (
        3, "rank 0: exited with code 3 (its output above says why)")
    assert worst_ending([], signum=signal.SIGINT) == (130, "stopped by SIGINT")
    assert worst_ending([Report(0, 0, None), Report(1, 0, None)]) == (0, None)


# ---------------------------------------------------------------- real workers

@pytest.mark.slow
def test_nproc_trains_on_that_many_workers_importing_from_the_working_directory(tmp_path):
    """Two workers started from a researcher's directory: the model beside the config is
    found by the check here and by each worker (they inherit the working directory)."""
    project = user_project(tmp_path / "project")
    done = nproc(str(CONFIG), "--nproc", "2", "--work-dir", "run", "--cfg-options",
                 "model.type=my_model.Net", *FEW, cwd=project)
    assert done.returncode == 0, done.stdout[-3000:]
    epochs = {r["step"]: r["epoch"] for r in train_records(project / "run")}
    assert sorted(epochs) == list(range(1, 23))
    assert (epochs[20], epochs[21]) == (1, 2)  # 20 steps an epoch: 2 ranks of 32 a step
    config = (project / "run" / "config.yaml").read_text()
    assert "launcher: pytorch" in config and "type: my_model.Net" in config
    assert "Traceback" not in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize(("options", "code", "last"), [
    (["model.type=tests.tools.models.FailingDigitsMLP", "model.fail_at=3",
      "model.fail_rank=1"], 1, r"rank 1, step 3: RuntimeError: injected failure \(pid \d+\)"),
    (["hooks=[{type: EarlyStopping, metric: acuracy}]"], 2,  # by building the hooks: no worker
     re.escape("error: hooks[0].metric: got 'acuracy', expected one of the validation "
               "metrics: accuracy; did you mean 'accuracy'?")),
], ids=["failure", "config"])
def test_a_failing_worker_has_the_last_word_and_its_exit_code(tmp_path, options, code, last):
    done = nproc(str(CONFIG), "--nproc", "2", "--work-dir", str(tmp_path / "run"),
                 "--cfg-options", *FEW, *options)
    lines = done.stdout.rstrip("\n").splitlines()
    assert done.returncode == code, done.stdout[-3000:]
    assert re.fullmatch(last, lines[-1]), done.stdout[-3000:]
    assert "ChildFailedError" not in done.stdout  # torchrun's traceback is not shown


@pytest.mark.slow
def test_sigterm_reaches_the_workers_which_checkpoint_and_stop(tmp_path):
    """SIGTERM to the process that started the workers: torchrun's agent passes it on, the
    workers save a checkpoint at a step they agree on and stop; the job exits 75 with rank
    0's line last, and no worker is left behind."""
    work_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, str(TRAIN), str(CONFIG), "--nproc", "2", "--work-dir", str(work_dir),
         "--cfg-options", "schedule.max_epochs=null", "schedule.max_iters=4000",
         "schedule.val_interval=4000", "checkpoint.interval=10", "logging.interval=1",
         "model.type=tests.tools.models.SlowDigitsMLP", "model.step_seconds=0.01"],
        env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    last = work_dir / "checkpoints" / "last"
    deadline = time.monotonic() + 90
    while not last.exists():
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "no checkpoint within 90 s"
        time.sleep(0.02)
    workers = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 75, out[-3000:]
    assert re.fullmatch(r"preempted: stopped by SIGTERM after step \d+; checkpoint iter_\d+"
                        r"\.pth written; run the same command with --resume to continue "
                        r"from it", out.rstrip("\n").splitlines()[-1]), out[-3000:]
    step = int(last.read_text().strip().removeprefix("iter_").removesuffix(".pth"))
    assert max(r["step"] for r in train_records(work_dir)) == step < 4000
    assert not [pid for pid in workers if alive(pid)]
