"""``tools/sweep.py``: train every point of a hyper-parameter grid, then compare them.

    python tools/sweep.py CONFIG --grid optim.lr=1e-3,3e-3 model.hidden=64,128
        [--cfg-options KEY=VALUE ...] [--work-dir DIR] [--nproc N]
        [--launcher {local,slurm}] [--sbatch-args '...'] [--wait] [--summary-only] [--dry-run]

The grid is the product of the ``--grid`` values (the last key changes fastest). Every point
gets the name ``<config name>-lr=0.001-hidden=64`` (each key shortened to its last dotted part
unless two keys would read the same) and the work_dir ``<sweep dir>/<point name>``; the sweep
dir is ``--work-dir`` or ``work_dirs/<config name>-sweep``. Every point is validated before
anything runs or is written: a bad key or value exits 2 with one line naming it.

The sweep dir holds ``sweep.json`` (config, --cfg-options, grid and points; a rerun with
another grid into the same dir is refused), ``summary.csv``, ``summary.md`` and
``summary.png`` (bars of each point's final loss and best validation metrics; for the
curves, ``tools/plot_metrics.py SWEEP_DIR/*/``). Each point's work_dir also gets
``sweep.log`` (the point's console output, every attempt appended) and, when an attempt ends,
``sweep_status.json`` (its exit code). A point is finished when that file records exit 0; a
rerun skips finished points and trains the others again with ``--resume``, which continues
from their newest checkpoint (or starts from the beginning where there is none).

Locally the points train one after another, each in a process of its own:
``trainrun train --launcher none``, or with ``--nproc N`` under ``torchrun --standalone``.
Ctrl-C (or SIGTERM) passes SIGTERM to the running point, which writes a checkpoint and stops
(a second Ctrl-C kills it); the summary is
written and the sweep exits 130. With ``--launcher slurm`` the unfinished points are submitted
as one job array (``sweep.sbatch``, written into the sweep dir): array task i runs
``python -m trainrun.cli.sweep SWEEP_DIR i``, which trains point i with ``srun`` and writes
its status. ``--wait`` waits for the array and writes the summary; without it, run the same
command with ``--summary-only`` later (a rerun never submits a point whose task is still queued
or running).

Exit codes: 0 every point finished (or the array was submitted, or --summary-only); 1 a point
failed or stopped; 2 a bad command line or grid (nothing written), or sbatch refused the
array; 130 interrupted.
"""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainrun.cli import TRAIN, prog
from trainrun.cli.metrics import Series, read_run
from trainrun.dist.exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_PREEMPTED, EXIT_USAGE
from trainrun.dist.text import show
from trainrun.runner.files import write_atomically

MANIFEST, STATUS, LOG, JOBS = "sweep.json", "sweep_status.json", "sweep.log", "slurm_jobs.txt"
# keys the sweep sets itself for every point
RESERVED = ("name", "work_dir", "launcher", "resume")
POLL_S = 1.0  # how often --wait asks squeue


class SweepError(ValueError):
    """A command line or grid the sweep cannot run; the message is one line naming it."""


@dataclass(frozen=True)
class Point:
    """One grid point: its place, name, run directory and the overrides that make it."""

    index: int
    name: str
    work_dir: Path
    values: dict[str, str]  # dotted key -> the value as shown (YAML's reading: 1e-3 is 0.001)
    overrides: list[str]  # key=value for --cfg-options, name=<point name> last
    label: str  # "lr=0.001 hidden=64"


@dataclass
class Sweep:
    """A validated sweep: the config, the grid, its points and where they go."""

    config: Path
    cfg_options: list[str]
    grid: dict[str, list[str]]  # dotted key -> values as shown
    name: str
    directory: Path
    points: list[Point]
    launcher: str  # local | slurm
    nproc: int | None

    def identity(self) -> dict[str, Any]:
        """What a rerun into the same directory must repeat: the points depend on it."""
        return {"config": str(self.config.resolve()), "cfg_options": self.cfg_options,
                "grid": self.grid}


# ---------------------------------------------------------------- command line

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog("sweep", "sweep.py"),
        description="Train every point of a hyper-parameter grid (one after another, or as a "
        "SLURM job array) and summarise them.")
    p.add_argument("config", metavar="CONFIG", help="the YAML config")
    p.add_argument("--grid", nargs="+", action="extend", required=True, metavar="KEY=V1,V2",
                   help="a dotted key and its comma-separated values (YAML), e.g. "
                        "optim.lr=1e-3,3e-3 model.hidden=64,128")
    p.add_argument("--cfg-options", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="overrides for every point, e.g. schedule.max_epochs=5")
    p.add_argument("--work-dir", metavar="DIR",
                   help="the sweep directory (default work_dirs/<config name>-sweep)")
    p.add_argument("--launcher", choices=("local", "slurm"), default="local",
                   help="local: one point after another here (default); slurm: one job array")
    p.add_argument("--nproc", type=int, metavar="N",
                   help="processes per point: torchrun --nproc_per_node N locally, srun tasks "
                        "on SLURM (default: one plain process locally, 1 task on SLURM)")
    p.add_argument("--sbatch-args", default="", metavar="'ARGS'",
                   help="more sbatch options for the job array, as one string, e.g. "
                        "--sbatch-args='--partition=gpu --gpus-per-task=1 --time=60'")
    p.add_argument("--wait", action="store_true",
                   help="with --launcher slurm: wait for the job array, then write the summary")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--summary-only", action="store_true",
                      help="train nothing; write the summary of what the points hold now")
    what.add_argument("--dry-run", action="store_true",
                      help="check every point and print the points and their commands; "
                           "write nothing")
    return p


def check_flags(args: argparse.Namespace) -> None:
    """Flags that contradict each other are usage errors."""
    if args.nproc is not None and args.nproc < 1:
        raise SweepError(f"--nproc: got {args.nproc}, expected an int >= 1")
    if args.launcher != "slurm":
        for flag, given in (("--wait", args.wait), ("--sbatch-args", args.sbatch_args)):
            if given:
                raise SweepError(f"{flag}: only with --launcher slurm")
    try:
        shlex.split(args.sbatch_args)
    except ValueError as error:
        raise SweepError(f"--sbatch-args: {error}") from None
    submits = args.launcher == "slurm" and not (args.dry_run or args.summary_only)
    if submits and shutil.which("sbatch") is None:
        raise SweepError("--launcher slurm: sbatch is not on PATH here")


# ---------------------------------------------------------------- the grid

def split_values(text: str) -> list[str]:
    """``text`` split at its commas, but not inside [...], {...} or quotes (YAML lists)."""
    values, depth, quote, start = [], 0, "", 0
    for i, char in enumerate(text):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            values.append(text[start:i].strip())
            start = i + 1
    values.append(text[start:].strip())
    return values


def shown(value: Any) -> str:
    """A grid value as names, tables and comparisons show it."""
    if value is None or isinstance(value, bool):
        return show(value)
    if isinstance(value, float):
        return repr(value)  # the shortest text that reads back the same: 1e-3 -> 0.001
    if isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def typed_value(key: str, text: str) -> Any:
    """``text`` read the way --cfg-options reads a value (YAML, through OmegaConf)."""
    from omegaconf import OmegaConf

    from trainrun.runner.config import ConfigError, parse_override

    try:
        value: Any = OmegaConf.to_container(parse_override(f"{key}={text}"), resolve=False)
    except ConfigError as error:
        raise SweepError(f"--grid {key}: {error}") from None
    for part in key.split("."):
        value = value[part]
    return value


def parse_grid(items: Sequence[str]) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """``KEY=V1,V2`` items as {key: values as shown} and {key: values as written}."""
    shown_values: dict[str, list[str]] = {}
    written: dict[str, list[str]] = {}
    for item in items:
        key, equals, text = item.partition("=")
        key = key.strip()
        if not equals or not key or not all(key.split(".")):
            raise SweepError(f"--grid {item!r}: expected KEY=V1,V2,... with a dotted key, "
                             f"e.g. optim.lr=1e-3,3e-3")
        if key in written:
            raise SweepError(f"--grid {key}: given twice; give all its values once, "
                             f"comma-separated")
        if key in RESERVED:
            raise SweepError(f"--grid {key}: the sweep sets {key} for every point itself")
        values = split_values(text)
        if "" in values:
            raise SweepError(f"--grid {key}: got {text!r}, which has an empty value")
        labels = [shown(typed_value(key, value)) for value in values]
        for label in labels:
            if labels.count(label) > 1:
                raise SweepError(f"--grid {key}: the value {label} is given twice")
        shown_values[key], written[key] = labels, values
    return shown_values, written


def short_keys(keys: Sequence[str]) -> dict[str, str]:
    """Each key's last dotted part, or as many last parts as set it apart from the others."""
    out: dict[str, str] = {}
    for key in keys:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            short = ".".join(parts[-n:])
            if not any(other != key and (other == short or other.endswith("." + short))
                       for other in keys):
                break
        out[key] = short
    return out


def file_safe(text: str) -> str:
    """``text`` with every run of characters a file name should not hold replaced by '_'."""
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", text).strip("_") or "_"


def make_points(name: str, directory: Path, grid: dict[str, list[str]],
                written: dict[str, list[str]]) -> list[Point]:
    """The grid's points in order, each named after its values."""
    shorts = short_keys(list(grid))
    points: list[Point] = []
    by_name: dict[str, str] = {}
    combos = zip(itertools.product(*grid.values()), itertools.product(*written.values()),
                 strict=True)
    for index, (labels, texts) in enumerate(combos):
        values = dict(zip(grid, labels, strict=True))
        label = " ".join(f"{shorts[k]}={v}" for k, v in values.items())
        point_name = file_safe(name) + "".join(
            f"-{file_safe(shorts[k])}={file_safe(v)}" for k, v in values.items())
        if point_name in by_name:
            raise SweepError(f"--grid: the points {by_name[point_name]} and {label} would both "
                             f"be named {point_name!r}; their values differ only in characters "
                             f"a file name cannot hold")
        by_name[point_name] = label
        overrides = [*(f"{k}={t}" for k, t in zip(grid, texts, strict=True)),
                     f"name={point_name}"]
        points.append(Point(index, point_name, directory / point_name, values, overrides, label))
    return points


# ---------------------------------------------------------------- checking

def point_launcher(launcher: str, nproc: int | None) -> str:
    """What each point's tools/train.py is told: none, pytorch (torchrun) or slurm (srun)."""
    if launcher == "slurm":
        return "slurm"
    return "none" if nproc is None else "pytorch"


def load_checked(config: str, overrides: list[str], values: dict[str, Any],
                 warnings: list[str], where: str = "") -> Any:
    """The config validated as tools/train.py would; a ConfigError becomes a SweepError."""
    from trainrun.runner.config import ConfigError, load_config

    try:
        return load_config(config, overrides, values=values, on_warning=warnings.append)
    except ConfigError as error:
        message = " ".join(str(error).split("\n"))
        raise SweepError(f"{where}{message}") from None


def prepare(args: argparse.Namespace, warnings: list[str]) -> Sweep:
    """Parse the grid and validate the config at every point; nothing is written."""
    check_flags(args)
    launcher = point_launcher(args.launcher, args.nproc)
    base = load_checked(args.config, args.cfg_options, {"launcher": launcher}, warnings)
    grid, written = parse_grid(args.grid)
    directory = Path(args.work_dir or f"work_dirs/{file_safe(base.name)}-sweep").absolute()
    points = make_points(base.name, directory, grid, written)
    for point in points:
        load_checked(args.config, [*args.cfg_options, *point.overrides],
                     {"launcher": launcher, "work_dir": str(point.work_dir)}, warnings,
                     where=f"--grid point {point.label}: ")
    sweep = Sweep(Path(args.config), list(args.cfg_options), grid, base.name, directory,
                  points, args.launcher, args.nproc)
    check_same_sweep(sweep)
    return sweep


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


# ---------------------------------------------------------------- point status

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


# the one line tools/train.py ends a failed or stopped run with
REASON = re.compile(r"^(rank \d+(, step \d+)?: |error: |preempted: )")


def reason(log: Path) -> str:
    """Why a point's attempt ended, from the end of its log: tools/train.py's one-line reason,
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


# ---------------------------------------------------------------- local runs

def train_args(config: Path | str, cfg_options: Sequence[str], overrides: Sequence[str],
               work_dir: Path | str, launcher: str) -> list[str]:
    """tools/train.py's arguments for a point: always --resume (from the start when there is
    no checkpoint yet), the point's overrides after the sweep's."""
    return [str(config), "--launcher", launcher, "--work-dir", str(work_dir), "--resume",
            "--cfg-options", *cfg_options, *overrides]


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
    from trainrun.runner.checkpoint import named_by_last

    total = len(sweep.points)
    resumed = named_by_last(point.work_dir / "checkpoints")
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


def to_train(sweep: Sweep) -> list[Point]:
    """The points that are neither finished nor queued or running in a job array of this
    sweep; the others are reported as skipped."""
    active = active_tasks(sweep.directory)
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


def run_local(sweep: Sweep) -> int:
    """Train the unfinished points one after another."""
    todo = to_train(sweep)
    failed = 0
    with sigterm_interrupts():
        for point in todo:
            code, interrupted = train_point(sweep, point)
            if interrupted:
                raise KeyboardInterrupt
            failed += code != EXIT_OK
    return EXIT_FAILED if failed else EXIT_OK


# ---------------------------------------------------------------- SLURM

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
    todo = to_train(sweep)
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


# ---------------------------------------------------------------- summary

def read_point(work_dir: Path) -> tuple[Series, Series]:
    """A point's training and validation series, one value per step: where an attempt was cut
    short and a resumed one logged the same step again, the later line counts."""
    try:
        train, val = read_run(work_dir)
    except ValueError:  # no metrics.jsonl, or nothing in it yet
        return {}, {}
    return ({k: sorted(dict(v).items()) for k, v in train.items()},
            {k: sorted(dict(v).items()) for k, v in val.items()})


def lower_is_better(metric: str) -> bool:
    """A loss is better lower, anything else higher: the rule of checkpoint.save_best."""
    from trainrun.runner.hooks.checkpoint import best_rule_for

    return best_rule_for(metric) == "less"


def best(points: list[tuple[int, float]], metric: str) -> tuple[float, int]:
    """The best value of a series and its step (the earliest on a tie)."""
    sign = 1 if lower_is_better(metric) else -1
    step, value = min(points, key=lambda step_value: (sign * step_value[1], step_value[0]))
    return value, step


def point_numbers(train: Series, val: Series) -> dict[str, float | int]:
    """A point's summary numbers: last step, final losses, final and best validation metrics
    (with the step of the best)."""
    numbers: dict[str, float | int] = {}
    if train:
        numbers["step"] = max(step for series in train.values() for step, _ in series)
    for key in (k for k in train if "loss" in k):
        numbers[f"final_{key}"] = train[key][-1][1]
    for metric, series in val.items():
        value, step = best(series, metric)
        numbers.update({f"final_{metric}": series[-1][1], f"best_{metric}": value,
                        f"best_{metric}_step": step})
    return numbers


@dataclass
class Table:
    """The summary: a header, and one row per point (cells as values, None where missing)."""

    header: list[str]
    rows: list[list[Any]]


def summary_table(sweep: Sweep, active: dict[int, str]) -> Table:
    """One row per point: its grid values, state and numbers."""
    numbers = [point_numbers(*read_point(point.work_dir)) for point in sweep.points]
    columns: list[str] = []
    for row in numbers:
        columns += [name for name in row if name not in columns]
    header = ["point", *sweep.grid, "status", *columns]
    rows = [[p.name, *p.values.values(), point_state(p, active), *(n.get(c) for c in columns)]
            for p, n in zip(sweep.points, numbers, strict=True)]
    return Table(header, rows)


def csv_text(table: Table) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(table.header)
    writer.writerows([["" if cell is None else cell for cell in row] for row in table.rows])
    return out.getvalue()


def markdown_cell(cell: Any) -> str:
    if cell is None:
        return "-"
    if isinstance(cell, float):
        return f"{cell:.4g}"
    return str(cell).replace("|", "\\|")


def markdown_text(sweep: Sweep, table: Table) -> str:
    """A title line, then the table with numbers to 4 significant digits."""
    header = [h for h in table.header if h != "point"]
    lines = [f"# Sweep {sweep.name}: {len(sweep.points)} points", "",
             f"config `{sweep.config}`, grid " + ", ".join(
                 f"`{k}` = {', '.join(v)}" for k, v in sweep.grid.items()), "",
             "| " + " | ".join(header) + " |",
             "|" + "|".join("---:" if h.startswith(("final", "best", "step")) else "---"
                            for h in header) + "|"]
    for row in table.rows:
        lines.append("| " + " | ".join(markdown_cell(c) for c in row[1:]) + " |")
    return "\n".join(lines) + "\n"


Quantity = tuple[str, list[Any], bool]  # title, one value per point, lower is better


def bar_quantities(table: Table) -> list[Quantity]:
    """What the bars compare: every final loss, then the best value of every metric."""
    out = []
    for i, name in enumerate(table.header):
        if name.startswith("final_loss") or (name.startswith("best_")
                                              and not name.endswith("_step")):
            lower = lower_is_better(name)
            title = f"{name.replace('_', ' ', 1)} ({'lower' if lower else 'higher'} is better)"
            out.append((title, [row[i] for row in table.rows], lower))
    return out


def plot_bars(path: Path, labels: list[str], quantities: list[Quantity]) -> None:
    """One panel of horizontal bars per quantity, one bar per point, the best one orange."""
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(quantities), sharey=True, squeeze=False,
                                figsize=(1.8 + 4.2 * len(quantities), 1.6 + 0.45 * len(labels)))
    for axis, (title, values, lower) in zip(axes[0], quantities, strict=True):
        known = [v for v in values if v is not None]
        top = (min if lower else max)(known)
        bars = axis.barh(range(len(labels)), [0 if v is None else v for v in values],
                         color=["tab:orange" if v == top else "tab:blue" for v in values])
        axis.bar_label(bars, labels=["n/a" if v is None else f"{v:.4g}" for v in values],
                       padding=3, fontsize="small")
        axis.set_title(title)
        axis.margins(x=0.25)
        axis.grid(axis="x", alpha=0.3)
    axes[0][0].set_yticks(range(len(labels)), labels)
    axes[0][0].invert_yaxis()  # the first point on top
    figure.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    figure.savefig(tmp, dpi=110)
    os.replace(tmp, path)
    plt.close(figure)


def write_summary(sweep: Sweep) -> Table:
    """summary.csv, summary.md and summary.png (once a point has logged numbers)."""
    table = summary_table(sweep, active_tasks(sweep.directory))
    write_atomically(sweep.directory / "summary.csv", csv_text(table))
    write_atomically(sweep.directory / "summary.md", markdown_text(sweep, table))
    quantities = [q for q in bar_quantities(table) if any(v is not None for v in q[1])]
    if quantities:
        plot_bars(sweep.directory / "summary.png", [p.label for p in sweep.points], quantities)
    say(f"summary: {sweep.directory / 'summary.md'} (and summary.csv"
        + (", summary.png)" if quantities else "; nothing logged yet to plot)"))
    return table


# ---------------------------------------------------------------- main

def dry_run(sweep: Sweep) -> int:
    """Print every point, its work_dir and what would run it; nothing is written."""
    say(f"sweep {sweep.name}: {len(sweep.points)} points in {sweep.directory}")
    for point in sweep.points:
        state = "finished, would be skipped" if is_finished(point.work_dir) else "would train"
        progress(point, len(sweep.points), f"{state}\n    work_dir {point.work_dir}")
        if sweep.launcher == "local":
            say("    " + shlex.join(local_command(sweep, point)))
    if sweep.launcher == "slurm":
        say("one job array (sbatch --array) of the points to train; each task runs srun "
            "trainrun train --launcher slurm --resume with its point's options")
    return EXIT_OK


def run(sweep: Sweep, args: argparse.Namespace) -> int:
    """Train (or submit) the points, then write the summary."""
    write_manifest(sweep)
    say(f"sweep {sweep.name}: {len(sweep.points)} points in {sweep.directory}")
    try:
        if sweep.launcher == "slurm":
            code = run_slurm(sweep, args.sbatch_args, args.wait)
            if not args.wait:
                return code
        else:
            code = run_local(sweep)
    except KeyboardInterrupt:
        write_summary(sweep)
        say("interrupted; run the same command again to resume")
        return EXIT_INTERRUPTED
    write_summary(sweep)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """``tools/sweep.py``: returns the exit code."""
    try:
        args = parser().parse_args(argv)
    except SystemExit as exit_:  # argparse: usage errors (2) and --help (0)
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    warnings: list[str] = []
    try:
        sweep = prepare(args, warnings)
        for warning in dict.fromkeys(warnings):
            print(f"warning: {warning}", file=sys.stderr, flush=True)
        if args.dry_run:
            return dry_run(sweep)
        if args.summary_only:
            if read_manifest(sweep.directory) is None:
                raise SweepError(f"--summary-only: {sweep.directory} holds no sweep yet "
                                 f"(no {MANIFEST})")
            table = write_summary(sweep)
            column = table.header.index("status")
            for point, row in zip(sweep.points, table.rows, strict=True):
                progress(point, len(sweep.points), row[column])
            return EXIT_OK
        return run(sweep, args)
    except SweepError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(task_main(sys.argv[1:]))
