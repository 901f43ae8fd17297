"""The run directory (``work_dir``): the one place that knows what a run keeps there.

A training run's record is ``config.yaml`` (the resolved config, written by rank 0),
``metrics.jsonl`` (one JSON object per line, appended by rank 0), ``train.log`` (rank 0's
console log) and ``checkpoints/`` (every checkpoint, and ``last`` naming the newest); one job
at a time holds the directory through its ``run.lock`` (``trainrun.runner.lock``). Every name
of these is defined here or beside its owner (the lock's in ``lock.py``, the checkpoints' in
``trainrun/checkpoint/manager.py``), and every other module asks a ``RunDir`` for the path.

Other commands never change that record: ``trainrun test`` writes a directory of its own,
``test/<checkpoint>/`` (a ``TestDir``: its own ``config.yaml``, ``test.log`` and the scores as
``scores.json``), and ``trainrun export`` refuses to write over any part of it
(``run_owning``).

A run resumed from the checkpoint of step N drops from ``metrics.jsonl`` the lines that the
steps after N logged (a run killed after that checkpoint had gone on), and marks the resume
with a line of its own, before it appends (``MetricsFile.resume``): the file holds each step
once.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TextIO

import yaml
from omegaconf import DictConfig, OmegaConf

from trainrun.checkpoint.files import replacing, write_atomically
from trainrun.checkpoint.manager import CHECKPOINTS_DIR
from trainrun.dist import barrier, broadcast_object_list, master_only
from trainrun.runner.config import LAUNCH_KEYS, RESUME_MAY_CHANGE, saved_config_changes
from trainrun.runner.lock import LOCK_NAME, RunDirectoryBusy, RunLock

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
TRAIN_LOG = "train.log"
TEST_LOG = "test.log"
SCORES = "scores.json"
TESTS = "test"  # trainrun test's directories inside a run directory, one per checkpoint
PROFILE = "profile"  # the profiler hook's traces
RESUME = "resume"  # the ``mode`` of the metrics.jsonl line that marks a resume


class RunDir:
    """A run directory: the paths of what a run keeps there, its lock, its config and its
    metrics. Nothing is created before ``acquire``.

    Args:
        path: the directory (it need not exist yet).
    """

    log_name = TRAIN_LOG  # the log the job that holds the directory writes

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r})"

    @property
    def config(self) -> Path:
        """The resolved config of the run, ``config.yaml``."""
        return self.path / CONFIG

    @property
    def metrics(self) -> Path:
        """The logged numbers, one JSON object per line, ``metrics.jsonl``."""
        return self.path / METRICS

    @property
    def log(self) -> Path:
        """The console log of rank 0, ``train.log`` (``test.log`` for a ``TestDir``)."""
        return self.path / self.log_name

    @property
    def checkpoints(self) -> Path:
        """The checkpoints, and ``last`` naming the newest, in ``checkpoints/``."""
        return self.path / CHECKPOINTS_DIR

    @property
    def lock_file(self) -> Path:
        """The lock file, ``run.lock``, naming the job that holds the directory."""
        return self.path / LOCK_NAME

    @property
    def profile(self) -> Path:
        """The profiler hook's traces, one directory per rank, in ``profile/``."""
        return self.path / PROFILE

    @property
    def tests(self) -> Path:
        """The directories of ``trainrun test``, one per checkpoint tested, in ``test/``."""
        return self.path / TESTS

    def record(self) -> list[Path]:
        """The training run's record, which only the training job writes: ``config.yaml``,
        ``metrics.jsonl``, ``train.log``, the lock and ``checkpoints/``.

        Returns:
            Their paths, there or not.
        """
        return [self.config, self.metrics, self.path / TRAIN_LOG, self.lock_file,
                self.checkpoints]

    def holds_record(self) -> bool:
        """Whether a training run has written here: ``metrics.jsonl``, ``train.log`` or
        ``checkpoints/`` is there (a test's directory has a ``config.yaml`` too).

        Returns:
            True for a training run's directory.
        """
        return any(path.exists() for path in (self.metrics, self.path / TRAIN_LOG,
                                              self.checkpoints))

    def owns(self, path: str | os.PathLike) -> bool:
        """Whether ``path`` is part of this run's record (``record``), or lies inside its
        ``checkpoints/``.

        Args:
            path: any path, there or not.

        Returns:
            True when writing ``path`` would change the run's record.
        """
        path = Path(path).resolve()
        checkpoints = self.checkpoints.resolve()
        return path in [part.resolve() for part in self.record()] or checkpoints in path.parents

    def test_dir(self, checkpoint: str | os.PathLike) -> TestDir:
        """Where ``trainrun test`` of ``checkpoint`` writes unless told otherwise:
        ``test/<the checkpoint's name without its suffix>`` inside this directory.

        Args:
            checkpoint: the checkpoint tested.

        Returns:
            The test's own directory (not created).
        """
        return TestDir(self.tests / Path(checkpoint).stem)

    def acquire(self) -> RunLock:
        """Create the directory and take its lock (see ``trainrun.runner.lock``).

        Returns:
            The lock, held; ``release`` lets go of it.

        Raises:
            RunDirectoryBusy: another live job holds the directory.
        """
        self.path.mkdir(parents=True, exist_ok=True)
        lock = RunLock(self.path)
        lock.acquire()
        return lock

    def prepare(self, rank: int, cfg: Mapping[str, Any] | None,
                resumed: bool) -> RunLock | None:
        """Rank 0 creates the directory, takes its lock and writes ``cfg`` to ``config.yaml``
        (``write_config``); every rank of the job must call this, and every rank raises when
        another live job holds the directory.

        Args:
            rank: this process's global rank.
            cfg: the whole config; None (a run built from objects): no ``config.yaml``.
            resumed: the run resumes the run that wrote this directory.

        Returns:
            Rank 0's lock, held (None on the other ranks).

        Raises:
            RunDirectoryBusy: another live job holds the directory.
        """
        lock, refused = None, [None]
        if rank == 0:
            try:
                lock = self.acquire()
            except RunDirectoryBusy as error:
                refused[0] = str(error)
        broadcast_object_list(refused)
        if refused[0] is not None:
            raise RunDirectoryBusy(refused[0])
        if rank == 0 and cfg is not None:
            self.write_config(cfg, resumed=resumed)
        barrier()
        return lock

    def config_changes(self, cfg: Mapping[str, Any],
                       may_change: Iterable[str] = RESUME_MAY_CHANGE) -> list[str]:
        """What differs between ``config.yaml`` and ``cfg``, beyond the keys ``may_change``
        (see ``trainrun.runner.config.config_changes``); nothing without a ``config.yaml``.

        Args:
            cfg: the config now.
            may_change: the keys whose changes are not counted.

        Returns:
            One line per key that differs; empty when none does or there is no config yet.

        Raises:
            ConfigError: ``config.yaml`` cannot be read.
        """
        if not self.config.is_file():
            return []
        return saved_config_changes(self.config, cfg, may_change)

    def write_config(self, cfg: Mapping[str, Any], resumed: bool = False) -> None:
        """Write ``cfg``, resolved, to ``config.yaml`` (atomically).

        A resumed run whose ``config.yaml`` says the same but for how its processes start
        leaves it as it is; one that differs (a longer schedule, or anything with --force)
        keeps the old one beside it as ``config.<time>.yaml``.

        Args:
            cfg: the whole config (a ``DictConfig`` or a plain mapping).
            resumed: the run resumes the run that wrote this directory.
        """
        path = self.config
        if resumed and path.exists():
            if not saved_config_changes(path, cfg, may_change=LAUNCH_KEYS):
                return
            stamp, n = time.strftime("%Y%m%d-%H%M%S"), 1
            kept = path.with_name(f"{path.stem}.{stamp}{path.suffix}")
            while kept.exists():
                n += 1
                kept = path.with_name(f"{path.stem}.{stamp}-{n}{path.suffix}")
            os.replace(path, kept)
        write_atomically(path, OmegaConf.to_yaml(cfg, resolve=True)
                         if isinstance(cfg, DictConfig)
                         else yaml.safe_dump(dict(cfg), sort_keys=False))

    def metrics_file(self) -> MetricsFile:
        """The writer of ``metrics.jsonl`` (rank 0's; nothing is written before a line).

        Returns:
            A ``MetricsFile`` for this directory.
        """
        return MetricsFile(self.metrics)

    def read_metrics(self, on_bad_line: Callable[[int], None] | None = None
                     ) -> list[dict[str, Any]]:
        """Every record of ``metrics.jsonl``, in order; the resume marks included
        (``is_resume_mark``).

        Args:
            on_bad_line: told the number (from 1) of each line that is not a JSON object,
                which is skipped: a run killed mid-write leaves its last line cut short.

        Returns:
            The records; none where there is no ``metrics.jsonl``.
        """
        if not self.metrics.is_file():
            return []
        records = []
        text = self.metrics.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            record = _record(line)
            if record is None:
                if on_bad_line is not None:
                    on_bad_line(number)
                continue
            records.append(record)
        return records


class TestDir(RunDir):
    """The directory of one ``trainrun test``: its own ``config.yaml`` (the config it ran),
    ``test.log`` and ``scores.json``; never a training run's record.

    Args:
        path: the directory (it need not exist yet).
    """

    __test__ = False  # not a test class for pytest, whatever its name says
    log_name = TEST_LOG

    @property
    def scores(self) -> Path:
        """What the test scored, for programs to read, ``scores.json``."""
        return self.path / SCORES

    def write_scores(self, checkpoint: str | os.PathLike, data: Any,
                     metrics: Mapping[str, Any]) -> Path:
        """Write ``scores.json`` (atomically): the checkpoint tested, the data section it was
        scored on, each metric's value and the time.

        Args:
            checkpoint: the checkpoint tested.
            data: the ``data.test`` section (a ``DictConfig`` or a plain mapping).
            metrics: the metrics by name, as ``Runner.test`` returned them.

        Returns:
            The path written.
        """
        if isinstance(data, DictConfig):
            data = OmegaConf.to_container(data, resolve=True)
        record = {"checkpoint": str(checkpoint), "data": data,
                  "metrics": {name: _plain(value) for name, value in metrics.items()},
                  "time": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
        write_atomically(self.scores, json.dumps(record, indent=2) + "\n")
        return self.scores


def run_owning(path: str | os.PathLike) -> RunDir | None:
    """The training run whose record ``path`` is part of (``RunDir.owns``), if any.

    Args:
        path: any path, there or not.

    Returns:
        The run directory, or None.
    """
    for directory in Path(path).resolve().parents:
        run = RunDir(directory)
        if run.holds_record() and run.owns(path):
            return run
    return None


def is_resume_mark(record: Mapping[str, Any]) -> bool:
    """Whether a metrics.jsonl record is the mark a resume leaves (``MetricsFile.resume``).

    Args:
        record: one line's object.

    Returns:
        True for ``{"step": N, "mode": "resume", "from": CHECKPOINT}``.
    """
    return record.get("mode") == RESUME


def _record(line: str) -> dict[str, Any] | None:
    """One line's object; None for a line that is not a JSON object."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def _plain(value: Any) -> Any:
    """A JSON-ready value: tensors and numpy scalars as Python numbers, full precision."""
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN or Infinity
    return value


def _step(record: Mapping[str, Any]) -> float | None:
    step = record.get("step")
    return step if isinstance(step, (int, float)) and not isinstance(step, bool) else None


class MetricsFile:
    """Appends one JSON object per line to ``metrics.jsonl``; writes on rank 0 only. A line
    that a killed run left cut short is ended first, so a resumed run's lines stay whole.
    The file stays open between lines (opening it costs about as much as the line itself)
    and each line is flushed as it is written, so a killed run loses none.

    Args:
        path: the file.
    """

    def __init__(self, path: Path):
        self.path = path
        self._file: TextIO | None = None

    @master_only
    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one line (rank 0; a no-op elsewhere).

        Args:
            record: the values by name; tensors are written as numbers, NaN and infinities
                as strings.
        """
        line = json.dumps({key: _plain(value) for key, value in record.items()}) + "\n"
        if self._file is None:
            if self.path.is_file() and self.path.stat().st_size:
                with open(self.path, "rb") as f:
                    f.seek(-1, 2)
                    if f.read(1) != b"\n":
                        line = "\n" + line
            self._file = open(self.path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
        try:
            self._file.write(line)
        except OSError as error:  # a full disk: say which file (the error names none)
            raise OSError(error.errno, error.strerror, str(self.path)) from error

    @master_only
    def resume(self, step: int, checkpoint: str | os.PathLike,
               mark: dict[str, Any] | None = None) -> int:
        """Before a run resumed from ``checkpoint`` (the state after ``step`` steps) appends:
        drop the lines logged after that step, and mark the resume.

        Everything up to and including ``step`` stays (training, validation and any other
        lines of that step; a line without a step belongs to the step of the line before
        it); what later steps logged goes, with any line that is not JSON (cut short by a
        kill). The mark, ``{"step": step, "mode": "resume", "from": checkpoint}``, ends the
        file (a rollback's ``mark`` instead: `trainrun.runner.hooks.guard`). The new file is
        written aside and renamed over the old one: a crash leaves one or the other. Rank 0
        only (a no-op elsewhere).

        Args:
            step: the steps the checkpoint had trained.
            checkpoint: the checkpoint resumed from.
            mark: the record that ends the file; None: the resume's.

        Returns:
            How many lines were dropped.
        """
        self.close()
        kept: list[str] = []
        dropped, current = 0, 0.0
        if self.path.is_file():
            for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
                if not line.strip():
                    continue
                record = _record(line)
                if record is not None and _step(record) is not None:
                    current = _step(record)
                if record is None or current > step:
                    dropped += 1
                    continue
                kept.append(line + "\n")
        mark = mark or {"step": step, "mode": RESUME, "from": str(checkpoint)}
        kept.append(json.dumps({key: _plain(value) for key, value in mark.items()}) + "\n")
        with replacing(self.path) as tmp:
            tmp.write_text("".join(kept), encoding="utf-8")
        return dropped

    def close(self) -> None:
        """Close the file (the next line opens it again)."""
        if self._file is not None:
            file, self._file = self._file, None
            try:
                file.close()
            except OSError:  # what a failed write left in the buffer (each line is flushed
                pass  # as it is written): that write raised already
