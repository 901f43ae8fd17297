"""Trackers: where a run's numbers go besides the console and ``metrics.jsonl``.

A tracker is any class with these three methods (subclassing ``Tracker`` is optional); rank 0
makes one of each listed in ``logging.backends``, without arguments, and calls:

``start(run_dir, config, resume)``
    once, before the first training step: the run directory (a ``Path`` that exists), the
    resolved config as plain dicts and lists (empty for a runner built from objects), and
    whether the run resumes from a checkpoint.
``log(values, step)``
    at every logged line: ``{"train/loss": ..., "train/lr": ..., ...}`` for a training line,
    ``{"val/accuracy": ...}`` for a validation one; ``step`` is the global iteration.
``finish()``
    once, when the run has finished (``train()`` returns, after every hook's ``after_run``).
``fail(error)``, optional
    instead of ``finish`` when the run ends by an exception (a failure in training, in
    validation, in a hook or in another tracker's start, another rank's failure, a stop
    signal, Ctrl-C), so that the tracker can close its run as failed or killed; a tracker
    without it gets ``finish()``. No collectives: another rank may be gone. When the
    heartbeat ends a rank stuck in a collective (another rank failed or went silent), this is
    called from the heartbeat's thread, with a ``PeerFailure``, before the process ends.

The shipped ones are ``tensorboard``, ``wandb`` and ``mlflow``; ``logging.backends`` takes any
other by import path (``my_project.trackers.MyTracker``).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import re
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainrun.checkpoint.files import write_atomically
from trainrun.exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_PREEMPTED
from trainrun.registry import TRACKERS
from trainrun.runner.logging import get_logger
from trainrun.runner.preemption import Preempted
from trainrun.runner.schema import ConfigError, bad_value, choice

METHODS = ("start", "log", "finish")  # the interface


class Tracker:
    """The interface of a tracker; the methods say what each call brings (see the module).

    A tracker is any class with ``start``, ``log`` and ``finish`` (subclassing this one is
    optional; ``fail`` is optional too). Rank 0 alone makes one of each listed in
    ``logging.backends``, without arguments: by a shipped name (``tensorboard``, ``wandb``,
    ``mlflow``) or by import path (``my_project.trackers.MyTracker``). No collectives in any
    of its methods: they run on rank 0 only.
    """

    def start(self, run_dir: Path, config: dict[str, Any], resume: bool) -> None:
        """Open the tracker's run (its files under ``run_dir``, ``config`` as its parameters).

        Called once, before the first training step.

        Args:
            run_dir: the run directory (it exists).
            config: the resolved config as plain dicts and lists (empty for a runner built
                from objects).
            resume: whether the run resumes from a checkpoint (a tracker may continue its
                earlier run).
        """

    def log(self, values: dict[str, float], step: int) -> None:
        """Record ``values`` at ``step``.

        Called at every logged line.

        Args:
            values: ``{'train/loss': ..., 'train/lr': ..., ...}`` for a training line,
                ``{'val/accuracy': ...}`` for a validation one.
            step: the global iteration.
        """

    def finish(self) -> None:
        """Close the tracker's run.

        Called once, when the run has finished (or from this default ``fail``).
        """

    def fail(self, error: BaseException) -> None:
        """Close the tracker's run, which ``error`` ended (this default: as ``finish``).

        Called instead of ``finish`` when the run ends by an exception (a failure, a stop
        signal, Ctrl-C, another rank's failure), so that the tracker can close its run as
        failed or killed. No collectives: another rank may be gone.

        Args:
            error: the exception that ended training.
        """
        self.finish()


def stopped(error: BaseException) -> bool:
    """Whether ``error`` is a stop (a signal, Ctrl-C) rather than a failure."""
    return isinstance(error, (Preempted, KeyboardInterrupt))


def exit_code(error: BaseException) -> int:
    """The exit code ``trainrun train`` ends with when ``error`` ends the run: 75 for a stop
    signal, 130 for Ctrl-C, 1 for a failure (`trainrun.exits`)."""
    if isinstance(error, Preempted):
        return EXIT_PREEMPTED
    if isinstance(error, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    return EXIT_FAILED


def close_tracker(tracker: Any, error: BaseException | None) -> None:
    """Close ``tracker``'s run: ``finish()`` for a run that finished (``error`` None), else
    ``fail(error)``, or ``finish()`` for a tracker without ``fail``."""
    fail = getattr(tracker, "fail", None) if error is not None else None
    if fail is not None:
        fail(error)
    else:
        tracker.finish()


def _stored_id(path: Path, resume: bool) -> str | None:
    """The tracker run id a resumed run continues (kept in the run directory), else None."""
    if resume and path.is_file():
        return path.read_text(encoding="utf-8").strip() or None
    return None


class TensorBoardTracker(Tracker):
    """Scalars under ``<run_dir>/tensorboard``, tagged ``train/<name>`` and ``val/<name>``.

    Named ``tensorboard`` in ``logging.backends``; it needs the tensorboard package
    (``pip install trainrun[tensorboard]``; a config naming it without the package is
    refused). It takes no arguments. However the run ends, what it wrote is flushed to disk
    and the writer closed.
    """

    def start(self, run_dir: Path, config: dict[str, Any], resume: bool) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def finish(self) -> None:
        self.writer.close()  # flushes first


class WandbTracker(Tracker):
    """A Weights & Biases run with its files under ``<run_dir>/wandb``, the config as its
    config. Offline unless ``WANDB_MODE`` says otherwise (``wandb sync`` uploads it later);
    project ``WANDB_PROJECT`` or ``trainrun``; named after the config's ``name``. A resumed
    run continues the same W&B run (its id is kept in ``<run_dir>/wandb_run_id``).

    Named ``wandb`` in ``logging.backends``; it needs the wandb package
    (``pip install trainrun[wandb]``). It takes no arguments: the environment variables
    above configure it. The W&B run ends with the exit code ``trainrun train`` ends with
    (`exit_code`): 0 when it finished, 1 when it failed, 75 when a stop signal ended it, 130
    on Ctrl-C; W&B shows a run with a code other than 0 as failed.
    """

    ID_FILE = "wandb_run_id"

    def start(self, run_dir: Path, config: dict[str, Any], resume: bool) -> None:
        import wandb

        run_id = _stored_id(run_dir / self.ID_FILE, resume) or uuid.uuid4().hex[:12]
        write_atomically(run_dir / self.ID_FILE, run_id + "\n")
        self.run = wandb.init(
            dir=str(run_dir), config=config, id=run_id, resume="allow",
            name=config.get("name") or run_dir.name,
            project=os.environ.get("WANDB_PROJECT") or "trainrun",
            mode=os.environ.get("WANDB_MODE") or "offline",
            settings=wandb.Settings(console="off"))  # our console stays ours

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def finish(self) -> None:
        self.run.finish()

    def fail(self, error: BaseException) -> None:
        self.run.finish(exit_code=exit_code(error))


class MLflowTracker(Tracker):
    """An MLflow run in the file store ``<run_dir>/mlruns`` (or at ``MLFLOW_TRACKING_URI``),
    experiment ``MLFLOW_EXPERIMENT_NAME`` or the config's ``name``; the config, flattened to
    dotted keys, as its parameters (values cut to MLflow's limit). A resumed run continues the
    same MLflow run (its id is kept in ``<run_dir>/mlflow_run_id``); a parameter the resumed
    config changed keeps its first value (MLflow refuses changing one), with a warning.

    Named ``mlflow`` in ``logging.backends``; it needs the mlflow package
    (``pip install trainrun[mlflow]``). It takes no arguments: the environment variables
    above configure it. A run that fails ends as FAILED, one stopped (a signal, Ctrl-C) as
    KILLED.
    """

    ID_FILE = "mlflow_run_id"

    def start(self, run_dir: Path, config: dict[str, Any], resume: bool) -> None:
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # MLflow 3 keeps the file store only on request
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (run_dir / "mlruns").absolute().as_uri()
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or config.get("name") or "trainrun"
        found = self.client.get_experiment_by_name(name)
        experiment = found.experiment_id if found else self.client.create_experiment(name)
        run_id = _stored_id(run_dir / self.ID_FILE, resume)
        if run_id is None:
            run_id = self.client.create_run(experiment, run_name=name).info.run_id
            write_atomically(run_dir / self.ID_FILE, run_id + "\n")
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        self._log_params(params(config))

    def _log_params(self, values: dict[str, str]) -> None:
        from mlflow.entities import Param

        logged = self.client.get_run(self.run_id).data.params
        changed = sorted(k for k, v in values.items() if k in logged and logged[k] != v)
        if changed:
            get_logger().warning("mlflow: the resumed run keeps its first value of %s "
                                 "(MLflow refuses changing a parameter)", ", ".join(changed))
        new = [Param(k, v) for k, v in values.items() if k not in logged]
        for at in range(0, len(new), 100):  # MLflow takes 100 parameters a call
            self.client.log_batch(self.run_id, params=new[at:at + 100])

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(key, float(value), now, step)
                                                    for key, value in values.items()])

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)

    def fail(self, error: BaseException) -> None:
        self.client.set_terminated(self.run_id, status="KILLED" if stopped(error) else "FAILED")


def params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``config`` flattened to MLflow parameters: dotted keys (characters MLflow refuses
    replaced by ``_``), values as text (lists and null as JSON), each cut to MLflow's limit.

    Args:
        config: the resolved config, plain dicts and lists.
        prefix: put before every key (for the recursion into sections).

    Returns:
        The parameters, by dotted key.
    """
    try:
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH as limit
    except ImportError:
        limit = 500  # the oldest MLflow's
    out: dict[str, str] = {}
    for key, value in config.items():
        name = prefix + re.sub(r"[^\w\-. /:]", "_", str(key))
        if isinstance(value, Mapping) and value:
            out.update(params(value, name + "."))
            continue
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        out[name] = text[:limit]
    return out


# ---------------------------------------------------------------- by name

TRACKERS.register("tensorboard", TensorBoardTracker)
TRACKERS.register("wandb", WandbTracker)
TRACKERS.register("mlflow", MLflowTracker)
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # they need


def tracker_class(name: str) -> type:
    """The class of a shipped tracker by name, or of one by import path."""
    if name in TRACKERS:
        return TRACKERS[name]
    module, _, attribute = name.rpartition(".")
    return getattr(importlib.import_module(module), attribute)


def missing_package(name: str) -> str | None:
    """The package a shipped tracker needs when it is not installed, else None."""
    package = PACKAGES.get(name)
    return package if package and importlib.util.find_spec(package) is None else None


def check_import_path(key: str, value: str) -> str:
    """A tracker by import path: importable, a class with ``METHODS``, made without arguments."""
    expected = f"a tracker class ({', '.join(METHODS)}; see trainrun.runner.trackers)"
    try:
        found = tracker_class(value)
    except (ImportError, AttributeError, ValueError) as error:
        raise bad_value(key, value, f"{expected}, importable: {error}") from None
    except Exception as error:  # the module itself failed as it was imported
        raise bad_value(key, value, f"{expected}, importable: importing it raised "
                                    f"{type(error).__name__}: {error}") from None
    if not inspect.isclass(found):
        raise bad_value(key, value, f"{expected}; it is a {type(found).__name__}")
    missing = [m for m in METHODS if not callable(getattr(found, m, None))]
    if missing:
        raise bad_value(key, value, f"{expected}; it has no {', '.join(missing)}")
    try:
        inspect.signature(found).bind()
    except TypeError:
        raise bad_value(key, value, f"{expected}, made without arguments; its constructor "
                                    f"needs some") from None
    except ValueError:  # no signature to read (a class in C): let it be
        pass
    return value


def check_backend(key: str, value: Any, own: tuple[str, ...]) -> str:
    """One ``logging.backends`` entry: one of ``own`` (the logger's own outputs) or of the
    shipped trackers (installed), or a tracker class by import path."""
    known = (*own, *TRACKERS)
    if isinstance(value, str) and "." in value:
        return check_import_path(key, value)
    name = choice(*known)(key, value)
    package = missing_package(name)
    if package is not None:
        raise ConfigError(f"{key}: got {name!r}, but {package} is not installed; "
                          f"pip install trainrun[{name}]")
    return name


def make_trackers(backends: list[str]) -> list[Any]:
    """A tracker for every entry of ``backends`` that names one (checked by ``check_backend``)."""
    return [tracker_class(name)() for name in backends
            if name in TRACKERS or "." in name]
