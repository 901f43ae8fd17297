"""tools/train.py, tools/test.py, tools/dist_train.sh and tools/plot_metrics.py end to end:
real processes, real torchrun, the shipped digits config made short with --cfg-options."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli import CONFIG, REPO, SHORT, SLOW, TRAIN, env, run, torchrun
from tests.records import train_records, val_records
from tests.runner.toy import flip_byte
from trainrun.dist.launch import free_port

# ---------------------------------------------------------------- training under torchrun

@pytest.mark.slow
def test_train_under_torchrun_leaves_the_run_directory(digits_run):
    work_dir, done = digits_run
    assert {"config.yaml", "metrics.jsonl", "train.log", "checkpoints"} <= {
        p.name for p in work_dir.iterdir()}
    assert (work_dir / "checkpoints" / "last").read_text().strip() == "epoch_2.pth"
    config = (work_dir / "config.yaml").read_text()
    assert "max_epochs: 2" in config and "${" not in config  # overrides and interpolation applied
    assert f"work_dir: {work_dir}" in config
    steps = [r["step"] for r in train_records(work_dir)]
    assert steps == [5, 10, 15, 20, 25, 30, 35, 40]  # 20 steps an epoch, logged every 5
    assert all(isinstance(r["loss"], float) for r in train_records(work_dir))
    val = val_records(work_dir)
    assert [r["step"] for r in val] == [20, 40] and val[-1]["accuracy"] > 0.8
    log = (work_dir / "train.log").read_text()
    assert "validation at step 40" in log
    assert "[rank 1]" not in done.stderr  # only rank 0 logs training


RECORD = ("config.yaml", "metrics.jsonl", "train.log", "checkpoints/last",
          "checkpoints/epoch_2.pth")


@pytest.mark.slow
def test_test_tool_scores_a_checkpoint_in_a_directory_of_its_own(digits_run, tmp_path):
    """tools/test.py on the trained run (its own work_dir): the scores go to
    ``test/epoch_2/scores.json`` there, with the test's config.yaml and test.log; the
    training run's record stays byte for byte as it was. ``--out`` puts them elsewhere, but
    never into a training run's directory."""
    work_dir, _ = digits_run
    checkpoint = work_dir / "checkpoints" / "epoch_2.pth"
    before = {name: (work_dir / name).read_bytes() for name in RECORD}
    test = [sys.executable, str(REPO / "tools" / "test.py"), str(CONFIG), str(checkpoint),
            "--launcher", "none", "--work-dir", str(work_dir)]
    done = run(test)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "loaded weights from" in done.stderr and "test: accuracy 0." in done.stderr
    assert {name: (work_dir / name).read_bytes() for name in RECORD} == before
    own = work_dir / "test" / "epoch_2"
    assert sorted(p.name for p in own.iterdir()) == ["config.yaml", "scores.json", "test.log"]
    scores = json.loads((own / "scores.json").read_text())
    assert scores["checkpoint"] == str(checkpoint)
    assert scores["data"]["split"] == "test" and scores["data"]["type"] == "digits"
    assert set(scores["metrics"]) == {"accuracy"} and 0.8 < scores["metrics"]["accuracy"] <= 1
    assert f"test: accuracy {scores['metrics']['accuracy']:.4f}" in done.stderr
    assert f"test: scores written to {own / 'scores.json'}" in (own / "test.log").read_text()
    config = (own / "config.yaml").read_text()
    assert f"load_from: {checkpoint}" in config and "launcher: none" in config

    done = run([*test, "--out", str(tmp_path / "elsewhere")])
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "elsewhere" / "scores.json").read_text())["metrics"] == \
        scores["metrics"]
    for out in (work_dir, work_dir / "checkpoints" / "x"):
        done = run([*test, "--out", str(out)])
        assert done.returncode == 2 and "a test never writes" in done.stderr, done.stderr
    assert {name: (work_dir / name).read_bytes() for name in RECORD} == before
    assert not (work_dir / "checkpoints" / "x").exists()


@pytest.mark.slow
def test_plot_metrics_draws_a_png(digits_run, tmp_path):
    work_dir, _ = digits_run
    out = tmp_path / "curves.png"
    done = run([sys.executable, str(REPO / "tools" / "plot_metrics.py"), str(work_dir),
                str(work_dir), "-o", str(out)])
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "2 panels" in done.stdout  # train loss, val accuracy
    missing = run([sys.executable, str(REPO / "tools" / "plot_metrics.py"),
                   str(tmp_path / "nowhere"), "-o", str(tmp_path / "x.png")])
    assert missing.returncode == 2 and "no metrics.jsonl" in missing.stderr


# ---------------------------------------------------------------- damaged checkpoints

@pytest.mark.slow
def test_a_damaged_checkpoint_is_refused_by_test_and_passed_over_by_resume(digits_run, tmp_path):
    """One byte flipped in the newest checkpoint of a copy of the trained run: tools/test.py
    refuses it with one line naming it and the file; --resume says it skipped it and why,
    goes on from the one before, and logs the very losses of the run that was not damaged."""
    work_dir, _ = digits_run
    copy = tmp_path / "run"
    shutil.copytree(work_dir, copy)
    damaged = copy / "checkpoints" / "epoch_2.pth"
    flip_byte(damaged)
    done = run([sys.executable, str(REPO / "tools" / "test.py"), str(CONFIG), str(damaged),
                "--launcher", "none", "--work-dir", str(tmp_path / "test")], timeout=60)
    assert done.returncode == 2, done.stderr[-3000:]
    assert [line for line in done.stderr.splitlines() if line.startswith("error:")] == [
        f"error: load_from: {damaged} is damaged: epoch_2.pth: sha256 mismatch (against "
        "epoch_2.pth.sha256)"]
    assert "Traceback" not in done.stderr and not (tmp_path / "test").exists()

    done = run(torchrun(str(CONFIG), "--launcher", "pytorch", "--work-dir", str(copy),
                        "--resume", "--cfg-options", *SHORT))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count(f"resume: skipped: {damaged} is damaged: epoch_2.pth: sha256 "
                             "mismatch (against epoch_2.pth.sha256)") == 1, done.stderr
    assert f"resumed from {copy / 'checkpoints' / 'epoch_1.pth'} at epoch 2" in done.stderr
    unbroken = train_records(work_dir)
    again = train_records(copy)  # the lines of the steps after epoch_1 taken out: each once
    assert [r["step"] for r in again] == [5, 10, 15, 20, 25, 30, 35, 40]
    assert [r["loss"] for r in again] == [r["loss"] for r in unbroken]  # bit for bit


FEW = ["schedule.max_epochs=null", "schedule.max_iters=6", "schedule.val_interval=6",
       "checkpoint.interval=2", "logging.interval=1"]


@pytest.mark.slow
@pytest.mark.parametrize(("options", "file"), [
    (["strategy.type=fsdp"], "__1_0.distcp"),
    (["strategy.type=deepspeed", "strategy.zero_stage=3"],
     "state/zero_pp_rank_1_mp_rank_00_optim_states.pt"),
], ids=["fsdp", "zero3"])
def test_resume_passes_over_a_damaged_sharded_checkpoint(tmp_path, options, file):
    """A byte flipped in rank 1's shard (fsdp) or partition file (ZeRO-3) of the newest
    checkpoint: --resume skips it, naming the file, and goes on exactly from the one before."""
    work_dir = tmp_path / "run"
    start = [str(CONFIG), "--launcher", "pytorch", "--work-dir", str(work_dir)]
    done = run(torchrun(*start, "--cfg-options", *FEW, *options))
    assert done.returncode == 0, done.stderr[-3000:]
    unbroken = train_records(work_dir)
    assert [r["step"] for r in unbroken] == [1, 2, 3, 4, 5, 6]
    flip_byte(work_dir / "checkpoints" / "iter_6.pth" / file)
    done = run(torchrun(*start, "--resume", "--cfg-options", *FEW, *options))
    assert done.returncode == 0, done.stderr[-3000:]
    damaged = work_dir / "checkpoints" / "iter_6.pth"
    assert done.stderr.count(f"resume: skipped: {damaged} is damaged: {file}: sha256 mismatch "
                             "(against SHA256SUMS)") == 1, done.stderr[-3000:]
    assert f"resumed from {work_dir / 'checkpoints' / 'iter_4.pth'} at epoch" in done.stderr
    again = train_records(work_dir)  # steps 5 and 6 once, logged again after the resume
    assert [(r["step"], r["loss"]) for r in again] == [(r["step"], r["loss"])
                                                       for r in unbroken]  # bit for bit


# ---------------------------------------------------------------- exact resume after SIGKILL

# (SIGKILL then --resume under ddp, fsdp and ZeRO-3 is tools/verify_resume.py's test, in
# tests/tools/test_verify_resume.py; the uninterrupted SLOW run the tests below compare
# against is the fixture straight_run, tests/runs.py)

def _signal_after_checkpoint(cmd: list[str], work_dir: Path, checkpoint: str,
                             signum: int) -> subprocess.CompletedProcess:
    """Start ``cmd``, send ``signum`` to its first process once ``checkpoint`` is the newest,
    and let it end by itself."""
    last = work_dir / "checkpoints" / "last"
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 120
    while not (last.exists() and last.read_text().strip() == checkpoint):
        assert proc.poll() is None, f"the job ended before {checkpoint}"
        assert time.monotonic() < deadline, f"no {checkpoint} within 120 s"
        time.sleep(0.01)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.slow
def test_sigterm_to_torchrun_checkpoints_and_resumes_exactly(tmp_path, straight_run):
    """torchrun passes SIGTERM on to its workers: they agree on a step, save a checkpoint
    there and stop; --resume then logs the losses of a job that never stopped."""
    stopped = tmp_path / "stopped"
    straight = straight_run()
    done = _signal_after_checkpoint(torchrun(str(CONFIG), "--launcher", "pytorch",
                                             "--work-dir", str(stopped), "--cfg-options", *SLOW),
                                    stopped, "iter_10.pth", signal.SIGTERM)
    assert "preempted: stopped by SIGTERM after step" in done.stderr, done.stderr[-3000:]
    last = (stopped / "checkpoints" / "last").read_text().strip()
    step = int(last.removeprefix("iter_").removesuffix(".pth"))
    assert 10 <= step < 40  # the step the ranks agreed on (10 if the signal came that early)
    assert max(r["step"] for r in train_records(stopped)) == step

    done = run(torchrun(str(CONFIG), "--launcher", "pytorch", "--work-dir", str(stopped),
                        "--resume", "--cfg-options", *SLOW))
    assert done.returncode == 0, done.stderr[-3000:]
    expected = {r["step"]: r["loss"] for r in train_records(straight)}
    resumed = train_records(stopped)
    assert [r["step"] for r in resumed] == [*range(1, step + 1), *range(step + 1, 41)]
    assert all(r["loss"] == expected[r["step"]] for r in resumed)  # bit for bit


@pytest.mark.slow
@pytest.mark.parametrize("signum, options", [(signal.SIGUSR1, []),
                                             (signal.SIGUSR2, ["preemption.signals=[USR2]"])],
                         ids=["SIGUSR1", "preemption.signals"])
def test_a_stop_signal_to_a_single_process_exits_75_after_a_checkpoint(tmp_path, signum,
                                                                      options):
    """What ``sbatch --signal=USR1@60`` sends (or the signal ``preemption.signals`` names), to
    a run without a launcher: exit code 75."""
    config = REPO / "configs" / "digits_single.yaml"
    done = _signal_after_checkpoint(
        [sys.executable, str(TRAIN), str(config), "--work-dir", str(tmp_path), "--cfg-options",
         *SLOW, *options], tmp_path, "iter_10.pth", signum)
    assert done.returncode == 75, done.stderr[-3000:]
    assert f"preempted: stopped by {signum.name}" in done.stderr
    assert "written; run the same command with --resume to continue from it" in done.stderr
    assert "Traceback" not in done.stderr
    last = (tmp_path / "checkpoints" / "last").read_text().strip()
    assert max(r["step"] for r in train_records(tmp_path)) == int(last[5:-4]) < 40


# scancel's signal goes through slurmctld and slurmd to the job's tasks, which can take
# seconds on a loaded machine: 30 steps of 0.2 s after iter_10 leave it that room (the
# sleep changes no loss, so the job still matches the SLOW straight run)
SLURM_SIGNAL_ROOM = ["model.step_seconds=0.2"]


@pytest.mark.slow
def test_an_sbatch_job_signalled_requeues_itself_and_resumes_exactly(slurm, tmp_path,
                                                                     straight_run):
    """tools/slurm_train.sbatch on the local SLURM: SIGUSR1 to its tasks (what
    ``--signal=USR1@120`` sends before the time limit) makes them checkpoint, requeue the
    job and exit; the requeued job resumes and ends with the losses of an unbroken run."""
    work_dir = tmp_path / "job"
    straight = straight_run()
    output = tmp_path / "job.out"
    job = slurm.submit(REPO / "tools" / "slurm_train.sbatch", "-n", "2", f"--chdir={REPO}",
                       f"--output={output}",
                       env={**env(), "CONFIG": str(CONFIG), "PYTHON": sys.executable},
                       script_args=["--work-dir", str(work_dir), "--cfg-options", *SLOW,
                                    *SLURM_SIGNAL_ROOM])
    last = work_dir / "checkpoints" / "last"
    deadline = time.monotonic() + 120
    while not (last.exists() and last.read_text().strip() == "iter_10.pth"):
        assert slurm.job_state(job) in ("PENDING", "RUNNING"), output.read_text()
        assert time.monotonic() < deadline, "no iter_10.pth within 120 s"
        time.sleep(0.05)
    signalled = slurm.run("scancel", "--signal=USR1", str(job), timeout=10)
    assert signalled.returncode == 0, signalled.stderr
    deadline = time.monotonic() + 90
    while (info := slurm.job_info(job))["Restarts"] == "0" or info["JobState"] != "PENDING":
        assert info["JobState"] not in ("COMPLETED", "FAILED"), output.read_text()[-3000:]
        assert time.monotonic() < deadline, f"not requeued within 90 s: {info['JobState']}"
        time.sleep(0.1)
    # SLURM starts a requeued job again once the job's credentials have expired (cred_expire,
    # 10 s on the test cluster; 120 s by default); releasing it sooner can fail its launch
    info = slurm.wait_job(job, timeout=120)
    log = output.read_text()
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "1"), \
        log[-3000:] + "\n" + slurm.logs()
    assert "preempted: stopped by SIGUSR1 after step" in log and "the job is requeued" in log
    assert log.count("step exit 0") == 1, log[-3000:]

    expected = {r["step"]: r["loss"] for r in train_records(straight)}
    stop = int(log.split("stopped by SIGUSR1 after step ")[1].split(";")[0])
    assert 10 <= stop < 40 and f"iter_{stop}.pth at epoch" in log  # resumed right there
    records = train_records(work_dir)  # the stop's step is its checkpoint's: no step twice
    assert [r["step"] for r in records] == list(range(1, 41))
    assert all(r["loss"] == expected[r["step"]] for r in records)  # bit for bit


@pytest.mark.slow
def test_slurm_train_sh_trains_with_srun(slurm, tmp_path):
    script = str(REPO / "tools" / "slurm_train.sh")
    usage = subprocess.run(["bash", script, "debug"], capture_output=True, text=True)
    assert usage.returncode == 2 and "usage:" in usage.stderr
    done = slurm.run("bash", script, "debug", "trainrun-test", str(CONFIG), "--work-dir",
                     str(tmp_path), "--cfg-options", *SLOW, "model.step_seconds=0",
                     env={**env(), "TASKS": "2", "GPUS_PER_TASK": "0", "CPUS_PER_TASK": "1",
                          "SRUN_ARGS": "--time=5", "PYTHON": sys.executable}, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in train_records(tmp_path)] == list(range(1, 41))
    assert "launcher: slurm" in (tmp_path / "config.yaml").read_text()


@pytest.mark.slow
def test_resume_mid_epoch_with_dist_train_sh(tmp_path):
    """tools/dist_train.sh, and a checkpoint in the middle of epoch 1 (step 10): the run is
    trained through, then resumed from that checkpoint, and steps 11-16 come out the same."""
    resumed = tmp_path / "resumed"
    script = str(REPO / "tools" / "dist_train.sh")
    options = [*SLOW, "schedule.max_iters=16", "model.step_seconds=0"]
    done = run([script, str(CONFIG), "2", "--work-dir", str(resumed), "--cfg-options",
                *options])
    assert done.returncode == 0, done.stderr[-3000:]
    expected = {r["step"]: r["loss"] for r in train_records(resumed)}
    assert sorted(expected) == list(range(1, 17))
    # cut the run back to its step-10 checkpoint, as if it had died at step 13
    (resumed / "checkpoints" / "last").write_text("iter_10.pth\n")
    done = run([script, str(CONFIG), "2", "--work-dir", str(resumed), "--resume",
                str(resumed / "checkpoints" / "iter_10.pth"), "--cfg-options", *options])
    assert done.returncode == 0, done.stderr[-3000:]
    again = train_records(resumed)  # steps 11-16 of the first run taken out, logged again
    assert [r["step"] for r in again] == list(range(1, 17))
    assert all(r["loss"] == expected[r["step"]] for r in again)


# ---------------------------------------------------------------- refusing and failing

# the full list of refused inputs is tests/tools/test_bad_input.py (in process); these two
# go through a real process
def test_missing_config_file_and_bad_flag(tmp_path):
    done = run([sys.executable, str(TRAIN), str(tmp_path / "nope.yaml")], timeout=60)
    assert done.returncode == 2 and "nope.yaml" in done.stderr
    assert "Traceback" not in done.stderr
    done = run([sys.executable, str(TRAIN), str(CONFIG), "--launcher", "torch"], timeout=60)
    assert done.returncode == 2 and "--launcher" in done.stderr


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path):
    work_dir = tmp_path / "run"
    done = run([sys.executable, str(TRAIN), str(CONFIG), "--launcher", "none", "--dry-run",
                "--work-dir", str(work_dir), "--cfg-options", "optim.accumulate=2"], timeout=60)
    assert done.returncode == 0, done.stderr
    assert "effective 32 x 1 ranks x 2 accumulated = 64" in done.stdout, done.stdout
    assert "40 per epoch" in done.stdout
    assert not work_dir.exists()


ONE_EPOCH = ["schedule.max_epochs=1", "logging.interval=5", "checkpoint.interval=1"]


def _assert_trained_one_epoch(work_dir: Path) -> None:
    assert [r["step"] for r in train_records(work_dir)] == [5, 10, 15, 20]  # 2 ranks x 32
    assert (work_dir / "checkpoints" / "last").read_text().strip() == "epoch_1.pth"


@pytest.mark.slow
def test_train_under_mpirun(tmp_path):
    if not shutil.which("mpirun"):
        pytest.skip("mpirun is not installed (Debian: apt-get install openmpi-bin)")
    as_root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    done = run(["mpirun", "-np", "2", *as_root, "--oversubscribe", "-x", "PYTHONPATH",
                "-x", "OMP_NUM_THREADS", "-x", f"MASTER_PORT={free_port()}", sys.executable,
                str(TRAIN), str(CONFIG), "--launcher", "mpi", "--work-dir", str(tmp_path),
                "--cfg-options", *ONE_EPOCH])
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_trained_one_epoch(tmp_path)


@pytest.mark.slow
def test_train_under_srun(slurm, tmp_path):
    done = slurm.srun("-n", "2", sys.executable, str(TRAIN), str(CONFIG), "--launcher", "slurm",
                      "--work-dir", str(tmp_path), "--cfg-options", *ONE_EPOCH, env=env(),
                      timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_trained_one_epoch(tmp_path)
