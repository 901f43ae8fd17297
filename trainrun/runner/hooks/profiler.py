"""Traces training steps with ``torch.profiler`` on chosen ranks.

From the first step this run trains, the profiler skips ``wait`` steps, warms up for
``warmup`` and records ``active`` ones, ``repeat`` times (0: until training ends). Each
recorded window is written as a Chrome trace, ``<work_dir>/profile/rank<r>/rank<r>.<ns>.pt.
trace.json``, which TensorBoard's profiler plugin (``tensorboard --logdir
<work_dir>/profile``, with torch-tb-profiler) and Perfetto (ui.perfetto.dev) open; at the end
of training rank 0 logs one line naming every trace written. The profiler only observes: the
losses are those of a run without it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from trainrun.dist import gather_object, is_main_process
from trainrun.messages import is_int
from trainrun.runner.hooks.base import PROFILER, Hook
from trainrun.runner.logging import get_logger
from trainrun.runner.schema import check_bool, expects, fields, integer, rule


def _ranks(key: str, value: Any) -> list[int]:
    if not (isinstance(value, list) and value and all(is_int(v) and v >= 0 for v in value)):
        return rule("a non-empty list of ranks (ints >= 0)", lambda v: False)(key, value)
    return sorted(set(value))


class ProfilerHook(Hook):
    """Traces training steps with ``torch.profiler`` on chosen ranks.

    Named ``Profiler`` in a config's ``hooks``. From the first step this run trains, the
    profiler skips ``wait`` steps, warms up for ``warmup`` and records ``active`` ones,
    ``repeat`` times. Each recorded window is written as a Chrome trace under
    ``<work_dir>/profile/rank<r>/``, which TensorBoard's profiler plugin and Perfetto open;
    at the end of training rank 0 logs one line naming every trace written. It runs after
    every other hook, so that a traced step holds its hooks. The profiler only observes: the
    losses are those of a run without it.

    Args:
        wait: steps skipped before each window (at least 0).
        warmup: steps the profiler warms up on, not recorded, before each window (at
            least 0).
        active: steps recorded in each window (at least 1).
        repeat: how many windows to record (0: until training ends).
        ranks: the ranks that trace (a non-empty list of ranks below the world size).
        record_shapes: record the input shapes of each operator.
        profile_memory: record the memory the tensors take.
        with_stack: record the source file and line that called each operator (larger
            traces).

    Raises:
        ConfigError: an option out of its range (the config's checks, for Python callers).
    """

    priority = PROFILER  # after every other hook: a traced step holds its hooks
    OPTIONS = {
        "wait": (1, integer(0)),
        "warmup": (1, integer(0)),
        "active": (3, integer(1)),
        "repeat": (1, integer(0)),
        "ranks": ([0], expects("a non-empty list of ranks (ints >= 0)", _ranks)),
        "record_shapes": (False, check_bool),
        "profile_memory": (False, check_bool),
        "with_stack": (False, check_bool),
    }

    def __init__(self, wait: int = 1, warmup: int = 1, active: int = 3, repeat: int = 1,
                 ranks: list[int] | tuple[int, ...] = (0,), record_shapes: bool = False,
                 profile_memory: bool = False, with_stack: bool = False):
        checked = fields("", {"wait": wait, "warmup": warmup, "active": active,
                              "repeat": repeat, "ranks": list(ranks),
                              "record_shapes": record_shapes, "profile_memory": profile_memory,
                              "with_stack": with_stack}, self.OPTIONS)
        self.options = checked
        self.ranks = checked["ranks"]
        self._profiler: profile | None = None
        self._directory: Path | None = None
        self._start = 0  # the step training started from (the profiler counts from there)
        self._stopping = False
        self.written: list[tuple[str, int, int]] = []  # (path, first step, last step)

    def check(self, runner: Any) -> None:
        """Refuse ranks the job does not have.

        Args:
            runner: the built ``Runner``.

        Raises:
            ValueError: a rank in ``ranks`` is not below the world size.
        """
        beyond = [r for r in self.ranks if r >= runner.world_size]
        if beyond:
            raise ValueError(f"ranks: got {self.ranks}, expected ranks below the world size "
                             f"({runner.world_size}): no rank {', '.join(map(str, beyond))}")

    def before_train(self, runner: Any) -> None:
        if runner.rank not in self.ranks:
            return
        o = self.options
        self._directory = runner.run_dir.profile / f"rank{runner.rank}"
        self._directory.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._start = runner.iter
        self._profiler = profile(
            activities=activities,
            schedule=schedule(wait=o["wait"], warmup=o["warmup"], active=o["active"],
                              repeat=o["repeat"]),
            on_trace_ready=self._write, record_shapes=o["record_shapes"],
            profile_memory=o["profile_memory"], with_stack=o["with_stack"])
        self._profiler.start()

    def _write(self, prof: profile) -> None:
        """Export the window just recorded, named as torch's TensorBoard handler names it."""
        rank = self._directory.name
        path = self._directory / f"{rank}.{time.time_ns()}.pt.trace.json"
        prof.export_chrome_trace(str(path))
        self.written.append((str(path), *self._window(prof.step_num)))

    def _window(self, done: int) -> tuple[int, int]:
        """The first and last training step of the window written after ``done`` profiler
        steps: a whole one from ``step``, one cut short by the end from ``_stop``."""
        o = self.options
        cycle = o["wait"] + o["warmup"] + o["active"]
        index = done if self._stopping else done - 1  # of a step in the window
        first = (index // cycle) * cycle + o["wait"] + o["warmup"]
        return self._start + first + 1, self._start + done

    def after_train_iter(self, runner: Any, batch_idx: int, batch: Any,
                         outputs: dict[str, Any]) -> None:
        if self._profiler is not None:
            self._profiler.step()

    def after_train(self, runner: Any) -> None:
        """Stop recording (a window cut short by the end is written too), then rank 0 names
        every rank's traces in one line."""
        self._stop()
        written = gather_object(self.written, dst=0)
        if not is_main_process():
            return
        traces = [entry for part in written for entry in part]
        root = runner.run_dir.profile
        if not traces:
            get_logger().info("profiler: no trace written: training ended before a traced "
                              "step (wait %d, warmup %d)", self.options["wait"],
                              self.options["warmup"])
            return
        listed = ", ".join(f"{os.path.relpath(path, root)} (steps {a}-{b})" if a <= b else
                           f"{os.path.relpath(path, root)} (the end of training)"
                           for path, a, b in traces)
        get_logger().info("profiler: %d trace(s) in %s: %s; open with tensorboard --logdir %s "
                          "(torch-tb-profiler) or ui.perfetto.dev", len(traces), root, listed,
                          root)

    def _stop(self) -> None:
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            self._stopping = True
            profiler.stop()

    def on_error(self, runner: Any, error: BaseException) -> None:
        self._stop()
