"""One writer per run directory: a lock file with a lease, safe on shared file systems.

The job that trains into a run directory holds ``run.lock`` there: a file created with
O_EXCL (atomic on local disks and on NFS), naming the holder (host, pid, job id, since when)
and a token of its own. A thread renews the lease by touching the file every
`RENEW_SECONDS`, and checks on the way that the file is still its own. A second job finds
the file and refuses, unless the holder is provably gone: it ran on this host and its
process no longer exists, or its lease has not been renewed for `LEASE_SECONDS` (a holder on
another host that died, or froze that long). It then takes the lock over, saying so; a holder
that wakes up to find its lock taken ends at once without writing more. Nothing relies on
``flock``, which NFS does not always honour; the renewal costs a ``utime`` every
`RENEW_SECONDS`, nothing per step.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from trainrun.checkpoint.files import write_atomically
from trainrun.dist.heartbeat import exit_saying
from trainrun.runner.config import ConfigError

log = logging.getLogger("trainrun")

LOCK_NAME = "run.lock"
RENEW_SECONDS = 10.0
LEASE_SECONDS = 60.0  # a lease not renewed for this long belongs to a holder that is gone


class RunDirectoryBusy(ConfigError):
    """Another live job holds the run directory (exit code 2, before anything is written)."""


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot), telling a reused pid from the
    one that wrote a lock; None when there is no such process (or no /proc to ask)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _job_id() -> str | None:
    env = os.environ
    if env.get("SLURM_JOB_ID"):
        task = env.get("SLURM_ARRAY_TASK_ID")
        return f"SLURM job {env.get('SLURM_ARRAY_JOB_ID')}_{task}" if task else \
            f"SLURM job {env['SLURM_JOB_ID']}"
    if env.get("TORCHELASTIC_RUN_ID", "none") != "none":  # 'none': torchrun's default
        return f"torchrun run {env['TORCHELASTIC_RUN_ID']}"
    return None


@dataclass
class Holder:
    """Who holds a run directory: what its lock file says."""

    host: str
    pid: int
    started: str | None  # the process's start time, see `_start_time`
    job: str | None
    since: str
    token: str

    @classmethod
    def me(cls) -> Holder:
        return cls(socket.gethostname(), os.getpid(), _start_time(os.getpid()), _job_id(),
                   time.strftime("%Y-%m-%d %H:%M:%S"), uuid.uuid4().hex)

    def describe(self) -> str:
        job = f", {self.job}" if self.job else ""
        return f"host {self.host}, pid {self.pid}{job}, since {self.since}"

    def is_this_process(self) -> bool:
        return self.host == socket.gethostname() and self.pid == os.getpid() \
            and self.started == _start_time(os.getpid())

    def gone(self, renewed_ago: float) -> str | None:
        """Why this holder is provably gone, or None while it may be alive."""
        if self.host == socket.gethostname():
            started = _start_time(self.pid)
            if started is None:
                return f"its process {self.pid} no longer exists"
            if self.started is not None and started != self.started:
                return f"its pid {self.pid} now belongs to another process"
            return None
        if renewed_ago > LEASE_SECONDS:
            return f"its lease was last renewed {renewed_ago:.0f} s ago"
        return None


def _read(path: Path) -> tuple[Holder | None, float]:
    """The holder a lock file names (None: unreadable, e.g. cut short by a crash while it
    was written) and how long ago it was last renewed. Opening it first makes an NFS client
    revalidate what it cached of the file."""
    with open(path, "rb") as f:
        renewed_ago = time.time() - os.fstat(f.fileno()).st_mtime
        text = f.read()
    try:
        return Holder(**json.loads(text)), renewed_ago
    except (ValueError, TypeError):
        return None, renewed_ago


_HELD: dict[Path, RunLock] = {}  # the locks this process holds, by path


class RunLock:
    """The lock of one run directory, held by this process; see the module's docstring."""

    def __init__(self, work_dir: Path):
        self.path = work_dir / LOCK_NAME
        self.holder = Holder.me()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        """Hold the lock, taking it over from a holder that is gone (one log line); raises
        `RunDirectoryBusy` naming a live holder. The run directory must exist."""
        earlier = _HELD.pop(self.path, None)
        if earlier is not None:  # an earlier runner of this process, never closed
            earlier._stop.set()
            atexit.unregister(earlier.release)
        for _ in range(3):  # another job may take or drop it between our steps
            if self._create():
                break
            try:
                holder, renewed_ago = _read(self.path)
            except FileNotFoundError:
                continue  # released meanwhile
            if holder is not None and holder.is_this_process():
                self._replace()  # an earlier runner of this process: it is ours
                break
            why = holder.gone(renewed_ago) if holder is not None else (
                f"its lock file is unreadable and {renewed_ago:.0f} s old"
                if renewed_ago > RENEW_SECONDS else None)
            if why is None:
                who = holder.describe() if holder is not None else "a job starting right now"
                raise RunDirectoryBusy(
                    f"work_dir: {self.path.parent} is in use by another job ({who}; lease "
                    f"renewed {max(renewed_ago, 0):.0f} s ago, see {self.path}): two jobs "
                    f"writing one run directory would interleave its checkpoints and "
                    f"metrics; wait for that job to end (or stop it), or pass another "
                    f"--work-dir")
            if self._take_over(holder):
                log.warning("work_dir: took over %s from %s: %s", self.path.parent,
                            holder.describe() if holder else "an unfinished lock file", why)
                break
        else:
            raise RunDirectoryBusy(f"work_dir: {self.path.parent}: other jobs keep taking its "
                                   f"lock ({self.path}); start one job per run directory")
        self._thread = threading.Thread(target=self._renew, name="trainrun-run-lock",
                                        daemon=True)
        self._thread.start()
        _HELD[self.path] = self
        atexit.register(self.release)

    def _create(self) -> bool:
        """Create the lock file naming this process; False when one exists."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(asdict(self.holder)))
            f.flush()
            os.fsync(f.fileno())
        return True

    def _replace(self) -> None:
        """Write this process's own record over its earlier one."""
        write_atomically(self.path, json.dumps(asdict(self.holder)))

    def _take_over(self, gone: Holder | None) -> bool:
        """Move the lock file of ``gone`` aside and create ours; False when another job was
        quicker (the file moved aside was already someone else's: it is put back)."""
        aside = self.path.with_name(f".tmp-{LOCK_NAME}-{self.holder.token}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return self._create()
        moved, _ = _read(aside)
        if gone is not None and (moved is None or moved.token != gone.token):
            try:
                os.link(aside, self.path)  # put it back, unless a third job made one meanwhile
            except FileExistsError:
                pass
            aside.unlink()
            return False
        aside.unlink()
        return self._create()

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_SECONDS):
            try:
                holder, _ = _read(self.path)
                if holder is not None and holder.token != self.holder.token:
                    self._lost(holder)
                os.utime(self.path)
            except FileNotFoundError:  # removed by hand (or with the run directory)
                log.warning("run lock: %s was removed; no other job is kept out of %s now",
                            self.path, self.path.parent)
                return
            except OSError as error:  # the file system is slow or away: retry next time
                log.debug("run lock: could not renew %s: %s", self.path, error)

    def _lost(self, taker: Holder) -> None:
        """Another job took this run directory over (this one looked gone: frozen, or cut
        off from the file system): end now, writing nothing more there."""
        if not self._stop.is_set():
            exit_saying(f"stopping: {self.path.parent} was taken over by another job "
                        f"({taker.describe()}), which found this one gone; this job writes "
                        f"nothing more there")

    def release(self) -> None:
        """Stop renewing and remove the lock file, if it is still ours."""
        if self._stop.is_set():
            return
        self._stop.set()
        atexit.unregister(self.release)
        if _HELD.get(self.path) is self:
            del _HELD[self.path]
        try:
            holder, _ = _read(self.path)
            if holder is not None and holder.token == self.holder.token:
                self.path.unlink()
        except OSError:
            pass
