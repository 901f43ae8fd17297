"""``trainrun train`` (``tools/train.py``), and what ``trainrun test`` shares with it.

Exit codes: 0 success; 2 a bad config or command line (one line on stderr naming the key or
argument, no traceback); 1 a failure while running (the traceback, then one line naming the
rank); 75 stopped by a preemption signal (``preemption.signals``) after writing a checkpoint
(requeued under SLURM where allowed; otherwise resume with --resume); 130 interrupted
(Ctrl-C). Nothing is written before the config is valid, and a dry run writes nothing.

``--nproc N`` starts N workers on this machine (`trainrun.cli.launch`) once the config has
passed every check of a dry run for N ranks, and ends with the exit code and the last line of
the worker that failed first.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import re
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

from omegaconf import DictConfig

from trainrun.cli import HelpFormatter, epilog, import_from_working_directory, prog
from trainrun.cli.launch import launch_workers, leave_report
from trainrun.dist import PeerFailure, end_within, infer_launcher, is_distributed
from trainrun.dist.heartbeat import one_line
from trainrun.dist.launch import STARTERS, DistInitError, launch_env, resolve_backend
from trainrun.dist.timeouts import get_timeout
from trainrun.exits import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_USAGE,
    say_refusal,
)
from trainrun.messages import error_line
from trainrun.runner.builder import check_types
from trainrun.runner.config import (
    LAUNCHERS,
    ConfigError,
    load_config,
)
from trainrun.runner.hooks.guard import GuardStop
from trainrun.runner.plan import describe_plan, env_rank, make_plan
from trainrun.runner.preemption import Preempted
from trainrun.runner.run_dir import RunDir, TestDir, run_owning


@dataclass
class Job:
    """A validated config and what the command line asked to do with it."""

    cfg: DictConfig
    warnings: list[str] = field(default_factory=list)
    dry_run: bool = False
    world_size: int | None = None  # --world-size (or --nproc): the dry run plans for this many
    nproc: int | None = None  # --nproc: start this many workers here, each with worker_args
    worker_args: list[str] = field(default_factory=list)
    run_dir: RunDir | None = None  # where the runner writes instead of work_dir (a test's own)
    mmengine: Any = None  # an MMEngine config (CONFIG.py) to plan through trainrun.compat
    source: str = ""  # the config's file


# ---------------------------------------------------------------- parsers

def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--launcher", choices=LAUNCHERS, metavar="NAME",
                        help="none|pytorch|slurm|mpi (wins over the config)")
    parser.add_argument("--work-dir", metavar="DIR",
                        help="the run directory (wins over the config)")
    parser.add_argument("--cfg-options", nargs="+", action="extend", default=[],
                        metavar="K=V", help="overrides, e.g. optim.lr=0.01 strategy.type=fsdp")
    # torch.distributed.launch passes it; it fills LOCAL_RANK when unset
    parser.add_argument("--local-rank", "--local_rank", dest="local_rank", type=int,
                        help=argparse.SUPPRESS)


TRAIN_EXAMPLES = ("trainrun train configs/digits_single.yaml",
                  "trainrun train configs/digits_ddp.yaml --nproc 2 --cfg-options optim.lr=3e-3")
PLAN_EXAMPLES = ("trainrun plan configs/digits_ddp.yaml --world-size 8",
                 "trainrun plan configs/digits_ddp.yaml --cfg-options strategy.type=fsdp")


def train_parser(command: str = "train") -> argparse.ArgumentParser:
    """The command line of ``trainrun train`` (``command='plan'``: of ``trainrun plan``,
    which is ``train --dry-run``)."""
    plan = command == "plan"
    description = ("Print what trainrun train would do with these arguments (train --dry-run):\n"
                   "nothing runs, nothing is written." if plan else "Train from a YAML config.")
    parser = argparse.ArgumentParser(
        prog=prog(command, "train.py"), description=description,
        formatter_class=HelpFormatter,
        epilog=epilog(*(PLAN_EXAMPLES if plan else TRAIN_EXAMPLES), docs="cli"))
    parser.add_argument("config", metavar="CONFIG",
                        help="the YAML config (with --dry-run, an MMEngine config *.py too)")
    _add_common(parser)
    parser.add_argument("--resume", nargs="?", const=True, metavar="CKPT",
                        help="from CKPT or a run dir, else work_dir's newest")
    parser.add_argument("--force", action="store_true",
                        help="with --resume: accept a config that changed")
    parser.add_argument("--amp", action="store_true",
                        help="bf16 mixed precision (fp16 on a GPU without bf16)")
    parser.add_argument("--nproc", type=_ranks, metavar="N",
                        help="start N processes here, with torchrun (even N=1)")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the config, print the plan; write nothing")
    parser.add_argument("--world-size", type=_ranks, metavar="N",
                        help="with --dry-run: plan for N ranks")
    return parser


def _ranks(text: str) -> int:
    """A ``--world-size`` value: a whole number of ranks, at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of ranks >= 1, got {text!r}")
    return value


def test_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog("test", "test.py"),
        description="Test a checkpoint on the config's test data. The test writes a directory of\n"
                    "its own, WORK_DIR/test/<checkpoint> (or --out DIR): config.yaml, test.log\n"
                    "and scores.json; the training run's own files stay as they are.",
        formatter_class=HelpFormatter,
        epilog=epilog("trainrun test configs/digits_single.yaml work_dirs/digits_single",
                      "torchrun --nproc_per_node 2 -m trainrun test CONFIG CKPT --launcher pytorch",
                      docs="cli"))
    parser.add_argument("config", metavar="CONFIG", help="the YAML config")
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="the checkpoint to test")
    _add_common(parser)
    parser.add_argument("--out", metavar="DIR",
                        help="where the test writes (default WORK_DIR/test/CKPT)")
    return parser


# ---------------------------------------------------------------- preparing

def fill_local_rank(local_rank: int | None) -> None:
    """``--local-rank`` fills LOCAL_RANK only where the launcher did not set it."""
    if local_rank is not None and not os.environ.get("LOCAL_RANK"):
        os.environ["LOCAL_RANK"] = str(local_rank)


def amp_precision() -> str:
    """bf16, or fp16 on a CUDA device without bf16 support."""
    import torch

    if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        return "fp16"
    return "bf16"


def _command_line_values(args: argparse.Namespace) -> dict[str, Any]:
    """Config keys the command line sets; they win over the config and --cfg-options."""
    values: dict[str, Any] = {}
    if args.launcher is not None:
        values["launcher"] = args.launcher
    if args.work_dir is not None:
        values["work_dir"] = args.work_dir
    return values


def _launcher_warnings(cfg: DictConfig) -> list[str]:
    started_by = infer_launcher()
    if cfg.launcher != "none" or started_by == "none":
        return []
    return [f"launcher: 'none', but {STARTERS[started_by]} started this process: each process "
            f"trains alone; pass --launcher {started_by}"]


def _check_backend(cfg: DictConfig) -> None:
    """A backend this machine cannot run is a config error, caught before anything starts."""
    if cfg.launcher == "none":
        return
    try:
        resolve_backend(cfg.backend)
    except ValueError as error:
        raise ConfigError(f"backend: {error}") from None


def _check_launcher(cfg: DictConfig) -> None:
    """A launcher whose variables are missing (``--launcher pytorch`` without torchrun, or a
    SLURM batch script instead of srun) is a command-line error, caught before anything starts."""
    if cfg.launcher == "none" or (cfg.launcher == "mpi" and cfg.backend == "mpi"):
        return  # the MPI backend takes rank and size from MPI itself
    try:
        launch_env(cfg.launcher)
    except DistInitError as error:
        raise ConfigError(f"launcher: {cfg.launcher!r}: {error}") from None


def _check_work_dir(cfg: DictConfig) -> None:
    path = Path(cfg.work_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"work_dir: got {str(path)!r}, expected a directory (or a path to "
                          f"create one at), and it is a file")


def _checked_checkpoint(key: str, path: str, run_directory: bool = False) -> str:
    """The checkpoint ``path`` names (a run directory names its newest), once it looks like
    one and holds nothing that would run code; else a ConfigError naming ``key``. With
    ``run_directory`` a run directory stays one, once its ``last`` names a checkpoint: the
    runner resumes from its newest intact checkpoint (and verifies every checkpoint)."""
    from trainrun.checkpoint.format import is_checkpoint
    from trainrun.checkpoint.manager import resolve_checkpoint
    from trainrun.checkpoint.read import check_checkpoint_file

    try:
        if run_directory and not is_checkpoint(path):
            resolve_checkpoint(path)
            return path
        return str(check_checkpoint_file(path))
    except (OSError, ValueError, pickle.UnpicklingError) as error:
        raise ConfigError(f"{key}: {error}") from None


_OPTIMISER_TYPE = re.compile(r"^optim\.(per_module\.[^.]+\.)?type: ")  # a change's key


def _check_resumed_config(cfg: DictConfig, force: bool) -> list[str]:
    """Refuse to resume a run whose config.yaml differs from ``cfg`` in more than its length
    (a changed model, data or optimiser would not resume the run it names), unless forced
    (but for the optimiser's type); returns the warning a forced resume gives."""
    run_dir = RunDir(cfg.work_dir)
    saved_file = run_dir.config
    changes = run_dir.config_changes(cfg)
    if not changes:
        return []
    listed = "; ".join(changes[:12]) + (f"; and {len(changes) - 12} more"
                                        if len(changes) > 12 else "")
    what = f"{saved_file} (the run being resumed) differs in {len(changes)} key(s): {listed}"
    retyped = [change for change in changes if _OPTIMISER_TYPE.match(change)]
    if force and retyped:  # torch loads another type's state, and the first step fails
        raise ConfigError(f"resume: --force cannot change the optimiser's type "
                          f"({'; '.join(retyped)}): the checkpoint holds the state of the "
                          f"type it was written with; resume without that change, or start a "
                          f"new run from its weights alone (load_from: <checkpoint>, in "
                          f"another work_dir)")
    if force:
        return [f"resume: --force: {what}"]
    raise ConfigError(f"resume: {what}; pass --force to resume anyway")


def prepare_train(argv: Sequence[str] | None = None, command: str = "train") -> Job:
    """Parse the train command line and load, override and validate the config.

    Raises SystemExit for argparse's usage errors and ConfigError for a bad config.
    """
    args = train_parser(command).parse_args(argv)
    fill_local_rank(args.local_rank)
    if Path(args.config).suffix == ".py":
        return _mmengine_job(args)
    _check_nproc(args)
    values = _command_line_values(args)
    if args.nproc is not None:
        values["launcher"] = "pytorch"  # the workers': the config is checked as they run it
    if args.resume is not None:
        values["resume"] = args.resume
    if args.amp:
        values["precision"] = amp_precision()
    warnings: list[str] = []
    cfg = load_config(args.config, args.cfg_options, values=values, on_warning=warnings.append)
    check_types(cfg)
    _check_work_dir(cfg)
    for key in ("resume", "load_from"):
        if isinstance(cfg[key], str):
            cfg[key] = _checked_checkpoint(key, cfg[key], run_directory=key == "resume")
    if cfg.resume:
        warnings += _check_resumed_config(cfg, args.force)
    if args.world_size is not None and not args.dry_run:
        raise ConfigError(f"--world-size: got {args.world_size}, which plans a dry run: pass "
                          f"--dry-run too (a run's world size is its launcher's)")
    if not args.dry_run and args.nproc is None:
        _check_launcher(cfg)
    if not args.dry_run:
        _check_backend(cfg)
    return Job(cfg, warnings + _launcher_warnings(cfg), dry_run=args.dry_run,
               world_size=args.nproc or args.world_size,
               nproc=None if args.dry_run else args.nproc, worker_args=worker_args(args))


def _mmengine_job(args: argparse.Namespace) -> Job:
    """An MMEngine Python config (docs/mmengine.md): a dry run checks it and plans it through
    ``trainrun.compat.mmengine``; --launcher, --work-dir and --cfg-options (MMEngine's
    ``KEY=VALUE`` values) apply to it. Training it is the job of an MMEngine training script
    (``Runner.from_cfg``) with its imports pointed at the compat layer."""
    if not args.dry_run:
        raise ConfigError(f"{args.config}: an MMEngine config; `trainrun plan {args.config}` "
                          f"checks it, and MMEngine's training script (Runner.from_cfg) runs "
                          f"it with its imports changed to trainrun.compat.mmengine")
    for flag, value in (("--nproc", args.nproc), ("--resume", args.resume), ("--amp", args.amp),
                        ("--world-size", args.world_size), ("--force", args.force)):
        if value:
            raise ConfigError(f"{flag}: takes a trainrun config, not an MMEngine one "
                              f"({args.config})")
    from trainrun.compat.mmengine.config import Config, DictAction

    try:
        cfg = Config.fromfile(args.config)
    except (OSError, ValueError, SyntaxError, ImportError) as error:
        raise ConfigError(f"{args.config}: {error}") from None
    options: dict[str, Any] = {}
    for item in args.cfg_options:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--cfg-options: {item!r} is not KEY=VALUE")
        options[key] = DictAction._parse(value)
    options.update({key: value for key, value in (("launcher", args.launcher),
                                                  ("work_dir", args.work_dir)) if value})
    cfg.merge_from_dict(options)
    return Job(DictConfig({"launcher": "none"}), dry_run=True, mmengine=cfg,
               source=args.config)


def _check_nproc(args: argparse.Namespace) -> None:
    """``--nproc`` with a flag that contradicts it is a command-line error."""
    if args.nproc is None:
        return
    if args.launcher not in (None, "none", "pytorch"):
        raise ConfigError(f"--nproc: starts its workers with torchrun (--launcher pytorch), "
                          f"not with --launcher {args.launcher}: leave --launcher out, or "
                          f"start the processes with {STARTERS[args.launcher]} instead")
    if args.world_size is not None:
        raise ConfigError(f"--world-size: got {args.world_size} with --nproc {args.nproc}, "
                          f"which plans for its {args.nproc} ranks; give one of them")
    started_by = infer_launcher()
    if started_by != "none":
        raise ConfigError(f"--nproc: this process is already one of {STARTERS[started_by]}'s "
                          f"processes; leave --nproc out (--launcher {started_by})")


def worker_args(args: argparse.Namespace) -> list[str]:
    """The train command line of each worker ``--nproc`` starts: this one without --nproc
    (and --local-rank), under ``--launcher pytorch``. Every option the train parser takes is
    passed on here (tests/tools/test_nproc.py checks that none is left out)."""
    out = [args.config, "--launcher", "pytorch"]
    if args.work_dir is not None:
        out += ["--work-dir", args.work_dir]
    if args.resume is True:
        out.append("--resume")
    elif args.resume is not None:
        out += ["--resume", args.resume]
    out += ["--force"] * args.force + ["--amp"] * args.amp + ["--dry-run"] * args.dry_run
    if args.world_size is not None:
        out += ["--world-size", str(args.world_size)]
    if args.cfg_options:
        out += ["--cfg-options", *args.cfg_options]  # last: it takes every word that follows
    return out


def prepare_test(argv: Sequence[str] | None = None) -> Job:
    """Parse the test command line; the checkpoint becomes ``load_from`` (and no resume), and
    the test writes a directory of its own (``_test_dir``)."""
    args = test_parser().parse_args(argv)
    fill_local_rank(args.local_rank)
    if not os.path.exists(args.checkpoint):
        raise ConfigError(f"CHECKPOINT: got {args.checkpoint!r}, expected an existing "
                          f"checkpoint file or directory")
    checkpoint = _checked_checkpoint("CHECKPOINT", args.checkpoint)
    values = {**_command_line_values(args), "load_from": checkpoint, "resume": False}
    warnings: list[str] = []
    cfg = load_config(args.config, args.cfg_options, values=values, mode="test",
                      on_warning=warnings.append)
    check_types(cfg)
    _check_work_dir(cfg)
    run_dir = _test_dir(cfg, checkpoint, args.out)
    _check_launcher(cfg)
    _check_backend(cfg)
    return Job(cfg, warnings + _launcher_warnings(cfg), run_dir=run_dir)


def _test_dir(cfg: DictConfig, checkpoint: str, out: str | None) -> TestDir:
    """Where a test of ``checkpoint`` writes its config, its log and its scores: ``out``
    (``--out``), else ``test/<the checkpoint's name>`` in the config's work_dir. Never a
    training run's record: a directory that holds one, or lies inside one's checkpoints, is
    a ConfigError."""
    directory = TestDir(out) if out is not None else RunDir(cfg.work_dir).test_dir(checkpoint)
    key = "--out" if out is not None else "work_dir"
    if directory.path.exists() and not directory.path.is_dir():
        raise ConfigError(f"{key}: {directory.path} is a file; a test writes a directory of "
                          f"its own")
    owner = directory if directory.holds_record() else run_owning(directory.path)
    if owner is not None:
        what = "holds a training run's record" if owner is directory else \
            f"is part of the record of the training run in {owner.path}"
        raise ConfigError(f"{key}: {directory.path} {what}, which a test never writes; give "
                          f"--out a directory of its own (by default a test writes "
                          f"WORK_DIR/test/<checkpoint>)")
    return directory


# ---------------------------------------------------------------- running

def _rank(cfg: DictConfig | None) -> int:
    """This process's rank: from the process group once joined, else from the environment."""
    from trainrun.dist import get_rank, is_distributed

    if is_distributed():
        return get_rank()
    launcher = cfg.launcher if cfg is not None else "none"
    return env_rank(launcher if launcher != "none" else infer_launcher())


def _print_to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _usage_error(error: ConfigError) -> int:
    """Say ``error`` in one line, once for a job of several ranks (and leave it for an
    ``--nproc`` starter); exit code 2."""
    line = error_line(error)
    leave_report(EXIT_USAGE, line)
    say_refusal(line if _rank(None) == 0 else None)
    return EXIT_USAGE


def _report_warnings(job: Job) -> None:
    if _rank(job.cfg) == 0:
        for warning in job.warnings:
            _print_to_stderr(f"warning: {warning}")


def _step(error: BaseException, runner: Any) -> int | None:
    """The step a failure happened at: the exception's ``step``, else the training step the
    runner was in when it failed."""
    for step in (getattr(error, "step", None), getattr(runner, "failed_at_step", None)):
        if isinstance(step, int) and not isinstance(step, bool):
            return step
    return None


@dataclass
class Ending:
    """How a run ended: the exit code and the one line this process says last (None where
    another rank says it). ``said``: the heartbeat has said it already; ``peer``: another
    rank's failure stopped this one (that rank's own line names the cause); ``agreed``: every
    rank ended the same way at the same step, and rank 0 says it."""

    code: int
    line: str | None = None
    said: bool = False
    peer: bool = False
    agreed: bool = False  # every rank ended alike (the guard's stop): rank 0 says it


def _ending(error: BaseException, cfg: DictConfig, runner: Any) -> Ending:
    """The ending ``error`` makes of a run."""
    first = _rank(cfg) == 0
    if isinstance(error, ConfigError):  # every rank finds the same: rank 0 says it
        return Ending(EXIT_USAGE, error_line(error) if first else None)
    if isinstance(error, Preempted):
        return Ending(EXIT_PREEMPTED, f"preempted: {error}" if first else None)
    if isinstance(error, KeyboardInterrupt):
        return Ending(EXIT_INTERRUPTED, f"rank {_rank(cfg)}: interrupted")
    if isinstance(error, GuardStop):  # every rank stopped at the same step: rank 0 says it
        return Ending(EXIT_FAILED, f"rank {error.rank}, step {error.step}: GuardStop: "
                      f"{error.detail}" if first else None, agreed=True)
    if isinstance(error, PeerFailure):  # one line for the job, from one rank; no traceback
        return Ending(EXIT_FAILED, f"error: {error}", said=error.said, peer=True)
    step = _step(error, runner)
    where = f"rank {_rank(cfg)}" + (f", step {step}" if step is not None else "")
    return Ending(EXIT_FAILED, f"{where}: {type(error).__name__}: {one_line(error)}")


def _leave(ending: Ending) -> None:
    leave_report(ending.code, ending.line, ending.peer)


def _end(ending: Ending, error: BaseException, runner: Any) -> int:
    """Say how the run ended (a failure's traceback first, where the runner did not log
    it); returns the exit code."""
    _leave(ending)
    if ending.code == EXIT_FAILED and not (ending.peer or ending.agreed) and \
            getattr(runner, "failed_at_step", None) is None:
        traceback.print_exception(error, file=sys.stderr)
    if ending.code == EXIT_USAGE or ending.agreed:  # every rank found it; rank 0 says it
        say_refusal(ending.line)
    elif ending.line and not ending.said:
        _print_to_stderr(ending.line)
    return ending.code


def run(cfg: DictConfig, method: str, run_dir: RunDir | None = None) -> int:
    """Build the runner from ``cfg`` and call its ``method`` ('train' or 'test'); it writes
    in ``run_dir`` when given, else in the config's work_dir. A test's own directory
    (``TestDir``) gets the scores as ``scores.json``. A rank of a job of several then has
    ``dist_timeout`` to end: one stuck at exit says so and ends non-zero (``end_within``).
    A rank whose run failed in a collective ends at once, its output flushed (``_exit_now``).
    """
    ran: list[Any] = []
    try:
        code = _run(cfg, method, run_dir, ran)
    finally:
        if ran and ran[0].world_size > 1:
            end_within(get_timeout().total_seconds(), ran[0].rank)
    if ran and getattr(ran[0], "_owns_group", False) and is_distributed():
        _exit_now(code)
    return code


def _exit_now(code: int) -> NoReturn:
    """End this process with ``code`` now, its logs and output flushed, skipping the
    interpreter's shutdown. A run that failed in a collective leaves its group joined (a
    collective still waiting on a frozen peer would hold a destroy up for the timeout); the
    shutdown would then tear gloo down with the failed operation still queued, which aborts
    the process now and then ('terminate called without an active exception', exit -6 in
    place of the run's own code)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _run(cfg: DictConfig, method: str, run_dir: RunDir | None, ran: list[Any]) -> int:
    """``run``'s work; the runner, once built, goes into ``ran``."""
    runner = None
    try:
        from trainrun.runner.runner import Runner

        with Runner.from_cfg(cfg, run_dir) as runner:  # closed however it ends: see close
            ran.append(runner)
            try:
                result = getattr(runner, method)()
                if isinstance(runner.run_dir, TestDir) and runner.rank == 0:
                    scores = runner.run_dir.write_scores(cfg.load_from, cfg.data.test, result)
                    runner.logger.info("test: scores written to %s", scores)
            except BaseException as error:
                # under --nproc torchrun ends this process once another rank has exited:
                # leave the report now, before the run is closed
                _leave(_ending(error, cfg, runner))
                raise
    except SystemExit:
        raise
    except BaseException as error:  # checkpoint errors derive from BaseException
        return _end(_ending(error, cfg, runner), error, runner)
    _leave(Ending(EXIT_OK))
    return EXIT_OK


def dry_run(job: Job) -> int:
    """Print the plan (rank 0 only); nothing is initialised or written. A training set that
    leaves no batch is refused (exit 2), as the run would refuse it. An MMEngine config is
    planned by ``trainrun.compat.mmengine.plan``."""
    if job.mmengine is not None:
        from trainrun.compat.mmengine.plan import describe

        try:
            print(describe(job.mmengine, job.source))
        except ConfigError as error:
            return _usage_error(error)
        return EXIT_OK
    if _rank(job.cfg) == 0:
        try:
            plan = make_plan(job.cfg, job.world_size)
        except ConfigError as error:
            return _usage_error(error)
        for warning in plan.warnings:
            _print_to_stderr(f"warning: {warning}")
        print(describe_plan(job.cfg, world_size=job.world_size, dataset_length=plan.length,
                            param_groups=plan.groups, memory=plan.memory))
        if plan.why:
            print(f"  (train set size unknown: {plan.why})")
    return EXIT_OK


def launch(job: Job, nproc: int) -> int:
    """``--nproc``: refuse here what a dry run for ``nproc`` ranks refuses (exit 2, no worker
    started), then start the workers; the workers' rank 0 says the config's warnings."""
    try:
        make_plan(job.cfg, job.world_size)
    except ConfigError as error:
        return _usage_error(error)
    return launch_workers(nproc, job.worker_args)


def command(prepare: Any, argv: Sequence[str] | None, method: str) -> int:
    """Prepare the job from ``argv`` with ``prepare``, then dry-run it, start its workers
    (--nproc) or call the runner's ``method`` on it; returns the exit code."""
    import_from_working_directory()
    try:
        job = prepare(argv)
    except SystemExit as exit_:  # argparse: usage errors (2) and --help (0)
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    except ConfigError as error:
        return _usage_error(error)
    if job.dry_run:
        _report_warnings(job)
        return dry_run(job)
    if job.nproc is not None:
        return launch(job, job.nproc)
    _report_warnings(job)
    return run(job.cfg, method, job.run_dir)


def main(argv: Sequence[str] | None = None, command_name: str = "train") -> int:
    """``trainrun train`` (``command_name='plan'``: ``trainrun plan``, which passes
    --dry-run): returns the exit code."""
    return command(partial(prepare_train, command=command_name), argv, "train")
