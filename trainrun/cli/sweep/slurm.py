"""Training the points as one SLURM job array: its script, submitting the unfinished points,
waiting for them, and the array task (``python -m trainrun.cli.sweep SWEEP_DIR INDEX``,
`task_main`) that trains one point with srun and records how it ended."""

from __future__ import annotations

import itertools
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from trainrun.checkpoint.files import write_atomically
from trainrun.cli import TRAIN
from trainrun.cli.sweep.grid import Point, Sweep, SweepError, file_safe, train_args
from trainrun.cli.sweep.status import (
    LOG,
    MANIFEST,
    STATUS,
    ended,
    is_finished,
    progress,
    read_manifest,
    read_status,
    say,
    to_train,
    write_status,
)
from trainrun.exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE

JOBS = "slurm_jobs.txt"  # the job arrays the sweep submitted, one line each
POLL_S = 1.0  # how often --wait asks squeue


def array_spec(indices: Sequence[int]) -> str:
    """Task ids for ``sbatch --array``, runs as ranges: [0, 1, 2, 5] -> '0-2,5'."""
    parts: list[str] = []
    for _, run in itertools.groupby(enumerate(indices), lambda pair: pair[1] - pair[0]):
        ids = [i for _, i in run]
        parts.append(str(ids[0]) if len(ids) == 1 else f"{ids[0]}-{ids[-1]}")
    return ",".join(parts)


def sbatch_script() -> str:
    """The job array's script; sbatch's command line gives the job's name, size and output.
    Task i trains point i of sweep.json in the directory given as its argument."""
    return f"""#!/bin/bash
# Written by tools/sweep.py: array task i trains point i of SWEEP_DIR/{MANIFEST} with srun and
# records its exit code there; --resume makes a requeued or repeated task continue.
#   sbatch --array=0-3 sweep.sbatch SWEEP_DIR
#SBATCH --requeue
#SBATCH --signal=USR1@120
#SBATCH --open-mode=append
exec {shlex.quote(sys.executable)} -u -m trainrun.cli.sweep "$1" "$SLURM_ARRAY_TASK_ID"
"""


def recorded_jobs(directory: Path) -> list[str]:
    """The job arrays this sweep submitted, oldest first."""
    try:
        lines = (directory / JOBS).read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    return [line.split()[0] for line in lines if line.strip()]


def active_tasks(directory: Path) -> dict[int, str]:
    """{point index: 'JOB_TASK'} for this sweep's array tasks that SLURM still has queued or
    running ({} where squeue is missing)."""
    jobs = recorded_jobs(directory)
    if not jobs or shutil.which("squeue") is None:
        return {}
    active: dict[int, str] = {}
    for job in jobs:  # one at a time: squeue refuses a list holding a job it has forgotten
        try:
            done = subprocess.run(["squeue", "-h", "-r", "-j", job, "-o", "%F %K"],
                                  capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        for line in done.stdout.splitlines() if done.returncode == 0 else []:
            array_job, _, task = line.strip().partition(" ")
            if array_job == job and task.isdigit():
                active[int(task)] = f"{job}_{task}"
    return active


def submit(sweep: Sweep, sbatch_args: str) -> tuple[str, list[Point]]:
    """Submit the points to train as one job array; returns its id and those points."""
    todo = to_train(sweep, active_tasks(sweep.directory))
    if not todo:
        return "", []
    for point in todo:  # an earlier attempt's status would pass for this one's
        (point.work_dir / STATUS).unlink(missing_ok=True)
    script = sweep.directory / "sweep.sbatch"
    write_atomically(script, sbatch_script())
    spec = array_spec([p.index for p in todo])
    cmd = ["sbatch", "--parsable", f"--array={spec}", f"--job-name={file_safe(sweep.name)}-sweep",
           f"--ntasks={sweep.nproc or 1}", f"--output={sweep.directory}/slurm-%A_%a.out",
           *shlex.split(sbatch_args), str(script), str(sweep.directory)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise SweepError(f"--launcher slurm: sbatch: {error}") from None
    if done.returncode != 0:
        raise SweepError(f"--launcher slurm: sbatch failed: {' '.join(done.stderr.split())}")
    job = done.stdout.strip().split(";")[0]
    with open(sweep.directory / JOBS, "a", encoding="utf-8") as f:
        f.write(f"{job} {spec}\n")
    for point in todo:
        progress(point, len(sweep.points), f"submitted as job {job}_{point.index}")
    return job, todo


def wait_array(sweep: Sweep, job: str, points: list[Point]) -> int:
    """Wait until none of ``points`` is queued or running, saying how each one ended."""
    waiting = {p.index: p for p in points}
    failed = 0
    while waiting:
        time.sleep(POLL_S)
        active = active_tasks(sweep.directory)
        for index in [i for i in waiting if i not in active]:
            point = waiting.pop(index)
            status = read_status(point.work_dir)
            if status is None:
                failed += 1
                progress(point, len(sweep.points), f"ended without a status; see "
                         f"{sweep.directory}/slurm-{job}_{index}.out")
                continue
            code = int(status.get("exit_code", EXIT_FAILED))
            failed += code != EXIT_OK
            progress(point, len(sweep.points),
                     ended(code, float(status.get("seconds", 0)), point.work_dir))
    return EXIT_FAILED if failed else EXIT_OK


def run_slurm(sweep: Sweep, sbatch_args: str, wait: bool) -> int:
    job, points = submit(sweep, sbatch_args)
    if not points:
        return EXIT_OK
    say(f"submitted job array {job} ({len(points)} of {len(sweep.points)} points)")
    if not wait:
        say("rerun this command with --summary-only once it has ended (or with --wait)")
        return EXIT_OK
    try:
        return wait_array(sweep, job, points)
    except KeyboardInterrupt:
        say(f"stopped waiting; job array {job} goes on (scancel {job} stops it)")
        raise


def task_main(argv: Sequence[str]) -> int:
    """An array task: ``python -m trainrun.cli.sweep SWEEP_DIR INDEX`` trains point INDEX
    of SWEEP_DIR/sweep.json with srun and records its exit code."""
    if len(argv) != 2 or not argv[1].isdigit():
        print("usage: python -m trainrun.cli.sweep SWEEP_DIR INDEX (a job array task of "
              "tools/sweep.py)", file=sys.stderr)
        return EXIT_USAGE
    manifest = read_manifest(Path(argv[0]))
    index = int(argv[1])
    if manifest is None or index >= len(manifest["points"]):
        print(f"error: {argv[0]} holds no point {index} (no {MANIFEST}, or fewer points)",
              file=sys.stderr)
        return EXIT_USAGE
    point = manifest["points"][index]
    work_dir = Path(point["work_dir"])
    prefix = f"[{index + 1}/{len(manifest['points'])}] {point['label']}"
    if is_finished(work_dir):
        say(f"{prefix}: skipped (finished)")
        return EXIT_OK
    work_dir.mkdir(parents=True, exist_ok=True)
    args = train_args(manifest["config"], manifest["cfg_options"], point["overrides"],
                      work_dir, "slurm")
    cmd = ["srun", "--kill-on-bad-exit=1", sys.executable, "-u", *TRAIN, *args]
    job = os.environ.get("SLURM_ARRAY_JOB_ID", "?")
    say(f"{prefix}: training in job {job}_{index} on {os.environ.get('SLURMD_NODENAME', '?')}")
    started = time.monotonic()
    with open(work_dir / LOG, "ab") as out:
        code = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=out,
                              stderr=subprocess.STDOUT).returncode
    seconds = time.monotonic() - started
    write_status(work_dir, code, seconds)
    say(f"{prefix}: {ended(code, seconds, work_dir)}")
    return code
