"""tools/train.py when the job goes wrong: a failing or frozen rank, killed launchers (torchrun,
mpirun, srun), a second job or an old copy writing into the same run directory, torchrun
restarting its workers. Real processes, as in test_train_cli.py (the helpers both use are
tests/cli.py's; the uninterrupted run they compare against is the fixture straight_run,
tests/runs.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest

from tests.cli import (
    CONFIG,
    REPO,
    SHORT,
    SLOW,
    TRAIN,
    env,
    kill_tree,
    run,
    torchrun,
    worker_pid,
)
from tests.limits import limit_files_to
from tests.records import train_records
from tests.slurm_cluster import client_env
from trainrun.checkpoint.manifest import verify_checkpoint
from trainrun.checkpoint.read import read_train_state, read_weights
from trainrun.cli.processes import alive, descendants
from trainrun.dist.launch import free_port


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
        workers = [pid for pid in descendants(old.pid) if alive(pid)]
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
        assert old.poll() is None and all(alive(pid) for pid in workers)
    finally:
        kill_tree(old.pid)
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
    resumed = [(r["step"], r["loss"]) for r in train_records(tmp_path)]
    assert [step for step, _ in resumed] == list(range(1, 41))  # each step once
    assert all(loss == expected[step] for step, loss in resumed)  # bit for bit


@pytest.mark.slow
def test_a_failing_rank_stops_every_rank_at_once_with_its_error(tmp_path):
    started = time.monotonic()
    done = run(torchrun(str(CONFIG), "--launcher", "pytorch", "--work-dir", str(tmp_path),
                        "--cfg-options", *SHORT, "model.type=tests.tools.models.FailingDigitsMLP",
                        "model.fail_at=3", "model.fail_rank=1", "dist_timeout=120"))
    assert time.monotonic() - started < 60  # nobody waited for the 120 s timeout
    assert done.returncode != 0
    assert "rank 1, step 3: RuntimeError: injected failure" in done.stderr, done.stderr[-3000:]
    # rank 0 says once why the job stopped, without a traceback of its own
    assert done.stderr.count("stopping every rank: rank 1 failed at step 3 in forward: "
                             "RuntimeError: injected failure") == 1, done.stderr[-3000:]
    assert done.stderr.count("training failed at step") == 1, done.stderr[-3000:]  # rank 1


@pytest.mark.slow
def test_a_checkpoint_the_file_system_refuses_ends_the_job_saying_why(tmp_path):
    """No file may grow past 128 KiB (digits' checkpoint is 250 KiB), as if the disk were full
    (a refused write is EFBIG here, not ENOSPC). Rank 0 cannot write epoch_1 (rank 0 writes
    ddp's checkpoint): it says why in one line (not torch's "unexpected pos"), rank 1 stops
    with rank 0's words, and nothing half-written is left in checkpoints/."""
    done = subprocess.run(torchrun(str(CONFIG), "--launcher", "pytorch", "--work-dir",
                                   str(tmp_path), "--cfg-options", *SHORT, "dist_timeout=120"),
                          capture_output=True, text=True, timeout=180, env=env(),
                          preexec_fn=partial(limit_files_to, 128 * 1024))
    assert done.returncode == 1, done.stderr[-3000:]
    said = re.findall(r"^rank 0, step \d+: CheckpointNotWritten: (.*)$", done.stderr, re.M)
    assert said, done.stderr[-3000:]
    assert said[0].startswith("checkpoint epoch_1.pth not written: File too large ("), said
    assert said[0].endswith("; the run has no checkpoint before it"), said
    assert "stopping every rank: rank 0 failed at step " in done.stderr, done.stderr[-3000:]
    assert list((tmp_path / "checkpoints").iterdir()) == []


@pytest.mark.slow
def test_a_frozen_rank_ends_the_job_naming_it(tmp_path):
    """Rank 1 stopped with SIGSTOP after the first checkpoint: rank 0 names it (silent since
    when, last seen where) once ``dist_timeout`` has passed, and ends. (torchrun then gives the
    frozen rank 30 s to die of its SIGTERM before SIGKILL, which is torchrun's own behaviour:
    the test kills it itself once rank 0 has ended.)"""
    last = tmp_path / "checkpoints" / "last"
    cmd = torchrun(str(CONFIG), "--launcher", "pytorch", "--work-dir", str(tmp_path),
                   "--cfg-options", *SLOW, "model.step_seconds=0.2", "dist_timeout=12")
    started = time.monotonic()
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        while not (last.exists() and last.read_text().strip() == "iter_10.pth"):
            assert proc.poll() is None, "the job ended before iter_10.pth"
            assert time.monotonic() - started < 120, "no iter_10.pth within 120 s"
            time.sleep(0.01)
        frozen, other = worker_pid(proc.pid, 1), worker_pid(proc.pid, 0)
        assert frozen is not None and other is not None, "the workers' processes not found"
        os.kill(frozen, signal.SIGSTOP)
        stopped = time.monotonic()
        while alive(other) and time.monotonic() - stopped < 90:
            time.sleep(0.05)
        ended = time.monotonic() - stopped
        os.kill(frozen, signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode != 0 and ended < 90, f"rank 0 still waiting {ended:.0f} s on"
    # silence counts from rank 1's last beat, up to one beat (1 s) before the freeze
    assert 11 <= ended, f"rank 0 ended {ended:.0f} s after the freeze, before dist_timeout"
    lines = [line for line in err.splitlines() if "rank 1 silent for" in line]
    assert len(lines) == 1, err[-3000:]
    # a phase is a name such as "forward", or a named collective such as "all_reduce(max)"
    # (the stop-signal check that rank 0 may be in when rank 1 froze); rank 1's last beat
    # came up to a beat (1 s: five 0.2 s steps) before the freeze: at step 5 to 11
    assert re.search(r"rank 1 silent for 1\d s, last seen at step ([5-9]|1[01]) in [a-z_() ]+; "
                     r"rank 0 waiting at step 1[01] in [a-z_() ]+$", lines[0]), lines[0]


# a hang after training: 1 epoch of 20 steps, a checkpoint at its end, a short timeout
AFTER = ["schedule.max_epochs=1", "checkpoint.interval=1", "logging.interval=5",
         "dist_timeout=10"]


def _hanging(tmp_path: Path, at: str, seconds: float = 3600.0) -> list[str]:
    """torchrun of 2 ranks whose rank 1 hangs once training is over (HangingHook's ``at``)."""
    hook = f"{{type: tests.tools.models.HangingHook, at: {at}, seconds: {seconds}, " \
        "priority: after_checkpoint}"
    return torchrun(str(CONFIG), "--launcher", "pytorch", "--work-dir", str(tmp_path),
                    "--cfg-options", *AFTER, f"hooks=[{hook}]")


@pytest.mark.slow
def test_a_rank_frozen_after_training_ends_the_job_naming_it_and_keeps_the_checkpoint(
        tmp_path):
    """Rank 1 stopped with SIGSTOP (by pid, from here) in its after_run hooks, after the last
    checkpoint: rank 0 waits for it at most dist_timeout, names it, and ends non-zero;
    torchrun then ends the frozen rank (SIGTERM, then SIGKILL 30 s later: its own way) and
    exits non-zero itself, within dist_timeout + 60 s of the freeze. The checkpoint published
    before stays published and whole."""
    marker = tmp_path / "hang_rank1.json"
    proc = subprocess.Popen(_hanging(tmp_path, "after_run", seconds=20), env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        while not marker.exists():  # rank 1 is in its after_run hook, sleeping 20 s
            assert proc.poll() is None, "the job ended before rank 1's after_run hook"
            time.sleep(0.01)
        time.sleep(0.05)  # the marker's text is written
        frozen = json.loads(marker.read_text())
        os.kill(frozen["pid"], signal.SIGSTOP)
        stopped = time.monotonic()
        assert alive(frozen["pid"]) and proc.poll() is None  # it landed mid-run
        _, err = proc.communicate(timeout=10 + 60 + 30)
        ended = time.monotonic() - stopped
    finally:
        kill_tree(proc.pid)
    assert frozen["step"] == 20, frozen  # after the last step
    assert proc.returncode != 0, err[-3000:]
    assert ended < 10 + 60, f"the job ended {ended:.0f} s after the freeze"
    named = [line for line in err.splitlines() if "stopping every rank: rank 1" in line]
    assert len(named) == 1, err[-3000:]  # once for the job, by rank 0
    assert re.search(r"rank 1 has not finished 10 s after rank 0 did \(hung after training\): "
                     r"rank 1 \(host \S+\) last seen at step 20 in after_run hooks \d+ s ago$",
                     named[0]), named[0]
    checkpoint = tmp_path / "checkpoints" / (tmp_path / "checkpoints" / "last").read_text().strip()
    assert checkpoint.name == "epoch_1.pth"
    assert verify_checkpoint(checkpoint, alone=True)  # every file its manifest lists, intact
    assert read_train_state(checkpoint)["meta"]["iter"] == 20
    assert read_weights(checkpoint)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == \
        ["epoch_1.pth", "epoch_1.pth.sha256", "last"]  # nothing half-written left


@pytest.mark.slow
@pytest.mark.parametrize("at", ["after_train", "exit"])
def test_a_rank_that_hangs_after_training_or_at_exit_ends_the_job_naming_it(tmp_path, at):
    """Rank 1 hangs in an after_train hook (after the last checkpoint: its heartbeat still
    runs, and ends it once rank 0 has named it) or at exit (an atexit handler that sleeps: it
    ends itself, naming itself, dist_timeout after its run ended). torchrun exits non-zero
    either way, within dist_timeout + 60 s of the end of training."""
    started = time.monotonic()
    done = run(_hanging(tmp_path, at), timeout=180)
    took = time.monotonic() - started
    assert done.returncode != 0, done.stderr[-3000:]
    assert (tmp_path / "hang_rank1.json").exists()  # it hung where it was meant to
    # (the start, training and the end: 10 to 20 s on this machine; the timeout is 10 s)
    assert took < 10 + 60, f"the job took {took:.0f} s"
    if at == "exit":
        named = re.findall(r"ERROR rank 1 \(pid \d+\): stuck at exit: its run ended 10 s ago",
                           done.stderr)
    else:
        named = re.findall(r"stopping every rank: rank 1 has not finished 10 s after rank 0 did "
                           r"\(hung after training\): rank 1 \(host \S+\) last seen at step 20 "
                           r"in after_train hooks", done.stderr)
    assert len(named) == 1, done.stderr[-3000:]
    assert (tmp_path / "exited_rank0").exists()  # rank 0 left its group: a normal shutdown


@pytest.mark.slow
def test_a_rank_whose_collective_timed_out_ends_without_the_interpreters_shutdown(tmp_path):
    """Rank 1 sleeps after step 5 while its heartbeat goes on: rank 0's collective times out
    (nobody is silent) and fails the run, leaving its group joined; rank 0 then ends with its
    exit code at once, skipping the interpreter's shutdown (its atexit handlers), which would
    tear gloo down with the failed operation queued and now and then abort (-6). The ranks
    that end normally still shut down as before."""
    done = run(_hanging(tmp_path, "step_5", seconds=60), timeout=180)
    assert done.returncode != 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "hang_rank1.json").read_text())["step"] == 5
    assert "stopping every rank: no rank is silent" in done.stderr, done.stderr[-3000:]
    assert "exitcode  : 1" in done.stderr and "-6" not in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "exited_rank0").exists()  # os._exit, after its last words


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
        workers = [worker_pid(proc.pid, rank) for rank in (0, 1)]
        assert None not in workers, "a worker's process not found"
        os.kill(proc.pid, signal.SIGKILL)  # torchrun alone: its workers live in other sessions
        killed = time.monotonic()
        while any(alive(pid) for pid in workers) and time.monotonic() - killed < 60:
            time.sleep(0.05)
        stopped = time.monotonic() - killed
        _, err = proc.communicate(timeout=30)  # the workers held the pipes
    finally:
        for pid in filter(None, workers):
            if alive(pid):
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
    resumed = [(r["step"], r["loss"]) for r in train_records(tmp_path)]
    assert [step for step, _ in resumed] == list(range(1, 41))  # each step once
    assert all(loss == expected[step] for step, loss in resumed)  # bit for bit


@pytest.mark.slow
def test_a_second_job_into_a_run_directory_in_use_is_refused(tmp_path):
    """Two torchrun jobs started into one run directory (a double submission; the second once
    the first holds it): the second refuses before writing anything, exit 2, naming the
    holder; the first trains on undisturbed, every step logged once."""
    args = (str(CONFIG), "--launcher", "pytorch", "--work-dir", str(tmp_path), "--cfg-options",
            *SLOW, "model.step_seconds=0.25")
    first = subprocess.Popen(torchrun(*args), env=env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    # (a fixed 2 s wait let the second job win the lock when the machine was busy)
    deadline = time.monotonic() + 60
    while not ((tmp_path / "run.lock").exists() and (tmp_path / "train.log").exists()):
        assert first.poll() is None and time.monotonic() < deadline, "the first job never ran"
        time.sleep(0.05)
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
        victim = worker_pid(proc.pid, 1)
        assert victim is not None, "rank 1's process not found"
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 0, err[-3000:]
    log = (tmp_path / "train.log").read_text()
    assert "torchrun restarted the workers: restart 1 of 1 (--max-restarts)" in log
    resumed_at = int(re.search(r"resumed from \S+iter_(\d+)\.pth", log).group(1))
    assert 10 <= resumed_at < 40  # the worker died mid-run
    expected = {r["step"]: r["loss"] for r in train_records(straight)}
    resumed = [(r["step"], r["loss"]) for r in train_records(tmp_path)]
    assert [step for step, _ in resumed] == list(range(1, 41))  # each step once
    assert all(loss == expected[step] for step, loss in resumed)  # bit for bit


# ---------------------------------------------------------------- the other launchers

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
        while any(alive(pid) for pid in workers) and time.monotonic() - killed < 60:
            time.sleep(0.05)
        return time.monotonic() - killed
    finally:
        for pid in workers:
            if alive(pid):
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


