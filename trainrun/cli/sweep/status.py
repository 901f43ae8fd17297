"""What the sweep records of its points, and says of them: ``sweep.json`` (the points, which
the job array's tasks read), each point's ``sweep_status.json`` (how its last attempt ended)
and ``sweep.log`` (its output), the end of an attempt in words, and which points to train."""

from __future__ import annotations

import io
import json
import re
import signal
import time
from pathlib import Path
from typing import Any

from trainrun.checkpoint.files import write_atomically
from trainrun.cli.sweep.grid import Point, Sweep, SweepError
from trainrun.exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_PREEMPTED

MANIFEST, STATUS, LOG = "sweep.json", "sweep_status.json", "sweep.log"


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """``sweep.json`` of ``directory``, or None when there is none."""
    path = directory / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise SweepError(f"{path}: cannot read it: {error}") from None


def check_same_sweep(sweep: Sweep) -> None:
    """A directory that holds another sweep is refused: its points would mix with these."""
    old = read_manifest(sweep.directory)
    if old is None:
        return
    for field, value in sweep.identity().items():
        if old.get(field) != value:
            raise SweepError(
                f"--work-dir {sweep.directory}: it holds another sweep ({field} there: "
                f"{json.dumps(old.get(field))}; here: {json.dumps(value)}); choose another "
                f"--work-dir, or repeat that sweep's command")


def write_manifest(sweep: Sweep) -> None:
    """``sweep.json``: what the points are made of, and each point (the job array reads it)."""
    points = [{"name": p.name, "work_dir": str(p.work_dir), "values": p.values,
               "overrides": p.overrides, "label": p.label} for p in sweep.points]
    manifest = {**sweep.identity(), "name": sweep.name, "points": points}
    write_atomically(sweep.directory / MANIFEST, json.dumps(manifest, indent=2) + "\n")


def read_status(work_dir: Path) -> dict[str, Any] | None:
    """What the last attempt at a point recorded (its exit code), or None."""
    try:
        return json.loads((work_dir / STATUS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def write_status(work_dir: Path, exit_code: int, seconds: float,
                 interrupted: bool = False) -> None:
    """How an attempt at a point ended; ``interrupted``: the sweep stopped it."""
    status = {"exit_code": exit_code, "interrupted": interrupted, "seconds": round(seconds, 1),
              "ended": time.strftime("%Y-%m-%dT%H:%M:%S")}
    write_atomically(work_dir / STATUS, json.dumps(status) + "\n")


def is_finished(work_dir: Path) -> bool:
    """Finished: an attempt exited 0 (written by the sweep only after the process ended)."""
    status = read_status(work_dir)
    return status is not None and status.get("exit_code") == EXIT_OK


def describe_exit(code: int, interrupted: bool = False) -> str:
    """An attempt's end in words; ``interrupted``: the sweep stopped it (torchrun then exits 1
    although its workers wrote a checkpoint)."""
    if code == EXIT_OK:
        return "finished"
    if code == EXIT_PREEMPTED:
        return "stopped (exit 75, checkpoint written)"
    if code == EXIT_INTERRUPTED:
        return "interrupted"
    how = f"exit {code}"
    if code < 0:
        try:
            how = f"killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"killed by signal {-code}"
    return f"interrupted ({how})" if interrupted else f"failed ({how})"


def point_state(point: Point, active: dict[int, str]) -> str:
    """The point's state in words, for the summary."""
    if point.index in active:
        return f"running (SLURM job {active[point.index]})"
    status = read_status(point.work_dir)
    if status is not None:
        return describe_exit(int(status.get("exit_code", EXIT_FAILED)),
                             bool(status.get("interrupted")))
    return "unfinished" if point.work_dir.exists() else "not started"


# the one line ``trainrun train`` ends a failed or stopped run with
REASON = re.compile(r"^(rank \d+(, step \d+)?: |error: |preempted: )")


def reason(log: Path) -> str:
    """Why a point's attempt ended, from the end of its log: ``trainrun train``'s one-line reason,
    else the last line that is not srun's; '' without a log."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, io.SEEK_END) - 8192))
            lines = [line.strip() for line in f.read().decode("utf-8", "replace").splitlines()]
    except OSError:
        return ""
    lines = [line for line in lines if line and not line.startswith("srun:")]
    return next((line for line in reversed(lines) if REASON.match(line)),
                lines[-1] if lines else "")


def ended(code: int, seconds: float, work_dir: Path, interrupted: bool = False) -> str:
    """A progress line's end: how the point's attempt ended."""
    if code == EXIT_OK:
        return f"done in {seconds:.0f} s"
    what = f"{describe_exit(code, interrupted)} after {seconds:.0f} s"
    if interrupted or code in (EXIT_PREEMPTED, EXIT_INTERRUPTED):
        return f"{what}; a rerun resumes it"
    why = reason(work_dir / LOG)
    return what + (f": {why}" if why else "") + f"; see {work_dir / LOG}"


def say(message: str) -> None:
    print(message, flush=True)


def progress(point: Point, total: int, message: str) -> None:
    say(f"[{point.index + 1}/{total}] {point.label}: {message}")


def to_train(sweep: Sweep, active: dict[int, str]) -> list[Point]:
    """The points that are neither finished nor queued or running in a job array of this
    sweep (``active``, from `slurm.active_tasks`); the others are reported as skipped."""
    todo: list[Point] = []
    for point in sweep.points:
        if is_finished(point.work_dir):
            progress(point, len(sweep.points), "skipped (finished)")
        elif point.index in active:
            progress(point, len(sweep.points),
                     f"skipped (queued or running as SLURM job {active[point.index]})")
        else:
            todo.append(point)
    return todo
