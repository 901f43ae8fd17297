"""``trainrun train`` (``tools/train.py``), and what ``trainrun test`` shares with it.

Exit codes: 0 success; 2 a bad config or command line (one line on stderr naming the key or
argument, no traceback); 1 a failure while running (the traceback, then one line naming the
rank); 75 stopped by a preemption signal (``preemption.signals``) after writing a checkpoint
(requeued under SLURM where allowed; otherwise resume with --resume); 130 interrupted
(Ctrl-C). Nothing is written before the config is valid, and a dry run writes nothing.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from trainrun.cli import prog
from trainrun.cli.plan import describe_plan, env_rank, env_world_size
from trainrun.dist import PeerFailure, infer_launcher
from trainrun.dist.exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_PREEMPTED, EXIT_USAGE
from trainrun.dist.launch import STARTERS, DistInitError, launch_env, resolve_backend
from trainrun.dist.text import first_line
from trainrun.runner.builder import (
    build_meta_model,
    check_batches,
    check_types,
    plan_memory,
    plan_param_groups,
)
from trainrun.runner.config import (
    LAUNCHERS,
    ConfigError,
    dataset_kwargs,
    load_config,
    saved_config_changes,
)
from trainrun.runner.preemption import Preempted


@dataclass
class Job:
    """A validated config and what the command line asked to do with it."""

    cfg: DictConfig
    warnings: list[str] = field(default_factory=list)
    dry_run: bool = False
    world_size: int | None = None  # --world-size: the dry run plans for this many ranks


# ---------------------------------------------------------------- parsers

def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--launcher", choices=LAUNCHERS,
                        help="how the processes were started (wins over the config)")
    parser.add_argument("--work-dir", metavar="DIR", help="the run directory (wins over the "
                        "config's work_dir)")
    parser.add_argument("--cfg-options", nargs="+", action="extend", default=[],
                        metavar="KEY=VALUE",
                        help="dotlist overrides, e.g. optim.lr=0.01 strategy.type=ddp")
    parser.add_argument("--local-rank", "--local_rank", dest="local_rank", type=int,
                        help="set by torch.distributed.launch; fills LOCAL_RANK when unset")


def train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog("train", "train.py"),
                                     description="Train from a YAML config.")
    parser.add_argument("config", metavar="CONFIG", help="the YAML config")
    _add_common(parser)
    parser.add_argument("--resume", nargs="?", const=True, metavar="CKPT",
                        help="resume from CKPT (a checkpoint, or a run directory: its newest), "
                        "or from the newest checkpoint in work_dir")
    parser.add_argument("--force", action="store_true",
                        help="with --resume: go on even where this config differs from the "
                        "run's config.yaml in more than its length (config.yaml is then "
                        "updated, the old one kept beside it)")
    parser.add_argument("--amp", action="store_true",
                        help="mixed precision: bf16 (fp16 on a GPU without bf16)")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the config, print the plan, train nothing, write nothing")
    parser.add_argument("--world-size", type=_ranks, metavar="N",
                        help="with --dry-run: plan as if N ranks ran it (batch, iterations, "
                        "memory per rank); no process is started")
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
    parser = argparse.ArgumentParser(prog=prog("test", "test.py"),
                                     description="Test a checkpoint on the config's test data.")
    parser.add_argument("config", metavar="CONFIG", help="the YAML config")
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="the checkpoint to test")
    _add_common(parser)
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
    from trainrun.runner.checkpoint import check_checkpoint, is_checkpoint, resolve_checkpoint

    try:
        if run_directory and not is_checkpoint(path):
            resolve_checkpoint(path)
            return path
        return str(check_checkpoint(path))
    except (OSError, ValueError, pickle.UnpicklingError) as error:
        raise ConfigError(f"{key}: {error}") from None


def _check_resumed_config(cfg: DictConfig, force: bool) -> list[str]:
    """Refuse to resume a run whose config.yaml differs from ``cfg`` in more than its length
    (a changed model, data or optimiser would not resume the run it names), unless forced;
    returns the warning a forced resume gives."""
    saved_file = Path(cfg.work_dir) / "config.yaml"
    if not saved_file.is_file():
        return []
    changes = saved_config_changes(saved_file, cfg)
    if not changes:
        return []
    listed = "; ".join(changes[:12]) + (f"; and {len(changes) - 12} more"
                                        if len(changes) > 12 else "")
    what = f"{saved_file} (the run being resumed) differs in {len(changes)} key(s): {listed}"
    if force:
        return [f"resume: --force: {what}"]
    raise ConfigError(f"resume: {what}; pass --force to resume anyway")


def prepare_train(argv: Sequence[str] | None = None) -> Job:
    """Parse the train command line and load, override and validate the config.

    Raises SystemExit for argparse's usage errors and ConfigError for a bad config.
    """
    args = train_parser().parse_args(argv)
    fill_local_rank(args.local_rank)
    values = _command_line_values(args)
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
    if not args.dry_run:
        _check_launcher(cfg)
        _check_backend(cfg)
    return Job(cfg, warnings + _launcher_warnings(cfg), dry_run=args.dry_run,
               world_size=args.world_size)


def prepare_test(argv: Sequence[str] | None = None) -> Job:
    """Parse the test command line; the checkpoint becomes ``load_from`` (and no resume)."""
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
    _check_launcher(cfg)
    _check_backend(cfg)
    return Job(cfg, warnings + _launcher_warnings(cfg))


# ---------------------------------------------------------------- running

def _rank(cfg: DictConfig | None) -> int:
    """This process's rank: from the process group once joined, else from the environment."""
    from trainrun.dist import get_rank, is_distributed

    if is_distributed():
        return get_rank()
    launcher = cfg.launcher if cfg is not None else "none"
    return env_rank(launcher if launcher != "none" else infer_launcher())


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _usage_error(error: ConfigError) -> int:
    _say("error: " + " ".join(str(error).split("\n")))
    return EXIT_USAGE


def _report_warnings(job: Job) -> None:
    if _rank(job.cfg) == 0:
        for warning in job.warnings:
            _say(f"warning: {warning}")


def _step(error: BaseException, runner: Any) -> int | None:
    """The step a failure happened at: the exception's ``step``, else the training step the
    runner was in when it failed."""
    for step in (getattr(error, "step", None), getattr(runner, "failed_at_step", None)):
        if isinstance(step, int) and not isinstance(step, bool):
            return step
    return None


def _report_failure(error: BaseException, cfg: DictConfig, runner: Any) -> int:
    if getattr(runner, "failed_at_step", None) is None:  # else the runner logged it already
        traceback.print_exception(error, file=sys.stderr)
    step = _step(error, runner)
    where = f"rank {_rank(cfg)}" + (f", step {step}" if step is not None else "")
    _say(f"{where}: {type(error).__name__}: {first_line(error)}")
    return EXIT_FAILED


def run(cfg: DictConfig, method: str) -> int:
    """Build the runner from ``cfg`` and call its ``method`` ('train' or 'test')."""
    runner = None
    try:
        from trainrun.runner.runner import Runner

        with Runner.from_cfg(cfg) as runner:  # closed however it ends: see Runner.close
            getattr(runner, method)()
    except ConfigError as error:  # every rank finds the same: rank 0 says it
        return _usage_error(error) if _rank(cfg) == 0 else EXIT_USAGE
    except Preempted as stop:
        if _rank(cfg) == 0:
            _say(f"preempted: {stop}")
        return EXIT_PREEMPTED
    except KeyboardInterrupt:
        _say(f"rank {_rank(cfg)}: interrupted")
        return EXIT_INTERRUPTED
    except PeerFailure as error:  # one line for the job, from one rank; no traceback
        if not error.said:
            _say(f"error: {error}")
        return EXIT_FAILED
    except SystemExit:
        raise
    except BaseException as error:  # checkpoint errors derive from BaseException
        return _report_failure(error, cfg, runner)
    return EXIT_OK


def train_set_length(cfg: DictConfig) -> tuple[int | None, str | None]:
    """The train set's length, built through ``trainrun.examples.resolve``, or None and why."""
    from torch.utils.data import IterableDataset

    try:
        from trainrun.examples import resolve
    except ImportError:
        return None, "trainrun.examples.resolve is not available"
    train = cfg.data.train
    try:
        dataset = resolve("dataset", train.type)(**dataset_kwargs(train))
        if isinstance(dataset, IterableDataset):  # dealt to ranks in rounds, not by a sampler
            return None, f"data.train is a stream ({type(dataset).__name__}, an IterableDataset)"
        return len(dataset), None
    except Exception as error:  # a plan reports what it cannot know, it does not fail
        return None, (f"could not build data.train: {type(error).__name__}: "
                      f"{first_line(error)}")


def dry_run(job: Job) -> int:
    """Print the plan (rank 0 only); nothing is initialised or written. A training set that
    leaves no batch is refused (exit 2), as the run would refuse it."""
    if _rank(job.cfg) == 0:
        world_size = job.world_size or env_world_size(job.cfg.launcher)[0]
        length, why = train_set_length(job.cfg)
        if length is not None:
            train = job.cfg.data.train
            try:
                check_batches("data.train", length, world_size, train.batch_size,
                              train.drop_last)
            except ConfigError as error:
                return _usage_error(error)
        plain = OmegaConf.to_container(job.cfg, resolve=True)
        try:
            model = build_meta_model(plain)  # once, for the groups and the memory plan
            groups, warnings = plan_param_groups(plain, model)
            memory = plan_memory(plain, world_size, model)
        except ConfigError as error:
            return _usage_error(error)
        for warning in warnings:
            _say(f"warning: {warning}")
        print(describe_plan(job.cfg, world_size=job.world_size, dataset_length=length,
                            param_groups=groups, memory=memory))
        if why:
            print(f"  (train set size unknown: {why})")
    return EXIT_OK


def command(prepare: Any, argv: Sequence[str] | None, method: str) -> int:
    """Prepare the job from ``argv`` with ``prepare``, then dry-run it or call the runner's
    ``method`` on it; returns the exit code."""
    try:
        job = prepare(argv)
    except SystemExit as exit_:  # argparse: usage errors (2) and --help (0)
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    except ConfigError as error:
        return _usage_error(error)
    _report_warnings(job)
    if job.dry_run:
        return dry_run(job)
    return run(job.cfg, method)


def main(argv: Sequence[str] | None = None) -> int:
    """``trainrun train``: returns the exit code."""
    return command(prepare_train, argv, "train")
