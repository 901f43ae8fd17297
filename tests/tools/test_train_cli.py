"""tools/train.py, tools/test.py, tools/dist_train.sh and tools/plot_metrics.py end to end:
real processes, real torchrun, the shipped digits config made short with --cfg-options."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.procs import free_port
from tests.runner.test_manifest import flip_byte
from tests.slurm_cluster import client_env

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "tools" / "train.py"
CONFIG = REPO / "configs" / "digits_ddp.yaml"
SHORT = ["schedule.max_epochs=2", "checkpoint.interval=1", "logging.interval=5"]


def env() -> dict[str, str]:
    """This environment with the repository importable (test models live in tests/) and one
    thread per process (2 processes share 2 cores)."""
    out = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), out.get("PYTHONPATH")]))
    out["OMP_NUM_THREADS"] = "1"
    return out


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_port", str(free_port()), str(TRAIN), *args]


def run(cmd: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env())


def train_records(work_dir: Path) -> list[dict]:
    lines = (work_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "mode" not in r]


def val_records(work_dir: Path) -> list[dict]:
    lines = (work_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("mode") == "val"]


# ---------------------------------------------------------------- training under torchrun

@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """digits_ddp for 2 epochs on 2 processes under torchrun."""
    work_dir = tmp_path_factory.mktemp("cli") / "digits"
    done = run(torchrun(str(CONFIG), "--launcher", "pytorch", "--work-dir", str(work_dir),
                        "--cfg-options", *SHORT))
    assert done.returncode == 0, done.stderr[-4000:]
    return work_dir, done


@pytest.mark.slow
def test_train_under_torchrun_leaves_the_run_directory(trained):
    work_dir, done = trained
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


@pytest.mark.slow
def test_test_tool_scores_a_checkpoint(trained):
    work_dir, _ = trained
    done = run([sys.executable, str(REPO / "tools" / "test.py"), str(CONFIG),
                str(work_dir / "checkpoints" / "epoch_2.pth"), "--launcher", "none",
                "--work-dir", str(work_dir / "test")])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "loaded weights from" in done.stderr and "test: accuracy 0." in done.stderr


@pytest.mark.slow
def test_plot_metrics_draws_a_png(trained, tmp_path):
    work_dir, _ = trained
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
def test_a_damaged_checkpoint_is_refused_by_test_and_passed_over_by_resume(trained, tmp_path):
    """One byte flipped in the newest checkpoint of a copy of the trained run: tools/test.py
    refuses it with one line naming it and the file; --resume says it skipped it and why,
    goes on from the one before, and logs the very losses of the run that was not damaged."""
    work_dir, _ = trained
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
    again = train_records(copy)[len(unbroken):]
    assert [r["step"] for r in again] == [25, 30, 35, 40]
    assert [r["loss"] for r in again] == [r["loss"] for r in unbroken[4:]]  # bit for bit


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
    again = train_records(work_dir)[6:]
    assert [(r["step"], r["loss"]) for r in again] == [(r["step"], r["loss"])
                                                       for r in unbroken[4:]]  # bit for bit


# ---------------------------------------------------------------- exact resume after SIGKILL

SLOW = [*SHORT, "schedule.max_epochs=null", "schedule.max_iters=40", "schedule.val_interval=20",
        "checkpoint.interval=10", "logging.interval=1",
        "model.type=tests.tools.models.SlowDigitsMLP", "model.step_seconds=0.03"]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts its workers in sessions of their own, so
    killing torchrun's process group would leave them running)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it."""
    for each in [*descendants(pid), pid]:
        try:
            os.kill(each, signal.SIGKILL)
        except ProcessLookupError:
            pass


# (SIGKILL then --resume under ddp, fsdp and ZeRO-3 is tools/verify_resume.py's test, in
# tests/tools/test_verify_resume.py)

@pytest.fixture(scope="module")
def straight_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[], Path]:
    """``straight()``: the work_dir of an uninterrupted SLOW ddp run, trained once for all the
    tests that compare against it."""
    runs: list[tuple[Path, subprocess.CompletedProcess]] = []

    def straight() -> Path:
        if not runs:
            work_dir = tmp_path_factory.mktemp("straight") / "ddp"
            runs.append((work_dir, run(torchrun(str(CONFIG), "--launcher", "pytorch",
                                                "--work-dir", str(work_dir),
                                                "--cfg-options", *SLOW))))
        work_dir, done = runs[0]
        assert done.returncode == 0, done.stderr[-3000:]
        return work_dir

    return straight


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
                       script_args=["--work-dir", str(work_dir), "--cfg-options", *SLOW])
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
def test_a_job_into_a_run_directory_an_old_copy_still_writes_refuses_then_takes_over(
        slurm, tmp_path, straight_run):
    """A requeued (or doubly submitted) sbatch job whose old copy is still alive in the run
    directory (here one started outside SLURM's reach, as an old step SLURM failed to kill
    would be; its workers are held with SIGSTOP after its step-10 checkpoint, so that the
    losses can be compared with a 40-step run) fails at once, exit 2, naming the holder, and
    writes nothing. Once the old copy is dead, the next job takes the directory over, saying
    so, and resumes exactly."""
    straight = straight_run()
    options = [*SLOW, "model.step_seconds=0.1"]
    old = subprocess.Popen(torchrun(str(CONFIG), "--launcher", "pytorch", "--work-dir",
                                    str(tmp_path), "--cfg-options", *options),
                           env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    last = tmp_path / "checkpoints" / "last"
    try:
        while not (last.exists() and last.read_text().strip() == "iter_10.pth"):
            assert old.poll() is None, "the old copy ended before iter_10.pth"
            time.sleep(0.02)
        workers = [pid for pid in descendants(old.pid) if _alive(pid)]
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        holder = json.loads((tmp_path / "run.lock").read_text())

        def job(output: Path) -> tuple[dict[str, str], str]:
            job_id = slurm.submit(REPO / "tools" / "slurm_train.sbatch", "-n", "2",
                                  f"--chdir={REPO}", f"--output={output}",
                                  env={**env(), "CONFIG": str(CONFIG), "PYTHON": sys.executable},
                                  script_args=["--work-dir", str(tmp_path), "--cfg-options",
                                               *options])
            return slurm.wait_job(job_id, timeout=120), output.read_text()

        before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
        info, log = job(tmp_path.parent / "refused.out")
        # (the first rank to exit 2 makes srun --kill-on-bad-exit end the other)
        assert info["JobState"] == "FAILED" and \
            re.search(r"tasks? [-01]+: Exited with exit code 2", log), log[-3000:]
        assert f"is in use by another job (host {holder['host']}, pid {holder['pid']}, " \
               f"since {holder['since']}; lease renewed" in log, log[-3000:]
        assert old.poll() is None and all(_alive(pid) for pid in workers)
    finally:
        _kill_tree(old.pid)
        old.wait()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()
            if p.is_file() and p.name != "metrics.jsonl" and p.name != "train.log"} == \
        {k: v for k, v in before.items() if k not in ("metrics.jsonl", "train.log")}
    assert b"is in use" not in (tmp_path / "train.log").read_bytes()

    info, log = job(tmp_path.parent / "took-over.out")
    assert info["JobState"] == "COMPLETED", log[-3000:]
    assert f"took over {tmp_path} from host {holder['host']}, pid {holder['pid']}" in log
    assert f"its process {holder['pid']} no longer exists" in log
    expected = {r["step"]: r["loss"] for r in train_records(straight)}
    resumed = {r["step"]: r["loss"] for r in train_records(tmp_path)}  # the later run's wins
    assert sorted(resumed) == list(range(1, 41))
    assert all(loss == expected[step] for step, loss in resumed.items())  # bit for bit


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
    again = train_records(resumed)[16:]
    assert [r["step"] for r in again] == list(range(11, 17))
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


@pytest.mark.slow
def test_a_failing_rank_stops_every_rank_at_once_with_its_error(tmp_path):
    started = time.monotonic()
    done = run(torchrun(str(CONFIG), "--launcher", "pytorch", "--work-dir", str(tmp_path),
                        "--cfg-options", *SHORT, "model.type=tests.tools.models.FailingDigitsMLP",
                        "model.fail_at=3", "model.fail_rank=1", "dist_timeout=60"))
    assert time.monotonic() - started < 40  # nobody waited for the 60 s timeout
    assert done.returncode != 0
    assert "rank 1, step 3: RuntimeError: injected failure" in done.stderr, done.stderr[-3000:]
    # rank 0 says once why the job stopped, without a traceback of its own
    assert done.stderr.count("stopping every rank: rank 1 failed at step 3 in forward: "
                             "RuntimeError: injected failure") == 1, done.stderr[-3000:]
    assert done.stderr.count("training failed at step") == 1, done.stderr[-3000:]  # rank 1


def _worker_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of torchrun's worker of ``rank`` (the one with RANK=rank in its environment)."""
    for pid in descendants(launcher_pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    return None


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie that nobody reaped yet does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.mark.slow
def test_a_frozen_rank_ends_the_job_naming_it(tmp_path):
    """Rank 1 stopped with SIGSTOP after the first checkpoint: rank 0 names it (silent since
    when, last seen where) once ``dist_timeout`` has passed, and the job ends by itself."""
    last = tmp_path / "checkpoints" / "last"
    cmd = torchrun(str(CONFIG), "--launcher", "pytorch", "--work-dir", str(tmp_path),
                   "--cfg-options", *SLOW, "model.step_seconds=0.2", "dist_timeout=20")
    started = time.monotonic()
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        while not (last.exists() and last.read_text().strip() == "iter_10.pth"):
            assert proc.poll() is None, "the job ended before iter_10.pth"
            assert time.monotonic() - started < 120, "no iter_10.pth within 120 s"
            time.sleep(0.01)
        frozen = _worker_pid(proc.pid, 1)
        assert frozen is not None, "rank 1's process not found"
        os.kill(frozen, signal.SIGSTOP)
        stopped = time.monotonic()
        out, err = proc.communicate(timeout=90)
        ended = time.monotonic() - stopped
        assert not _alive(frozen), "the frozen rank was left behind"
    finally:
        _kill_tree(proc.pid)
    assert proc.returncode != 0 and ended < 90
    assert 20 <= ended, f"ended {ended:.0f} s after the freeze, before dist_timeout"
    lines = [line for line in err.splitlines() if "rank 1 silent for" in line]
    assert len(lines) == 1, err[-3000:]
    assert re.search(r"rank 1 silent for 2\d s, last seen at step 1[01] in [a-z_ ]+; "
                     r"rank 0 waiting at step 1[01] in [a-z_ ]+$", lines[0]), lines[0]


@pytest.mark.slow
def test_workers_of_a_killed_torchrun_stop_and_resume_exactly(tmp_path, straight_run):
    """torchrun SIGKILLed alone (an OOM killer, a container runtime): its workers, each in a
    session of its own, stop within seconds instead of training on, each saying in one line
    what is lost; they write nothing more, and --resume then continues exactly."""
    straight = straight_run()
    last = tmp_path / "checkpoints" / "last"
    options = [*SLOW, "model.step_seconds=0.1"]
    proc = subprocess.Popen(torchrun(str(CONFIG), "--launcher", "pytorch", "--work-dir",
                                     str(tmp_path), "--cfg-options", *options), env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers: list[int | None] = []
    try:
        while not (last.exists() and last.read_text().strip() == "iter_10.pth"):
            assert proc.poll() is None, "the job ended before iter_10.pth"
            time.sleep(0.01)
        workers = [_worker_pid(proc.pid, rank) for rank in (0, 1)]
        assert None not in workers, "a worker's process not found"
        os.kill(proc.pid, signal.SIGKILL)  # torchrun alone: its workers live in other sessions
        killed = time.monotonic()
        while any(_alive(pid) for pid in workers) and time.monotonic() - killed < 60:
            time.sleep(0.05)
        stopped = time.monotonic() - killed
        _, err = proc.communicate(timeout=30)  # the workers held the pipes
    finally:
        for pid in filter(None, workers):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert stopped < 60, f"the workers of a dead torchrun were still training after {stopped:.0f} s"
    lines = [line for line in err.splitlines() if "stopping: its launcher (torchrun, pid" in line]
    assert len(lines) == 2, err[-3000:]
    records = train_records(tmp_path)
    logged = max(r["step"] for r in records)
    assert 10 <= logged < 40, logged  # the kill landed mid-run
    for line in lines:  # what is lost, and where --resume goes on
        found = re.search(r"steps? (\d+)(?:-(\d+))? (?:is|are) lost since checkpoint "
                          r"iter_(\d+)\.pth \(step \3\); --resume continues from it$", line)
        assert found, line
        assert int(found.group(3)) == int(last.read_text().strip()[5:-4]) >= 10
        assert int(found.group(2) or found.group(1)) >= logged  # nothing after the stop
    done = run(torchrun(str(CONFIG), "--launcher", "pytorch", "--work-dir", str(tmp_path),
                        "--resume", "--cfg-options", *options))
    assert done.returncode == 0, done.stderr[-3000:]
    expected = {r["step"]: r["loss"] for r in train_records(straight)}
    resumed = {r["step"]: r["loss"] for r in train_records(tmp_path)}  # the later run's wins
    assert sorted(resumed) == list(range(1, 41))
    assert all(loss == expected[step] for step, loss in resumed.items())  # bit for bit


@pytest.mark.slow
def test_a_second_job_into_a_run_directory_in_use_is_refused(tmp_path):
    """Two torchrun jobs started into one run directory 2 s apart (a double submission): the
    second refuses before writing anything, exit 2, naming the holder; the first trains on
    undisturbed, every step logged once."""
    args = (str(CONFIG), "--launcher", "pytorch", "--work-dir", str(tmp_path), "--cfg-options",
            *SLOW, "model.step_seconds=0.25")
    first = subprocess.Popen(torchrun(*args), env=env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    time.sleep(2)
    second = run(torchrun(*args))
    while_second = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err[-3000:]
    # both workers exit 2 (torchrun itself then exits 1); rank 0 says why
    assert second.returncode != 0 and "exitcode  : 2" in second.stderr, second.stderr[-3000:]
    errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, second.stderr[-3000:]
    assert re.fullmatch(rf"error: work_dir: {tmp_path} is in use by another job \(host \S+, "
                        rf"pid \d+, since [-\d]+ [:\d]+; lease renewed \d+ s ago, "
                        rf"see {tmp_path / 'run.lock'}\): .*; wait for that job to end \(or stop "
                        rf"it\), or pass another --work-dir", errors[0]), errors[0]
    assert while_second["config.yaml"] == (tmp_path / "config.yaml").read_bytes()
    assert b"is in use" not in while_second["train.log"]  # its log went nowhere near
    assert [r["step"] for r in train_records(tmp_path)] == list(range(1, 41))
    assert not (tmp_path / "run.lock").exists()  # released at the end


@pytest.mark.slow
def test_torchrun_max_restarts_with_resume_continues_exactly_after_a_worker_dies(
        tmp_path, straight_run):
    """Elastic restarts: a worker SIGKILLed after the step-10 checkpoint; torchrun
    (--max-restarts 1) starts the workers again, --resume takes them back to the newest
    checkpoint, the log says which restart it is, and the losses are an unbroken run's."""
    straight = straight_run()
    last = tmp_path / "checkpoints" / "last"
    cmd = torchrun(str(CONFIG), "--launcher", "pytorch", "--work-dir", str(tmp_path), "--resume",
                   "--cfg-options", *SLOW, "model.step_seconds=0.1")
    proc = subprocess.Popen([*cmd[:3], "--max-restarts", "1", *cmd[3:]], env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        while not (last.exists() and last.read_text().strip() == "iter_10.pth"):
            assert proc.poll() is None, "the job ended before iter_10.pth"
            time.sleep(0.01)
        victim = _worker_pid(proc.pid, 1)
        assert victim is not None, "rank 1's process not found"
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        _kill_tree(proc.pid)
    assert proc.returncode == 0, err[-3000:]
    log = (tmp_path / "train.log").read_text()
    assert "torchrun restarted the workers: restart 1 of 1 (--max-restarts)" in log
    resumed_at = int(re.search(r"resumed from \S+iter_(\d+)\.pth", log).group(1))
    assert 10 <= resumed_at < 40  # the worker died mid-run
    expected = {r["step"]: r["loss"] for r in train_records(straight)}
    resumed = {r["step"]: r["loss"] for r in train_records(tmp_path)}  # the later run's wins
    assert sorted(resumed) == list(range(1, 41))
    assert all(loss == expected[step] for step, loss in resumed.items())  # bit for bit


# ---------------------------------------------------------------- the other launchers

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


def _python_processes_of(work_dir: Path) -> list[int]:
    """The Python processes training into ``work_dir`` (the launcher's own command line names
    it too, but runs another program)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if str(work_dir) in args and "python" in Path(args[0]).name:
            found.append(int(cmdline.parent.name))
    return found


LONG = [*SLOW, "schedule.max_iters=2000", "model.step_seconds=0.05"]  # 100 s if not stopped


def _kill_launcher_after_checkpoint(cmd: list[str], work_dir: Path, env_: dict[str, str]
                                    ) -> float:
    """Start ``cmd`` (a run of `LONG` steps), SIGKILL it (the launcher alone) once iter_10.pth
    is the newest checkpoint, and return how long its workers then took to end."""
    last = work_dir / "checkpoints" / "last"
    proc = subprocess.Popen(cmd, env=env_, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    workers: list[int] = []
    try:
        while not (last.exists() and last.read_text().strip() == "iter_10.pth"):
            assert proc.poll() is None, "the job ended before iter_10.pth: " + proc.stderr.read()
            time.sleep(0.01)
        workers = _python_processes_of(work_dir)
        assert len(workers) == 2, workers
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        while any(_alive(pid) for pid in workers) and time.monotonic() - killed < 60:
            time.sleep(0.05)
        return time.monotonic() - killed
    finally:
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        assert max(r["step"] for r in train_records(work_dir)) < 2000  # it landed mid-run


@pytest.mark.slow
def test_workers_of_a_killed_mpirun_stop(tmp_path):
    if not shutil.which("mpirun"):
        pytest.skip("mpirun is not installed (Debian: apt-get install openmpi-bin)")
    as_root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    seconds = _kill_launcher_after_checkpoint(
        ["mpirun", "-np", "2", *as_root, "--oversubscribe", "-x", "PYTHONPATH", "-x",
         "OMP_NUM_THREADS", "-x", f"MASTER_PORT={free_port()}", sys.executable, str(TRAIN),
         str(CONFIG), "--launcher", "mpi", "--work-dir", str(tmp_path), "--cfg-options",
         *LONG], tmp_path, env())
    assert seconds < 60, f"the workers of a dead mpirun were still training after {seconds:.0f} s"


@pytest.mark.slow
def test_tasks_of_a_killed_srun_stop(slurm, tmp_path):
    seconds = _kill_launcher_after_checkpoint(
        ["srun", "--immediate=20", "--time=5", "-n", "2", sys.executable, str(TRAIN),
         str(CONFIG), "--launcher", "slurm", "--work-dir", str(tmp_path), "--cfg-options",
         *LONG], tmp_path, client_env(slurm.conf, env()))
    assert seconds < 60, f"the tasks of a dead srun were still training after {seconds:.0f} s"


@pytest.mark.slow
def test_train_under_srun(slurm, tmp_path):
    done = slurm.srun("-n", "2", sys.executable, str(TRAIN), str(CONFIG), "--launcher", "slurm",
                      "--work-dir", str(tmp_path), "--cfg-options", *ONE_EPOCH, env=env(),
                      timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_trained_one_epoch(tmp_path)
