"""Training and validation numbers to the console, metrics.jsonl and the trackers.

Every ``interval`` iterations each rank sends its logged values, with its counts for the step
metrics, to rank 0 in one small collective that rank 0 finishes a step later (the next step
trains meanwhile), and rank 0 writes the values' means over the ranks with the step metrics
(`STEP_METRICS`: gradient norm, throughput, where the time went, peak memory) unless
``logging.step_metrics`` is false. With more than one rank the step metrics also hold each
phase's largest time over the ranks and its rank, and rank 0 warns when one rank holds the
others up (`trainrun.runner.hooks.stragglers`). A step's line is on disk before its
checkpoint, and a resumed run takes out the lines of the steps after its checkpoint before it
writes its own (`trainrun.runner.run_dir.MetricsFile.resume`): each step has one line.
On a terminal rank 0 also shows a progress bar with loss, throughput and ETA; headless
(cluster logs) it prints plain lines instead. ``logging.backends`` names the outputs: the
console, metrics.jsonl and trackers (`trainrun.runner.trackers`: tensorboard, wandb, mlflow,
or one of yours by import path), which only rank 0 makes.
With ``logging.window`` N above 1 each rank logs, for each value, its mean over its last N
training steps (the ranks' means are then averaged as ever); the window's content goes into
every checkpoint, so that a resumed run logs what an unbroken one does.
"""

from __future__ import annotations

import datetime
import resource
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any

import torch

from trainrun.dist import (
    Handle,
    PeerFailure,
    before_process_end,
    gather_object,
    gather_rows,
    get_dist_info,
    is_main_process,
)
from trainrun.dist.heartbeat import store_round_trip
from trainrun.dist.waits import waiting
from trainrun.registry import TRACKERS
from trainrun.runner.hooks.base import LOGGER, Hook, every
from trainrun.runner.hooks.stragglers import FLOOR, StragglerWatch
from trainrun.runner.hooks.timer import PHASES, Window
from trainrun.runner.logging import get_logger
from trainrun.runner.optim.wrapper import grad_norms, measure_grad_norm
from trainrun.runner.preemption import Preempted
from trainrun.runner.schema import check_bool, expects, fields, integer, names, number
from trainrun.runner.trackers import check_backend, close_tracker, make_trackers

INTERVAL = 10  # iterations between logged lines
WINDOW = 1  # steps each logged training value is the mean of (1: the logged step's own)
BACKENDS = ("console", "jsonl")  # where they go by default; the logger's own outputs
# What every logged training line adds to the model's values and lr (docs/hooks-and-trackers.md,
# "Step metrics"): grad_norm (grad_norm/<name> per optimiser of a dict), and:
# seconds an iteration: all, waiting for data, the rest, waiting in collectives
TIMES = ("time", "data_time", "compute_time", "comm_time")
# with several ranks: each phase's largest time over the ranks, and that rank
PHASE_MAXIMA = tuple(f"{phase}_time_max{rank}" for phase in PHASES for rank in ("", "_rank"))
STEP_METRICS = (*TIMES, "samples_per_s", "tokens_per_s", "peak_memory_mb", *PHASE_MAXIMA)
# values that differ from one run to the next, as wall-clock times and memory do
NOT_REPRODUCIBLE = STEP_METRICS


def _number(value: Any) -> float:
    return value.item() if hasattr(value, "item") else float(value)


def peak_memory_mb(device: torch.device) -> float:
    """This process's peak memory in MiB: CUDA's most allocated on a GPU, the peak resident
    set size (RSS) of the process otherwise."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB; bytes on macOS
    return peak / (2**20 if sys.platform == "darwin" else 2**10)


class LoggerHook(Hook):
    """The run's logged lines (see the module's docstring).

    Args:
        interval: log a training line every this many iterations, and at the last.
        backends: where lines go (``logging.backends``); None: the console and metrics.jsonl.
        progress_bar: draw a progress bar on rank 0's console; None: where stderr is a
            terminal.
        step_metrics: add the step metrics (`STEP_METRICS`, the gradient norm) to every
            training line.
        window: each logged training value is the mean of this rank's values over the last
            this many training steps (then the mean over the ranks); 1: the step's own.
        straggler_floor: the seconds an iteration a rank must hold the others up by, at
            least, to be named a straggler (`trainrun.runner.hooks.stragglers`).
    """

    priority = LOGGER  # see hooks/base.py for the order

    def __init__(self, interval: int = INTERVAL, backends: list[str] | None = None,
                 progress_bar: bool | None = None, step_metrics: bool = True,
                 window: int = WINDOW, straggler_floor: float = FLOOR):
        self.interval = interval
        self.straggler_floor = straggler_floor
        self.step_metrics = step_metrics
        self.window = window
        # this rank's values of the last `window` steps (window > 1 only): detached, unsynced
        self._recent: deque[dict[str, Any]] = deque(maxlen=window)
        self._measuring: bool | None = None  # what the optimiser wrapper was last asked
        self.backends = list(backends or BACKENDS)
        show_bar = sys.stderr.isatty() if progress_bar is None else progress_bar
        self.progress_bar = show_bar and "console" in self.backends and is_main_process()
        self._bar = None
        self.trackers = make_trackers(self.backends) if is_main_process() else []
        self._open: list[Any] = []  # the trackers started and not closed yet (rank 0)
        self._closing = threading.Lock()  # the heartbeat's thread may close them too
        self._forget_last_words = None  # takes `_close_on_stop` off the heartbeat's list
        self._started: tuple[float, int] | None = None  # (clock, step) when training began
        self._last_val: dict[str, float] = {}
        self._pending: LoggedStep | None = None  # a logged step whose numbers are on the way
        self._compare_ranks = False  # each rank sends its phase times too (step metrics, ranks)
        self._stragglers: StragglerWatch | None = None  # rank 0's, while comparing ranks

    def before_train(self, runner: Any) -> None:
        """The trackers start and the progress bar appears."""
        self._started = (time.monotonic(), runner.iter)
        self._measuring = None
        self._compare_ranks = self.step_metrics and get_dist_info()[1] > 1
        self._stragglers = None
        if self._compare_ranks:  # every rank's host, once, for the straggler warnings
            hosts = gather_object(socket.gethostname())
            self._stragglers = None if hosts is None else StragglerWatch(hosts,
                                                                         self.straggler_floor)
            runner.timer.take_phases()  # the intervals start here
        if self.trackers:
            config, resume = tracker_config(runner), resuming(runner)
            # a rank stuck in a collective when another fails is ended by the heartbeat
            self._forget_last_words = before_process_end(self._close_on_stop)
            for tracker in self.trackers:  # one that fails to start: the others close
                tracker.start(runner.work_dir, config, resume)
                self._open.append(tracker)
        if self.progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=runner.max_iters, initial=runner.iter, unit="it",
                             dynamic_ncols=True, file=sys.stderr)

    def logs(self, step: int, max_iters: int) -> bool:
        """Whether training step ``step`` (counting from 1) gets a logged line."""
        return every(step, self.interval) or step == max_iters

    def before_train_iter(self, runner: Any, batch_idx: int, batch: Any) -> None:
        """Before a step that is logged, with the step metrics, ask the optimiser wrapper for
        the gradient norm: without clipping it costs a pass over the gradients. The wrapper is
        told only when the answer changes."""
        if not self.step_metrics:
            return
        logs = self.logs(runner.iter + 1, runner.max_iters)
        if logs is not self._measuring:
            measure_grad_norm(runner.optim_wrapper, logs)
            self._measuring = logs

    def after_train_iter(self, runner: Any, batch_idx: int, batch: Any,
                         outputs: dict[str, Any]) -> None:
        """At a logged step every rank sends its numbers to rank 0 without waiting for them
        to arrive; rank 0 writes the line a step later (or before a checkpoint or a
        validation's line, at the end of training or at a preemption), by when they are in:
        the collective's latency overlaps the next step instead of adding to this one."""
        if self._bar is not None:
            self._bar.update(1)
        self._write_pending(runner)
        if self.window > 1:  # a dict of references a step: no copy, no wait for the device
            self._recent.append({key: value.detach() if isinstance(value, torch.Tensor)
                                 else value for key, value in outputs.items()})
        if not self.logs(runner.iter, runner.max_iters):
            return
        # every rank takes part; outputs are left as they are, for the hooks after this one
        # the timer's window, read once: this rank's counts and rank 0's own metrics share it
        window = runner.timer.window_counts() if self.step_metrics else None
        phases = (*runner.timer.phase_times(), *runner.timer.take_phases(),
                  store_round_trip()) if self._compare_ranks else ()
        counts = rank_counts(window, runner.device, phases) if window is not None else None
        values = outputs if self.window == 1 else window_means(self._recent, outputs)
        self._pending = LoggedStep(runner, start_gather(values, counts), window)

    def state_dict(self) -> dict[str, Any]:
        """With a window above 1, every rank's values of its last steps (gathered on rank 0:
        every rank calls this), so that the first lines of a resumed run hold the steps
        before its checkpoint too; nothing with a window of 1."""
        if self.window == 1:
            return {}
        # tensors on the CPU, other numbers (a NumPy scalar too) as Python's: a checkpoint is
        # read with weights_only
        mine = [{key: value.cpu() if isinstance(value, torch.Tensor) else _number(value)
                 for key, value in step.items()} for step in self._recent]
        return {"recent": gather_object(mine)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """This rank's values of the last steps before the checkpoint (the last ``window`` of
        them). Saved by another number of ranks, or with a window of 1, the window starts
        empty (said in a warning where the ranks differ).

        Args:
            state: what ``state_dict`` returned on rank 0.
        """
        saved = state.get("recent") if self.window > 1 else None
        if not saved:
            return
        rank, world_size = get_dist_info()
        if len(saved) != world_size:
            if is_main_process():
                get_logger().warning(
                    "logging.window: the checkpoint holds the last steps' values of %d ranks, "
                    "this job has %d: the logged means start from the resumed step",
                    len(saved), world_size)
            return
        self._recent.clear()
        self._recent.extend(saved[rank])  # the deque keeps the last `window`

    def _write_pending(self, runner: Any, wait: bool = True) -> None:
        """Finish the logged step whose numbers were sent, if any: rank 0 writes its line;
        ``wait=False``: only if every rank's numbers are in already (else it is dropped)."""
        pending, self._pending = self._pending, None
        if pending is None or not (wait or pending.gathering.is_completed()):
            return
        with waiting():  # for the other ranks' numbers, if they are not in yet
            record = pending.record()
        if record is None:  # not rank 0
            return
        if "jsonl" in self.backends:
            runner.metrics_file.write(record)
        if self._open:
            self._track({f"train/{k}": v for k, v in record.items()
                         if k not in ("step", "epoch")}, record["step"])
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}")
        self._log(pending.line(record))
        if self._stragglers is not None and pending.counts is not None:
            intervals = [rank[COUNTS + len(PHASES):] for rank in pending.counts]
            for level, message in self._stragglers.update(intervals):
                getattr(get_logger(), level)(message)

    def _track(self, values: dict[str, float], step: int) -> None:
        """To every tracker, while training (a validation run alone tracks nothing)."""
        for tracker in self._open:
            tracker.log(values, step)

    def _log(self, message: str) -> None:
        """To train.log always; to the console when it is a backend and no progress bar is
        drawn there (validation lines are written above the bar)."""
        if self._bar is not None and message.startswith("validation"):
            self._bar.write(message)
        quiet = self._bar is not None or "console" not in self.backends
        get_logger().info(message, extra={"file_only": quiet})

    def log_event(self, runner: Any, record: dict[str, Any], message: str | None) -> None:
        """A line of the run's own that is no step's values (the guard's events), on rank 0:
        after the logged step's line, ``record`` to metrics.jsonl, a point ``guard/<event>``
        on the trackers at the current step, and ``message`` (if any) as a warning.

        Args:
            runner: the runner training.
            record: the ``metrics.jsonl`` line (``step``, ``mode``, ``event`` and the rest).
            message: the warning for the console and train.log, or None.
        """
        self._write_pending(runner)
        if "jsonl" in self.backends:
            runner.metrics_file.write(record)
        if self._open:
            self._track({f"guard/{record['event']}": 1.0}, runner.iter)
        if message:
            if self._bar is not None:
                self._bar.write(message)
            get_logger().warning(message, extra={"file_only": self._bar is not None})

    def before_checkpoint_save(self, runner: Any) -> None:
        """The step's line is on disk before its checkpoint: a run killed after it resumes
        from the next step and would never write it."""
        self._write_pending(runner)

    def after_val(self, runner: Any, metrics: dict[str, float]) -> None:
        self._write_pending(runner)  # the step's line before its validation's
        self._last_val = dict(metrics)
        if not is_main_process():
            return
        record = {"step": runner.iter, "mode": "val", **metrics}
        if "jsonl" in self.backends:
            runner.metrics_file.write(record)
        # several sets' keys are val/<set>/<metric> already
        several = isinstance(getattr(runner, "val_dataloader", None), dict)
        self._track(dict(metrics) if several else {f"val/{k}": v for k, v in metrics.items()},
                    runner.iter)
        text = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        self._log(f"validation at step {runner.iter}: {text}")

    def after_test(self, runner: Any, metrics: dict[str, float]) -> None:
        if is_main_process():
            text = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())
            get_logger().info(f"test: {text}")

    def after_run(self, runner: Any) -> None:
        """One closing line: how far, how long, the last validation, where the run lives."""
        if not is_main_process() or self._started is None:
            return
        seconds, first_step = time.monotonic() - self._started[0], self._started[1]
        done = f"training done: step {runner.iter}/{runner.max_iters}"
        if runner.iter > first_step:
            done += (f" ({runner.iter - first_step} steps in "
                     f"{datetime.timedelta(seconds=round(seconds))})")
        if self._last_val:
            done += "; last validation " + "  ".join(f"{k} {v:.4f}"
                                                     for k, v in self._last_val.items())
        get_logger().info(f"{done}; run directory {runner.work_dir}")

    def after_train(self, runner: Any) -> None:
        self._write_pending(runner)
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def on_error(self, runner: Any, error: BaseException) -> None:
        """Write the last logged step (after a preemption every rank sent its numbers; after
        a failure only if they are all in: a rank may be gone) and close the trackers' runs
        as ended by ``error`` (what they buffered is written)."""
        try:
            self._write_pending(runner, wait=isinstance(error, Preempted))
        except Exception:  # a rank that failed meanwhile, a line that cannot be written
            get_logger().exception("the last logged step could not be written")
        self.close_trackers(error)

    def close_trackers(self, error: BaseException | None = None) -> None:
        """Close the trackers' runs, once: finished (``error`` None: the runner calls this
        when ``train()`` is done, after every hook's ``after_run``), or as ended by ``error``
        (their ``fail``; ``finish`` for a tracker without one).

        After an error, a tracker that cannot close its run is logged: the run's own error is
        what the user needs. At the end of a finished run the first such failure is raised,
        once every tracker was closed (the run fails, as it would at any other hook).

        Args:
            error: what ended the run, or None for a run that finished.
        """
        with self._closing:
            trackers, self._open = self._open, []
            forget, self._forget_last_words = self._forget_last_words, None
        if forget is not None:
            forget()
        failed: Exception | None = None
        for tracker in trackers:
            try:
                close_tracker(tracker, error)
            except Exception as close_error:
                if error is not None or failed is not None:  # else raised below
                    get_logger().exception("%s could not close its run",
                                           type(tracker).__name__)
                failed = failed or close_error
        if error is None and failed is not None:
            raise failed

    def _close_on_stop(self, message: str) -> None:
        """The trackers' runs, failed: the heartbeat ends this process (`message`: which
        rank failed or went silent) while its main thread is stuck in a collective."""
        self.close_trackers(PeerFailure(message))


def window_means(recent: Sequence[dict[str, Any]], keys: Iterable[str]) -> dict[str, Any]:
    """Each of ``keys`` (the logged step's values) with its mean over the steps of ``recent``
    that returned it, the logged step among them (the last). Tensors are averaged on the
    newest one's device: their sum in their dtype (torch's promotion where steps' dtypes
    differ) and a true division (an integer one gives a float); plain numbers in Python."""
    means = {}
    for key in keys:
        values = [step[key] for step in recent if key in step]
        means[key] = values[0] if len(values) == 1 else _mean(values)
    return means


def _mean(values: list[Any]) -> Any:
    tensors = [value for value in values if isinstance(value, torch.Tensor)]
    if not tensors:
        return sum(values) / len(values)
    device = tensors[-1].device
    if len(tensors) < len(values) or any(tensor.device != device for tensor in tensors):
        # plain numbers among them, or values a resumed run loaded onto the CPU
        values = [torch.as_tensor(value, device=device) for value in values]
    return torch.true_divide(torch.stack(values).sum(0), len(values))


COUNTS = 3  # a rank's counts begin with its samples, tokens and peak memory


def rank_counts(window: Window, device: torch.device, phases: Sequence[float] = ()
                ) -> list[float]:
    """This rank's part of the step metrics that need the other ranks: its samples and tokens
    over the timer's ``window`` (`IterTimerHook.window_counts`; tokens 0 where its batches
    state none), its peak memory, then ``phases`` as they are: with several ranks, the
    timer's `IterTimerHook.phase_times` and `IterTimerHook.take_phases`, and the heartbeat's
    `trainrun.dist.heartbeat.store_round_trip`."""
    _, samples, tokens = window
    return [float(samples), float(tokens or 0), peak_memory_mb(device), *phases]


class Gathering:
    """Each rank's logged values and counts on their way to rank 0 (`start_gather`)."""

    def __init__(self, handle: Handle, keys: list[str], dtypes: list[torch.dtype],
                 order: list[str], with_counts: bool):
        self.handle = handle
        self.keys, self.dtypes, self.order = keys, dtypes, order
        self.with_counts = with_counts

    def is_completed(self) -> bool:
        return self.handle.is_completed()

    def result(self) -> tuple[dict[str, float], list[list[float]] | None] | None:
        """On rank 0: each value's mean over the ranks (in this rank's order of the keys)
        and every rank's counts (None without counts); None on the other ranks."""
        rows = self.handle.result()
        if rows is None:
            return None
        keys, dtypes = self.keys, self.dtypes
        world_size, block = rows.shape[0], rows[:, :len(keys)]
        means: dict[str, float] = {}
        for dtype in dict.fromkeys(dtypes):  # usually one: a few tensor operations in all
            columns = [i for i, d in enumerate(dtypes) if d == dtype]
            picked = block if len(columns) == len(keys) else block[:, columns]
            if dtype.is_floating_point:
                # summed in float64, where the sum of these values is exact in any order,
                # then divided and rounded once to their dtype: the same bits however many
                # values a row holds (torch adds a column of four in another order than four
                # rows of several) and whichever path writes the line
                mean = torch.true_divide(picked.sum(0), world_size).to(dtype)
            else:
                mean = torch.true_divide(picked.to(dtype).sum(0), world_size)
            means.update(zip((keys[i] for i in columns), mean.tolist(), strict=True))
        return ({key: means[key] for key in self.order},
                rows[:, len(keys):].tolist() if self.with_counts else None)


def start_gather(values: dict[str, Any], counts: list[float] | None) -> Gathering:
    """Send this rank's logged ``values`` and its ``counts`` (a list of numbers, or None) to
    rank 0, without waiting; see `gather_logged`."""
    keys = sorted(values)  # the ranks' dicts may hold their keys in different orders
    dtypes = [values[k].dtype if isinstance(values[k], torch.Tensor) else torch.float64
              for k in keys]
    row = torch.tensor([*(_number(values[k]) for k in keys), *(counts or ())],
                       dtype=torch.float64)
    return Gathering(gather_rows(row, async_op=True), keys, dtypes, list(values),  # type: ignore[arg-type]
                     counts is not None)


def gather_logged(values: dict[str, Any], counts: list[float] | None
                  ) -> tuple[dict[str, float], list[list[float]] | None] | None:
    """On rank 0: each logged value's mean over the ranks, and every rank's ``counts`` (a list
    each, None without counts); None on the other ranks.

    One gather of one float64 row a rank (`gather_rows`). On gloo it costs what an all_reduce
    of a single number does (one exchange between two ranks), where an all_reduce of more than
    one number takes two, and a second collective for the counts another. float64 holds every
    float32, float16 and bfloat16 value and every count exactly; a floating-point value's
    mean is the sum over the ranks in float64 (exact for such values, whatever the order of
    addition), divided by their number and rounded once to the value's own dtype, so that a
    float32 loss's mean has the bits an all_reduce of it gives on two ranks, and the same bits
    on any path and row width on more.
    """
    return start_gather(values, counts).result()


class LoggedStep:
    """A logged training step: what rank 0 knows of it at once (step, epoch, lr, times, its
    own step metrics, the ETA), waiting for the other ranks' numbers (`Gathering`).
    ``window``: the timer's window at the step with the step metrics on, else None."""

    def __init__(self, runner: Any, gathering: Gathering, window: Window | None):
        self.gathering = gathering
        self.known: dict[str, Any] | None = None
        self.counts: list[list[float]] | None = None  # every rank's, once `record` has them
        if not is_main_process():
            return
        timer = runner.timer
        self.known = {"step": runner.iter, "epoch": runner.epoch + 1,
                      "lr": runner.optim_wrapper.get_lr(),
                      "time": timer.iter_time, "data_time": timer.data_time}
        comm = timer.comm_time
        self.metrics = None if window is None else own_step_metrics(
            runner, window, self.known["time"] - self.known["data_time"] - comm, comm)
        self.eta = round(timer.eta_seconds(runner.max_iters - runner.iter))
        self.max_iters = runner.max_iters
        self.max_epochs = runner.max_epochs if runner.by_epoch else None

    def record(self) -> dict[str, Any] | None:
        """The line's numbers, on rank 0 (None elsewhere, once the gather is done)."""
        gathered = self.gathering.result()
        if gathered is None or self.known is None:
            return None
        values, counts = gathered
        self.counts = counts
        known = self.known
        record = {"step": known["step"], "epoch": known["epoch"], **values, "lr": known["lr"],
                  "time": known["time"], "data_time": known["data_time"]}
        if self.metrics is not None and counts is not None:
            record.update(step_metrics(self.metrics, counts))
        return record

    def line(self, record: dict[str, Any]) -> str:
        """The console's and train.log's line for ``record``."""
        values = "  ".join(f"{k} {v:.6g}" for k, v in record.items()
                           if k not in ("step", "epoch", "lr", *STEP_METRICS)
                           and not k.startswith("grad_norm"))
        epochs = f"epoch {record['epoch']}/{self.max_epochs}  " \
            if self.max_epochs is not None else ""
        return (f"{epochs}step {record['step']}/{self.max_iters}  {values}  "
                f"lr {record['lr']:.3e}  {record['time']:.3f} s/it  "
                f"eta {datetime.timedelta(seconds=self.eta)}")


def own_step_metrics(runner: Any, window: Window, compute_time: float,
                     comm_time: float = 0.0) -> dict[str, Any]:
    """Rank 0's part of a logged step's step metrics, taken at the step: its gradient norms
    (where its optimiser stepped), compute time (the timer's iteration time less its data
    time and its wait in collectives), that wait, and the timer's ``window`` (seconds,
    whether every batch stated its tokens)."""
    seconds, _, tokens = window
    return {"norms": grad_norms(runner.optim_wrapper),
            "compute_time": max(compute_time, 0.0), "comm_time": comm_time,
            "seconds": seconds, "tokens": tokens is not None}


def step_metrics(own: dict[str, Any], counts: list[list[float]]) -> dict[str, float]:
    """The step metrics of a logged line, on rank 0: the gradient norm of the step, compute
    time (and with several ranks the wait in collectives), samples (and tokens)
    a second of all ranks over the timer's window, the largest peak memory of any rank, and
    with several ranks each phase's largest mean time over the ranks and that rank (the
    first of equal ones); ``own`` is `own_step_metrics`, ``counts`` every rank's
    `rank_counts`."""
    out = {key: _number(norm) for key, norm in own["norms"].items()}
    seconds = own["seconds"]
    out["compute_time"] = own["compute_time"]
    several = len(counts) > 1 and len(counts[0]) > COUNTS
    if several:
        out["comm_time"] = own["comm_time"]
    samples = round(sum(rank[0] for rank in counts))
    out["samples_per_s"] = samples / seconds if seconds else 0.0
    if own["tokens"]:
        all_tokens = round(sum(rank[1] for rank in counts))
        out["tokens_per_s"] = all_tokens / seconds if seconds else 0.0
    out["peak_memory_mb"] = max(rank[2] for rank in counts)
    if several:
        for index, phase in enumerate(PHASES, start=COUNTS):
            times = [rank[index] for rank in counts]
            slowest = max(range(len(times)), key=times.__getitem__)
            out[f"{phase}_time_max"] = times[slowest]
            out[f"{phase}_time_max_rank"] = slowest
    return out


def tracker_config(runner: Any) -> dict[str, Any]:
    """The run's resolved config as plain containers, as trackers log it (empty for a runner
    built from objects)."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(runner.cfg, DictConfig):
        return OmegaConf.to_container(runner.cfg, resolve=True)  # type: ignore[return-value]
    return dict(runner.cfg) if runner.cfg is not None else {}


def resuming(runner: Any) -> bool:
    start = getattr(runner, "start_from", None)
    return start is not None and start[0] == "resume"


check_logging_backend = expects(f"one of {', '.join((*BACKENDS, *TRACKERS))} or a tracker "
                                f"class by import path", partial(check_backend, own=BACKENDS))


LOGGING = {
    "interval": (INTERVAL, integer(1),
                 "log a training line every this many iterations, and at the last"),
    "backends": (list(BACKENDS), names(check_logging_backend),
                 "where lines go: console (and train.log), jsonl (metrics.jsonl), tensorboard, "
                 "wandb, mlflow, or a tracker class by import path"),
    "step_metrics": (True, check_bool,
                     "log grad_norm, compute_time, samples_per_s, tokens_per_s and "
                     "peak_memory_mb on every training line (with several ranks also "
                     "comm_time, each phase's largest time over the ranks and its rank, and "
                     "warn of a rank that holds the others up)"),
    "window": (WINDOW, integer(1),
               "each logged training value is the mean of each rank's values over the last "
               "this many iterations (then over the ranks); 1: the logged iteration's own. "
               "Not the step metrics, nor validation"),
    "straggler_floor": (FLOOR, number(at_least=0),
                        "with several ranks, a rank is named a straggler only where it holds "
                        "the others up by at least this many seconds an iteration (and by 1.5 "
                        "times their median and a tenth of the iteration): a healthy small "
                        "run's differences of a few milliseconds name no one"),
}


def check_logging(key: str, value: Any, warnings: list[str]) -> dict[str, Any]:
    """The ``logging`` section: each backend is one of the logger's own outputs, a shipped
    tracker (installed: tensorboard, wandb and mlflow are refused where their package is
    missing) or a tracker class by import path; ``step_metrics`` false logs the values,
    lr, time and data_time alone (none of the step metrics' work is done). ``warnings``
    is the config's list of warnings (this section adds none)."""
    return fields(key, value, LOGGING)
