"""The runner: builds a run from one config (or from objects) and trains, validates, tests.

Order of work in ``__init__``: join the job, seed every rank, build model and data, let the
strategy wrap the model and build the optimiser, schedule the run, choose (and verify) the
checkpoint to resume or load from, and only then prepare the run directory and the log;
metrics and hooks last. ``train()`` resumes or loads weights first, then loops.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn
from torch.utils.data import DataLoader

from trainrun.checkpoint.manager import CheckpointManager, resolve_checkpoint
from trainrun.checkpoint.read import read_weights
from trainrun.checkpoint.resume import StartPoint
from trainrun.dist import (
    PeerFailure,
    at_checkpoint,
    finish_together,
    get_dist_info,
    init_dist,
    is_comm_error,
    is_distributed,
    leave_dist,
    phase,
    report_place,
    set_phase,
    watch_ranks,
)
from trainrun.dist.timeouts import get_timeout
from trainrun.runner.builder import build_model
from trainrun.runner.config import (
    DEFAULT_DIST_TIMEOUT,
    ConfigError,
)
from trainrun.runner.evaluation import BaseMetric
from trainrun.runner.failures import failures_told, training_failures
from trainrun.runner.hooks import Hook, IterTimerHook
from trainrun.runner.hooks.guard import GuardHook, check_guard
from trainrun.runner.hooks.logger import LoggerHook, check_logging
from trainrun.runner.lock import RunLock
from trainrun.runner.logging import attach_log_file, log_restart, setup_logging
from trainrun.runner.loops import EvalLoop, TrainLoop, check_schedule
from trainrun.runner.parts import PartBuilder, runner_arguments
from trainrun.runner.preemption import StopRequest, check_preemption, stop_signals
from trainrun.runner.run_dir import RunDir
from trainrun.runner.seed import check_randomness, set_random_seed
from trainrun.runner.state_parts import check_strategy_change, resume_run, train_state
from trainrun.runner.stream import is_stream
from trainrun.wrappers import Strategy


class Runner:
    """Trains, validates and tests one model under one strategy.

    Every part may be given as an object or as its config section (a dict); ``from_cfg``
    passes the sections of a validated config. Building the runner does everything a bad
    config can fail on before anything is written: it joins the job, seeds every rank, builds
    model and data, lets the strategy wrap the model and build the optimiser, schedules the
    run and chooses (and verifies) the checkpoint to resume or load from; only then does it
    prepare ``work_dir`` and ``train.log``, then the hooks.

    Use it as a context manager, so that it lets go of the run directory and of the process
    group it joined even when training fails::

        with Runner.from_cfg(cfg) as runner:
            runner.train()

    (or call ``close`` when done). Hooks read the runner's state through these attributes.

    Attributes:
        rank: this process's global rank.
        world_size: the number of processes in the job.
        device: the device this rank computes on (its CUDA device, else the CPU).
        seed: the random seed of the run (rank 0's, on every rank).
        work_dir: the run directory, as a ``Path``.
        run_dir: the run directory as a ``RunDir``: the paths of what the run keeps there.
        logger: the ``trainrun`` logger (the console; ``train.log`` on rank 0).
        cfg: the config the runner was built from (None for one built from objects).
        model: the model as the strategy wrapped it (its ``train_step``, ``val_step`` and
            ``test_step`` are what the loops call).
        optimizer: the torch optimiser, or a dict of them by submodule; None without
            training data.
        optim_wrapper: what ``train_step`` gets: an ``OptimWrapper`` (an ``OptimWrapperDict``
            for several optimisers) or the strategy's own; None without training data.
        strategy: the ``Strategy`` that wrapped the model and writes its checkpoints.
        schedulers: the learning-rate schedulers, one per optimiser (stepped after every
            training iteration).
        train_dataloader: the training loader, or None.
        val_dataloader: the validation loader, a dict of them by set name, or None.
        test_dataloader: the test loader, or None.
        val_metrics: the validation metrics (a dict of lists by set name for several sets).
        test_metrics: the test metrics.
        hooks: every hook, built-in ones included, in the order they run (by ``priority``).
        epoch: the epoch being trained, counting from 0; by the time ``after_train_epoch``
            runs it counts the finished epochs.
        iter: the training iterations finished so far (the global step).
        max_epochs: the epochs the schedule trains (from ``max_iters`` rounded up when the
            schedule counts iterations).
        max_iters: the iterations the schedule trains (after a resume: in this job's steps).
        by_epoch: whether the schedule counts epochs (else iterations).
        training: whether ``train`` is running (validation inside training sees True).
        stop_reason: why training ends early (set by ``request_stop``), else None.
        load_from: the checkpoint whose weights ``train`` and ``test`` start from, or None.
        precision: ``'fp32'``, ``'bf16'`` or ``'fp16'``.

    Args:
        model: the model (a ``BaseModel``, or any module meeting the step contract), or its
            config section: ``{'type': name or import path, **arguments}``.
        work_dir: the run directory: ``config.yaml``, ``metrics.jsonl``, ``train.log`` and
            ``checkpoints/`` are written there; or a ``RunDir`` (a ``TestDir`` for a test of
            its own, which writes ``test.log``).
        train_dataloader: the training data: a ``DataLoader`` or a data section
            (``{'type': ..., 'batch_size': ..., ...}``); None: no training (and no optimiser).
        val_dataloader: the validation data, as ``train_dataloader``; or several named sets,
            a dict of names to loaders or sections, reported as ``val/<name>/<metric>``.
            None: no validation.
        test_dataloader: the test data, as ``train_dataloader``; None: no testing.
        optim: the ``optim`` section (optimiser type and arguments, ``clip_grad``,
            ``accumulate``, ``paramwise``, ``per_module``), or a function that builds the
            optimiser (or a dict of them) from the unwrapped model.
        scheduler: the ``scheduler`` section; None: a constant learning rate. From Python it
            may also be a function ``(optimizer, max_iters) -> LRScheduler`` that makes the
            scheduler of each optimiser (stepped once per iteration; its ``state_dict`` is
            checkpointed).
        strategy: a ``Strategy``, a registered strategy's name (``'none'``, ``'ddp'``,
            ``'separate_ddp'``, ``'fsdp'``, ``'deepspeed'``) or ``{'type': name, **options}``.
        precision: ``'fp32'``, ``'bf16'`` or ``'fp16'``: autocast in that precision (fp16 with
            a gradient scaler).
        compile: False (no compiling), True (torch.compile with every default) or the
            ``compile`` section's options; the strategy says what it compiles.
        schedule: the ``schedule`` section (``max_epochs`` or ``max_iters``, ``val_interval``);
            None: the defaults.
        val_metrics: the validation metrics; for several validation sets a dict of lists by
            set name, or one list every set is scored with in turn. None: those each
            validation section names under ``metrics``, else its data set's
            ``DEFAULT_METRICS``.
        test_metrics: the test metrics; None: as for ``val_metrics``.
        hooks: hooks besides the built-in ones: ``Hook`` objects, or ``hooks`` items of a
            config (``{'type': ..., 'priority': ..., **options}``), which are built; each is
            checked against the built run (``Hook.check``).
        randomness: the ``randomness`` section (``seed``, ``deterministic``,
            ``diff_rank_seed``); None: the defaults.
        logging: the ``logging`` section (``interval``, ``backends``, ...); None: the defaults.
        checkpoint: the ``checkpoint`` section (``interval``, ``max_keep``, ``save_last``,
            ``save_best``, ...); None: the defaults.
        preemption: the ``preemption`` section: the signals that stop training at a step
            boundary with a checkpoint; None: the defaults.
        guard: the ``guard`` section: what a run that goes wrong numerically (a value that is
            not finite, a loss spike) makes training do; None: the defaults (stop at a value
            that is not finite; no spike watch).
        resume: False: start afresh; True: continue from the newest intact checkpoint in
            ``work_dir`` (from the beginning while there is none); a path: that checkpoint,
            or the newest intact one of that run directory.
        load_from: a checkpoint (or a run directory, for its newest) whose model weights alone
            (no optimiser, no position) ``train`` and ``test`` start from.
        launcher: how to join the job when no process group is up yet: ``'none'`` (one
            process), ``'pytorch'``, ``'slurm'`` or ``'mpi'``. A group the runner joined is
            left by ``close``.
        backend: the communication backend when the runner joins: ``'auto'``, ``'nccl'``,
            ``'gloo'`` or ``'mpi'``.
        dist_timeout: the seconds every collective may wait.
        cfg: the whole config the parts come from (``from_cfg`` passes it): written to
            ``config.yaml`` and given to the trackers; None for a runner built from objects.

    Raises:
        ConfigError: a section, a hook's option or the checkpoint to start from that the run
            cannot use (a damaged checkpoint, or another model's); raised before anything is
            written.
        RunDirectoryBusy: another live job holds ``work_dir``.
    """

    def __init__(
        self,
        model: nn.Module | Mapping[str, Any],
        work_dir: str | os.PathLike | RunDir,
        train_dataloader: DataLoader | Mapping[str, Any] | None = None,
        val_dataloader: DataLoader | Mapping[str, Any] | None = None,  # or a dict of either
        test_dataloader: DataLoader | Mapping[str, Any] | None = None,
        optim: Mapping[str, Any] | Callable[[nn.Module], Any] | None = None,
        scheduler: Mapping[str, Any] | Callable[[Any, int], Any] | None = None,
        strategy: str | Mapping[str, Any] | Strategy = "ddp",
        precision: str = "fp32",
        compile: bool | Mapping[str, Any] = False,
        schedule: Mapping[str, Any] | None = None,
        val_metrics: Sequence[BaseMetric] | Mapping[str, Sequence[BaseMetric]] | None = None,
        test_metrics: Sequence[BaseMetric] | None = None,
        hooks: Sequence[Hook | Mapping[str, Any]] = (),
        randomness: Mapping[str, Any] | None = None,
        logging: Mapping[str, Any] | None = None,
        checkpoint: Mapping[str, Any] | None = None,
        preemption: Mapping[str, Any] | None = None,
        guard: Mapping[str, Any] | None = None,
        resume: bool | str = False,
        load_from: str | None = None,
        launcher: str = "none",
        backend: str = "auto",
        dist_timeout: float = DEFAULT_DIST_TIMEOUT,
        cfg: Any = None,
    ) -> None:
        self.cfg = cfg
        self._owns_group = launcher != "none" and not is_distributed()
        if self._owns_group:
            init_dist(launcher, backend, timeout=dist_timeout)
        try:  # a config every rank refuses, or a rank's own failure, leaves the group
            self.rank, self.world_size = get_dist_info()
            self.device = torch.device("cuda", torch.cuda.current_device()) \
                if torch.cuda.is_available() else torch.device("cpu")
            self.seed = set_random_seed(**check_randomness("randomness", randomness))
            self.resume_from = resume
            self.stop_signals = check_preemption("preemption", preemption)["signals"]
            self.load_from = load_from
            self.run_dir = work_dir if isinstance(work_dir, RunDir) else RunDir(work_dir)
            self.work_dir = self.run_dir.path
            # the console now; train.log (with what was logged before) once the run directory is
            # made, after everything the config describes was built: a config that cannot be
            # built leaves no trace on disk
            self.logger = setup_logging(hold_for_file=self.rank == 0)
            log_restart(self.logger)
            self.precision = precision

            model = self.prepare_model(build_model(model) if isinstance(model, Mapping)
                                       else model)
            shapes = {key: tuple(value.shape) for key, value in model.state_dict().items()}
            build = PartBuilder(self)
            self.strategy = build.strategy(strategy)  # it says which ranks share batches
            self.train_dataloader = build.loader(train_dataloader, "train")
            self.val_dataloader = build.val_loaders(val_dataloader)
            self.test_dataloader = build.loader(test_dataloader, "test")
            build.check_train_batches(self.train_dataloader, train_dataloader)
            self.val_metrics = build.val_metrics(val_metrics, val_dataloader)
            self.test_metrics = build.metrics(test_metrics, test_dataloader,
                                              self.test_dataloader, "data.test")

            self.model, self.optimizer, self.optim_wrapper = build.wrapped_model(
                model, optim, compile, precision)

            schedule = check_schedule("schedule", schedule)
            self.by_epoch, self.max_epochs, self.max_iters = build.schedule_length(
                schedule, self.train_dataloader)
            self.schedulers = build.schedulers(scheduler, self.optimizer, self.max_iters)

            checkpoint = build.checkpoint_section(checkpoint)
            self.checkpoints = CheckpointManager(self.run_dir.checkpoints, self.strategy,
                                                 max_keep=checkpoint["max_keep"])
            # a damaged checkpoint, another model's, one holding other parameter groups, a hook's
            # bad option or the logging's: refused before anything is written
            self._start = StartPoint(self.checkpoints.directory, refusal=ConfigError)
            self.start_from = self._start.choose(resume, load_from)
            self._start.check_fits(self.start_from, shapes,
                                  self.strategy.optimizer_groups(self.optimizer))
            check_strategy_change(self, optim)
            extra_hooks = build.extra_hooks(hooks)
            logging = build.section(check_logging, "logging", logging)
            guard = check_guard("guard", guard)
            # rank 0 makes the run directory, locks it, writes config.yaml and starts the log
            # (train.log; a test's test.log)
            self.run_lock: RunLock | None = self.run_dir.prepare(self.rank, cfg, bool(resume))
            if self.rank == 0:
                attach_log_file(self.run_dir.log)
            self.metrics_file = self.run_dir.metrics_file()
            self.timer = IterTimerHook(count_batches=logging["step_metrics"])
            # built where there is training: the checkpoints ask it before they are written
            self.guard = GuardHook(**guard, interval=logging["interval"]) \
                if self.train_dataloader is not None else None
            self.hooks = build.hooks(extra_hooks, logging, checkpoint, schedule["val_interval"],
                                     schedule["val_begin"])
            self.epoch = 0  # the epoch being trained (0-based); finished epochs after it ends
            self.iter = 0  # finished training iterations
            self.stop_request: StopRequest | None = None  # while training: a stop signal, if any
            self.stop_reason: str | None = None  # why training ends early (`request_stop`)
            self.training = False
            self.failed_at_step: int | None = None  # the step training was in when it raised
            loader = self.train_dataloader  # a stream may have no length to test
            self.train_loop = TrainLoop(self, loader) if is_stream(loader) or loader else None
        except BaseException as error:
            self._leave_group(error)
            raise

    # ------------------------------------------------------------------ building

    @classmethod
    def from_cfg(cls, cfg: DictConfig | Mapping[str, Any],
                 run_dir: RunDir | None = None) -> Runner:
        """Build a runner from a config loaded and validated by ``trainrun.runner.config``.

        Args:
            cfg: the validated config (an OmegaConf ``DictConfig`` or a plain mapping); its
                sections become the constructor's arguments, and the config itself its
                ``cfg``.
            run_dir: where the run writes, in place of the config's ``work_dir`` (a test's
                own ``TestDir``); None: ``work_dir``.

        Returns:
            The runner, built (the process group joined when ``launcher`` says so).

        Raises:
            ConfigError: what the constructor raises for a config the run cannot use.
        """
        arguments = runner_arguments(cfg)
        return cls(**(arguments if run_dir is None else {**arguments, "work_dir": run_dir}))

    # ------------------------------------------------------------------ running

    def call_hook(self, name: str, *args: Any) -> None:
        """Call every hook's ``name`` method in priority order, with the runner and ``args``.

        Args:
            name: the hook point, e.g. ``'after_val'``.
            *args: what the hook point takes after the runner (e.g. the metrics).
        """
        for method in self.hook_methods(name):
            method(self, *args)

    def hook_methods(self, name: str) -> list[Callable[..., None]]:
        """The hooks' ``name`` methods in their order, leaving out ``Hook``'s own (which do
        nothing). The training loop takes a step's once an epoch.

        Args:
            name: the hook point, e.g. ``'after_train_iter'``.

        Returns:
            The bound methods, in the order the hooks run.
        """
        noop = getattr(Hook, name)
        return [method for method in (getattr(hook, name) for hook in self.hooks)
                if getattr(method, "__func__", None) is not noop]

    def request_stop(self, reason: str) -> None:
        """End training after the hooks of the current step (or epoch): a checkpoint of that
        step is written and the run ends as a finished one, logging ``reason``. Every rank
        must ask at the same step (decide from numbers every rank has, such as rank 0's
        validation metrics): the ranks do not vote.

        Args:
            reason: why training stops, in words (logged when the run ends); the first
                request's reason is kept.
        """
        if self.stop_reason is None:
            self.stop_reason = reason

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """The built model, before the strategy wraps it; a subclass's place to change it
        (the MMEngine compat Runner initialises its weights here). As it is, by default.

        Args:
            model: the model, built (after the seeding) or as it was given.

        Returns:
            The model the strategy wraps.
        """
        return model

    def train_done(self) -> bool:
        """Whether training is over: a stop was requested, or the schedule is complete.

        Returns:
            True once ``request_stop`` was called or ``max_epochs`` (``max_iters``) are done.
        """
        if self.stop_reason is not None:
            return True
        if self.by_epoch:
            return self.epoch >= self.max_epochs
        return self.iter >= self.max_iters

    def train(self) -> nn.Module:
        """Resume (or load weights) as configured, then train to the end of the schedule.

        Hooks run from ``before_run`` to ``after_run``; validation and checkpoints come from
        the built-in hooks. A failure is logged with the rank and the step, the other ranks
        are told, and every hook's ``on_error`` runs before it is raised. The trackers' runs
        close last, with the run's outcome: finished once every ``after_run`` is done, failed
        (or killed) by whatever exception ends the run, ``after_run``'s included. Every rank
        must call this.

        Returns:
            The trained model, as the strategy wrapped it.

        Raises:
            ValueError: the runner has no training data.
            ConfigError: the checkpoint to resume from does not fit this run's optimiser.
            Preempted: a stop signal ended training (after saving a checkpoint).
            PeerFailure: another rank failed or went silent.
        """
        if self.train_loop is None:
            raise ValueError("train() needs a training data loader (data.train in the config)")
        at_checkpoint(None)
        if self.start_from is not None:  # ("resume" or "load_from", path)
            how, path = self.start_from
            (self.resume if how == "resume" else self.load_weights)(path)
        if self.by_epoch:  # the steps an epoch has depend on the number of ranks
            self.max_iters = self.iter + self.train_loop.steps_left()
        self.optim_wrapper.set_total(self.iter, self.max_iters)
        self.training = True
        self.call_hook("before_run")
        try:
            # the heartbeat goes on through after_run: a rank that hangs there is ended by it
            # once another rank has named it (see close), whatever the launcher does
            with watch_ranks(get_timeout().total_seconds(), training=True) as heartbeat:
                # a stop signal that comes while a failure is being explained (torchrun passing
                # one on as it gives up) is only recorded: the explanation is what the user needs
                with stop_signals(self.stop_signals) as self.stop_request:
                    try:
                        with training_failures(self, heartbeat):
                            self.train_loop.run()
                    finally:
                        self.training = False
                        self.stop_request = None
                if self.stop_reason is not None and self.checkpoints.last_saved is not None:
                    self.logger.info("%s; checkpoint %s written", self.stop_reason,
                                     self.checkpoints.last_saved.name)
                set_phase("after_run hooks")
                report_place()  # where the job would end if this rank hung now
                self.call_hook("after_run")
        except BaseException as error:  # closed by on_error already, unless after it
            self._close_trackers(error)
            raise
        self._close_trackers(None)
        return self.model

    def _close_trackers(self, error: BaseException | None) -> None:
        """The trackers' runs, closed as ``error`` (None: finished) ends the run; those that
        are closed already (a failure in training closes them in ``on_error``) stay so."""
        for hook in self.hooks:
            if isinstance(hook, LoggerHook):
                hook.close_trackers(error)

    def val(self) -> dict[str, float]:
        """Validate on the val data; every rank gets the metrics (with several validation
        sets, each set's as ``val/<name>/<metric>``).

        Every rank must call this: each scores its share of the data, rank 0 computes the
        metrics. The hooks' ``before_val`` and ``after_val`` run around it.

        Returns:
            The metrics by name, e.g. ``{'accuracy': 0.95}``.

        Raises:
            ValueError: the runner has no validation data.
            MetricError: a metric's ``compute`` failed on rank 0 (raised on every rank).
        """
        if self.val_dataloader is None:
            raise ValueError("val() needs a validation data loader (data.val in the config)")
        return EvalLoop(self, self.val_dataloader, self.val_metrics, "val").run()

    def test(self) -> dict[str, float]:
        """Test on the test data (loading ``load_from`` first when set).

        Every rank must call this, as ``val``; the hooks' ``before_test`` and ``after_test``
        run around it. ``load_from`` is loaded only outside training (a test inside training
        scores the weights being trained).

        Returns:
            The metrics by name.

        Raises:
            ValueError: the runner has no test data.
            MetricError: a metric's ``compute`` failed on rank 0 (raised on every rank).
            PeerFailure: another rank failed or went silent.
        """
        if self.test_dataloader is None:
            raise ValueError("test() needs a test data loader (data.test in the config)")
        if self.load_from and not self.training:
            self.load_weights(self.load_from)
        loop = EvalLoop(self, self.test_dataloader, self.test_metrics, "test")
        if self.training:
            return loop.run()
        with watch_ranks(get_timeout().total_seconds()) as heartbeat, failures_told(heartbeat):
            return loop.run()

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_tag(self) -> str:
        """The name of a checkpoint of the current position.

        Returns:
            ``iter_<iter>`` when the schedule counts steps; ``epoch_<epoch>`` at an epoch's
            end, and ``epoch_<epoch>_iter_<iter>`` inside the next epoch (a stop signal's).
        """
        if not self.by_epoch:
            return f"iter_{self.iter}"
        inside = getattr(self.train_loop, "inside_epoch", False)
        return f"epoch_{self.epoch}_iter_{self.iter}" if inside else f"epoch_{self.epoch}"

    def save_checkpoint(self, name: str | None = None, update_last: bool = True,
                        background: bool = False) -> Path | None:
        """Save a checkpoint on every rank (all must call this); returns its path. With
        ``background`` it is written while training goes on (see ``CheckpointManager.save``).

        The hooks' ``before_checkpoint_save`` runs first, then the guard looks at the values
        since its last look, the weights and the optimiser state (`GuardHook.may_save`):
        nothing that is not finite is ever written. The checkpoint holds the model, the
        optimiser, the schedulers, the position, every rank's RNG states, the sampler's place
        and the hooks' states.

        Args:
            name: the checkpoint's name; None: ``checkpoint_tag()``.
            update_last: point ``checkpoints/last`` at it (and prune old ones to ``max_keep``).
            background: return once the state is copied in memory; the checkpoint becomes
                visible when every rank's part is on disk.

        Returns:
            The path the checkpoint has (or will have) under ``checkpoints/``; None where the
            guard kept it from being written (``guard.nonfinite: warn``, weights not finite).

        Raises:
            trainrun.runner.hooks.guard.GuardStop: the guard says stop.
            trainrun.runner.hooks.guard.RollBack: it says roll back (the loop catches it).
        """
        self.call_hook("before_checkpoint_save")
        if self.guard is not None and not self.guard.may_save(self):
            return None
        with phase("checkpoint save"):
            return self.checkpoints.save(name or self.checkpoint_tag(), self.model,
                                         self.optimizer, train_state(self).state_dict(),
                                         update_last, background, step=self.iter)

    def resume(self, path: str | os.PathLike) -> None:
        """Continue exactly where the checkpoint at ``path`` stopped (verified first).

        Loads model, optimiser, schedulers, position, sampler, hooks' states and RNG states
        (the latter only when the world size is the one that saved it; otherwise random
        streams restart, said in a warning). Every rank must call this. Rank 0 then takes out
        of ``metrics.jsonl`` the lines that steps after the checkpoint logged (a run killed
        after it had gone on) and marks the resume there, so that each step has one line.

        Args:
            path: the checkpoint (a file, or a directory for sharded strategies).

        Raises:
            ConfigError: the checkpoint is damaged, or its optimiser state does not fit this
                run's optimiser.
        """
        resume_run(self, self._start.verified("resume", Path(path)))

    def load_weights(self, path: str | os.PathLike) -> None:
        """Load only the model's weights (no optimiser, no position) from ``path`` (a
        checkpoint, or a work_dir for its newest; verified first).

        Args:
            path: a checkpoint, or a run directory (or its ``checkpoints`` directory), whose
                ``last`` names the newest.

        Raises:
            FileNotFoundError: ``path`` does not exist or names no checkpoint.
            ConfigError: the checkpoint is damaged.
        """
        path = self._start.verified("load_from", resolve_checkpoint(path))
        self.strategy.load_model_state_dict(self.model, read_weights(path))
        self.logger.info("loaded weights from %s", path)

    # ------------------------------------------------------------------ teardown

    def __enter__(self) -> Runner:
        """Use the runner in a ``with`` block, which ends with ``close``.

        Returns:
            The runner itself.
        """
        return self

    def __exit__(self, exc_type: type | None, error: BaseException | None,
                 traceback: object) -> None:
        """``close(error)``: the exception that ended the block, if any, is passed on (and
        not suppressed)."""
        self.close(error)

    def close(self, error: BaseException | None = None) -> None:
        """Let go of the run directory, drop model and optimiser, wait for the other ranks to
        finish too, then leave the process group if this runner joined it (``error``: what
        ended the run, if any).

        A run that ended normally waits (at most ``dist_timeout``) until every rank has come
        here: a rank that hangs after training (in its last hooks, or before it closes) is
        named then, and the error raised on every rank that waited (a non-zero exit, which
        makes a launcher such as torchrun end the hung rank). What is published under
        ``checkpoints/`` stays as it is. DDP's reducer must be gone before the group is
        destroyed, or gloo can abort at exit. After a failed collective the group is not
        destroyed: a collective still waiting on a frozen peer would hold the destroy up for
        the timeout.

        Args:
            error: the exception that ended the run, or None.

        Raises:
            PeerFailure: another rank did not finish within ``dist_timeout`` of this one.
        """
        self.checkpoints.abandon()
        self.metrics_file.close()
        if self.run_lock is not None:
            self.run_lock.release()
        self.model = self.optimizer = self.optim_wrapper = self.train_loop = None
        try:
            if error is None:
                finish_together(get_timeout().total_seconds())
        finally:
            self.strategy.teardown()
            self._leave_group(error)

    def _leave_group(self, error: BaseException | None) -> None:
        """Leave the process group this runner joined (`dist.leave_dist` says why before the
        interpreter shuts down). Not after a failed collective: a collective still waiting on a
        frozen peer would hold the destroy up for the timeout."""
        if error is not None and (isinstance(error, PeerFailure) or is_comm_error(error)):
            return
        if self._owns_group:
            leave_dist()
        else:  # free DDP's reducer now, before whoever joined the group leaves it
            gc.collect()
