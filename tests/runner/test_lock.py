"""The run directory's lock: one live writer, a gone holder taken over, a lost lock ends the
job. Two real jobs in one run directory are tests/tools/test_train_cli.py's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict

import pytest

from trainrun.runner import lock as lock_module
from trainrun.runner.lock import LOCK_NAME, Holder, RunDirectoryBusy, RunLock


def _write_holder(work_dir, **fields) -> Holder:
    holder = Holder(**{**asdict(Holder.me()), **fields})
    (work_dir / LOCK_NAME).write_text(json.dumps(asdict(holder)))
    return holder


def _holds(lock: RunLock) -> bool:
    """Whether the lock file names ``lock``."""
    return json.loads(lock.path.read_text())["token"] == lock.holder.token


def _renewed_ago(work_dir, seconds: float) -> None:
    """Make the lock file's lease look last renewed ``seconds`` ago."""
    when = time.time() - seconds
    os.utime(work_dir / LOCK_NAME, (when, when))


@pytest.fixture
def sleeper():
    """Another live process on this host."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_fresh_run_directory_is_locked_by_this_process_until_released(tmp_path):
    lock = RunLock(tmp_path)
    lock.acquire()
    held = json.loads((tmp_path / LOCK_NAME).read_text())
    assert (held["host"], held["pid"]) == (socket.gethostname(), os.getpid())
    assert held["started"] and held["since"] and held["token"] == lock.holder.token
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()
    lock.release()  # twice is fine


def test_a_live_holder_is_named_and_the_directory_left_alone(tmp_path, sleeper):
    _write_holder(tmp_path, pid=sleeper.pid, started=lock_module._start_time(sleeper.pid),
                  job="SLURM job 4242", since="2026-11-23 10:00:00")
    before = (tmp_path / LOCK_NAME).read_bytes()
    with pytest.raises(RunDirectoryBusy) as refused:
        RunLock(tmp_path).acquire()
    assert str(refused.value).startswith(
        f"work_dir: {tmp_path} is in use by another job (host {socket.gethostname()}, pid "
        f"{sleeper.pid}, SLURM job 4242, since 2026-11-23 10:00:00; lease renewed 0 s ago, "
        f"see {tmp_path / LOCK_NAME}): ")
    assert "pass another --work-dir" in str(refused.value)
    assert [p.name for p in tmp_path.iterdir()] == [LOCK_NAME]
    assert (tmp_path / LOCK_NAME).read_bytes() == before


def test_a_holder_on_another_host_is_live_until_its_lease_runs_out(tmp_path):
    _write_holder(tmp_path, host="node-17", pid=1234)
    with pytest.raises(RunDirectoryBusy, match="host node-17, pid 1234"):
        RunLock(tmp_path).acquire()
    _renewed_ago(tmp_path, lock_module.LEASE_SECONDS + 5)
    lock = RunLock(tmp_path)
    lock.acquire()
    assert _holds(lock)
    lock.release()


@pytest.mark.parametrize("how", ["gone", "reused"])
def test_a_dead_holder_on_this_host_is_taken_over_saying_so(tmp_path, sleeper, caplog, how):
    if how == "gone":
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True).stdout.strip()
        _write_holder(tmp_path, pid=int(dead), started="1")
        why = f"its process {dead} no longer exists"
    else:  # the pid lives on, but in a process that started later than the holder
        _write_holder(tmp_path, pid=sleeper.pid, started="1")
        why = f"its pid {sleeper.pid} now belongs to another process"
    lock = RunLock(tmp_path)
    with caplog.at_level("WARNING", logger="trainrun"):
        lock.acquire()
    assert len(caplog.records) == 1  # one line
    message = caplog.records[0].getMessage()
    assert message.startswith(f"work_dir: took over {tmp_path} from host ") and \
        message.endswith(why), message
    assert _holds(lock)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]  # nothing left aside
    lock.release()


def test_an_unreadable_lock_file_is_a_job_starting_until_it_is_old(tmp_path):
    (tmp_path / LOCK_NAME).write_text("")
    with pytest.raises(RunDirectoryBusy, match="a job starting right now"):
        RunLock(tmp_path).acquire()
    _renewed_ago(tmp_path, lock_module.RENEW_SECONDS + 5)
    lock = RunLock(tmp_path)
    lock.acquire()
    assert _holds(lock)
    lock.release()


def test_a_runner_of_this_process_hands_its_lock_to_the_next(tmp_path):
    first, second = RunLock(tmp_path), RunLock(tmp_path)
    first.acquire()
    second.acquire()  # (a runner never closed, then another on the same directory)
    assert first._stop.is_set() and not second._stop.is_set()
    assert _holds(second)
    first.release()  # no longer its own: left in place
    assert (tmp_path / LOCK_NAME).exists()
    second.release()
    assert not (tmp_path / LOCK_NAME).exists()


class RecordingLock(RunLock):
    def _lost(self, taker: Holder) -> None:
        self.taken_by = taker
        self._stop.set()


def test_a_holder_whose_lock_was_taken_over_stops(tmp_path, monkeypatch):
    monkeypatch.setattr(lock_module, "RENEW_SECONDS", 0.05)
    lock = RecordingLock(tmp_path)
    lock.taken_by = None
    lock.acquire()
    renewed = (tmp_path / LOCK_NAME).stat().st_mtime
    time.sleep(0.2)
    assert (tmp_path / LOCK_NAME).stat().st_mtime > renewed  # the lease is renewed
    taker = _write_holder(tmp_path, host="node-3", pid=99)
    deadline = time.monotonic() + 5
    while lock.taken_by is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert lock.taken_by == taker
    lock.release()
    assert (tmp_path / LOCK_NAME).exists()  # the taker's, kept
