"""``trainrun sweep`` (``tools/sweep.py``): train every point of a hyper-parameter grid, then
compare them.

    trainrun sweep CONFIG --grid optim.lr=1e-3,3e-3 model.hidden=64,128
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

The package, by concern: `grid` (the grid, its points and their training arguments), `status`
(sweep.json, each point's status and log, and their words), `local` (the points trained here),
`slurm` (the job array and its task), `summary` (the tables and the bars); this module reads
the command line and checks every point.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainrun.cli import HelpFormatter, epilog, import_from_working_directory, prog
from trainrun.cli.sweep.grid import (
    Sweep,
    SweepError,
    file_safe,
    make_points,
    parse_grid,
    point_launcher,
)
from trainrun.cli.sweep.local import local_command, run_local
from trainrun.cli.sweep.slurm import run_slurm
from trainrun.cli.sweep.status import (
    MANIFEST,
    check_same_sweep,
    is_finished,
    progress,
    read_manifest,
    say,
    write_manifest,
)
from trainrun.cli.sweep.summary import write_summary
from trainrun.exits import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE

# ---------------------------------------------------------------- command line

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog("sweep", "sweep.py"),
        description="Train every point of a hyper-parameter grid (one after another, or as a\n"
        "SLURM job array) and summarise them.", formatter_class=HelpFormatter,
        epilog=epilog("trainrun sweep CONFIG --grid optim.lr=1e-3,3e-3 model.hidden=64,128",
                      "trainrun sweep configs/digits_ddp.yaml --grid optim.lr=1e-3,3e-3 "
                      "--nproc 2", docs="sweeps"))
    p.add_argument("config", metavar="CONFIG", help="the YAML config")
    p.add_argument("--grid", nargs="+", action="extend", required=True, metavar="K=V1,V2",
                   help="a key and its values, e.g. optim.lr=1e-3,3e-3")
    p.add_argument("--cfg-options", nargs="+", action="extend", default=[], metavar="K=V",
                   help="overrides for every point")
    p.add_argument("--work-dir", metavar="DIR",
                   help="the sweep directory (default work_dirs/<name>-sweep)")
    p.add_argument("--launcher", choices=("local", "slurm"), default="local",
                   help="one point after another here, or one job array")
    p.add_argument("--nproc", type=int, metavar="N",
                   help="processes per point (torchrun here, srun tasks)")
    p.add_argument("--sbatch-args", default="", metavar="'ARGS'",
                   help="more sbatch options in one string ('--time=60')")
    p.add_argument("--wait", action="store_true",
                   help="slurm: wait for the array, then summarise")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--summary-only", action="store_true",
                      help="train nothing; summarise the points as they are")
    what.add_argument("--dry-run", action="store_true",
                      help="check and print every point; write nothing")
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


def load_checked(config: str, overrides: list[str], values: dict[str, Any],
                 warnings: list[str], where: str = "") -> Any:
    """The config validated as ``trainrun train`` would (the classes it names imported and
    their keys checked too); a ConfigError becomes a SweepError."""
    from trainrun.runner.builder import check_types
    from trainrun.runner.config import ConfigError, load_config

    try:
        cfg = load_config(config, overrides, values=values, on_warning=warnings.append)
        check_types(cfg)
        return cfg
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
    """``trainrun sweep`` (``tools/sweep.py``): returns the exit code."""
    import_from_working_directory()
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
