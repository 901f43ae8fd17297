"""Training the points here, one after another, each in a process of its own (``python -m
trainrun train``, under torchrun with --nproc). Ctrl-C or SIGTERM stops the running point,
which writes a checkpoint; a second Ctrl-C kills it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from trainrun.cli import TRAIN
from trainrun.cli.sweep.grid import Point, Sweep, point_launcher, train_args
from trainrun.cli.sweep.slurm import active_tasks
from trainrun.cli.sweep.status import LOG, ended, progress, to_train, write_status
from trainrun.exits import EXIT_FAILED, EXIT_OK


def local_command(sweep: Sweep, point: Point) -> list[str]:
    """The command that trains ``point`` here (plain python, or torchrun with --nproc)."""
    args = train_args(sweep.config, sweep.cfg_options, point.overrides, point.work_dir,
                      point_launcher("local", sweep.nproc))
    if sweep.nproc is None:
        return [sys.executable, *TRAIN, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(sweep.nproc), *TRAIN, *args]


def start_point(sweep: Sweep, point: Point) -> subprocess.Popen:
    """Start training ``point`` in a process of its own (a fork of the sweep would be faster
    to start, but not safe once CUDA or OpenMP threads exist); its output goes to
    ``<work_dir>/sweep.log``."""
    point.work_dir.mkdir(parents=True, exist_ok=True)
    log = point.work_dir / LOG
    with open(log, "ab") as out:
        return subprocess.Popen(local_command(sweep, point), stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def kill_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def wait_point(proc: subprocess.Popen, point: Point, total: int) -> tuple[int, bool]:
    """The point's exit code, and whether the sweep was interrupted meanwhile: then the point
    gets SIGTERM (it writes a checkpoint and stops); a second interrupt kills it."""
    try:
        return proc.wait(), False
    except KeyboardInterrupt:
        progress(point, total, "interrupted: stopping it (it writes a checkpoint; Ctrl-C again "
                               "kills it)")
    try:
        try:
            proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass  # it ended meanwhile
        return proc.wait(), True
    except KeyboardInterrupt:
        kill_group(proc.pid, signal.SIGKILL)
        return proc.wait(), True


def train_point(sweep: Sweep, point: Point) -> tuple[int, bool]:
    """Train one point to its end (or its interruption) and record how it ended."""
    from trainrun.checkpoint.manager import named_by_last
    from trainrun.runner.run_dir import RunDir

    total = len(sweep.points)
    resumed = named_by_last(RunDir(point.work_dir).checkpoints)
    progress(point, total, f"resuming from {resumed.name}" if resumed else "training")
    started = time.monotonic()
    proc = start_point(sweep, point)
    code, interrupted = wait_point(proc, point, total)
    seconds = time.monotonic() - started
    write_status(point.work_dir, code, seconds, interrupted)
    progress(point, total, ended(code, seconds, point.work_dir, interrupted))
    return code, interrupted


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM to the sweep stops it as Ctrl-C does."""
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_local(sweep: Sweep) -> int:
    """Train the unfinished points one after another."""
    todo = to_train(sweep, active_tasks(sweep.directory))
    failed = 0
    with sigterm_interrupts():
        for point in todo:
            code, interrupted = train_point(sweep, point)
            if interrupted:
                raise KeyboardInterrupt
            failed += code != EXIT_OK
    return EXIT_FAILED if failed else EXIT_OK
