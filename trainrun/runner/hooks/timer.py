"""Seconds per iteration (waiting for data, waiting for the gradient collectives, the rest) and
samples per iteration, for the log and the ETA."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from trainrun.dist.waits import take_wait
from trainrun.runner.hooks.base import TIMER, Hook

TOKENS = "num_tokens"  # the key of a dict batch that states how many tokens it holds
# over the timer's window: the seconds its iterations took, their samples, and their tokens
Window = tuple[float, int, int | None]
# where an iteration's seconds went, in this order: waiting for the batch (with the hooks
# between iterations), the rest (forward, backward, optimiser step), waiting in collectives
# (the gradients' at the end of backward, the runner's own between iterations)
PHASES = ("data", "compute", "comm")


def batch_counts(batch: Any) -> tuple[int, int | None]:
    """How many samples a batch holds (the length of its first tensor with a batch dimension,
    searched depth first) and how many tokens: where it is a dict holding `TOKENS`, a number,
    or one per sample (what collating a per-sample count makes), summed; else None."""
    # the usual batch first, without the search: a dict or list whose first item is the tensor
    kind, first = type(batch), None
    if kind is dict and batch and TOKENS not in batch:
        first = next(iter(batch.values()))
    elif (kind is list or kind is tuple) and batch:
        first = batch[0]
    if isinstance(first, Tensor) and first.dim() > 0:
        return first.shape[0], None
    tokens = batch.get(TOKENS) if isinstance(batch, Mapping) else None
    if tokens is not None:
        tokens = int(tokens.sum()) if isinstance(tokens, Tensor) else int(tokens)
    todo = [batch]
    while todo:
        item = todo.pop(0)
        if isinstance(item, Tensor) and item.dim() > 0:
            return len(item), tokens
        if isinstance(item, Mapping):
            todo[:0] = [v for k, v in item.items() if k != TOKENS]
        elif isinstance(item, (list, tuple)):
            todo[:0] = list(item)
    return 0, tokens


class IterTimerHook(Hook):
    """Keeps the iteration and data times, the time waited in collectives
    (`trainrun.dist.waits`; not counted in the data time), and the samples (and tokens) of
    this rank's batches (unless ``count_batches`` is false: the logger's step metrics are
    off), over the last ``window`` iterations; and the phases' seconds since they were last
    taken (`take_phases`)."""

    priority = TIMER  # see hooks/base.py for the order

    def __init__(self, window: int = 50, count_batches: bool = True):
        self.count_batches = count_batches
        self.iter_times: deque[float] = deque(maxlen=window)
        self.data_times: deque[float] = deque(maxlen=window)
        self.comm_times: deque[float] = deque(maxlen=window)
        # since `take_phases`: seconds waiting for data, in iterations, waiting in collectives,
        # and the iterations
        self._since = [0.0, 0.0, 0.0, 0]
        self.samples: deque[int] = deque(maxlen=window)
        self.tokens: deque[int | None] = deque(maxlen=window)
        self._last = 0.0
        self._between = 0.0  # waited in collectives since the last iteration ended

    def before_train_epoch(self, runner: Any) -> None:
        self._last = time.perf_counter()
        take_wait()  # what was waited before is no iteration's

    def before_train_iter(self, runner: Any, batch_idx: int, batch: Any) -> None:
        now, self._between = time.perf_counter(), take_wait()
        waited = max(now - self._last - self._between, 0.0)
        self.data_times.append(waited)
        self._since[0] += waited
        if self.count_batches:
            samples, tokens = batch_counts(batch)
            self.samples.append(samples)
            self.tokens.append(tokens)

    def after_train_iter(self, runner: Any, batch_idx: int, batch: Any,
                         outputs: dict[str, Any]) -> None:
        now = time.perf_counter()
        seconds, waited = now - self._last, self._between + take_wait()
        self.iter_times.append(seconds)
        self.comm_times.append(waited)
        since = self._since
        since[1] += seconds
        since[2] += waited
        since[3] += 1
        self._last = now

    def after_val(self, runner: Any, metrics: dict[str, float]) -> None:
        self._last = time.perf_counter()  # validation time is not an iteration's
        take_wait()

    @property
    def iter_time(self) -> float:
        return sum(self.iter_times) / len(self.iter_times) if self.iter_times else 0.0

    @property
    def data_time(self) -> float:
        return sum(self.data_times) / len(self.data_times) if self.data_times else 0.0

    @property
    def comm_time(self) -> float:
        return sum(self.comm_times) / len(self.comm_times) if self.comm_times else 0.0

    def phase_times(self) -> tuple[float, float, float]:
        """Each of `PHASES`' mean seconds an iteration over the window; compute is the
        iteration's time less the other two."""
        data, comm = self.data_time, self.comm_time
        return data, max(self.iter_time - data - comm, 0.0), comm

    def take_phases(self) -> tuple[float, float, float, int]:
        """Each of `PHASES`' mean seconds an iteration over the iterations since the last
        call (0.0 without any), and their number; the count starts again."""
        data, seconds, comm, iters = self._since
        self._since = [0.0, 0.0, 0.0, 0]
        if not iters:
            return 0.0, 0.0, 0.0, 0
        return (data / iters, max(seconds - data - comm, 0.0) / iters, comm / iters, iters)

    def window_counts(self) -> Window:
        """Over the window: the seconds its iterations took, their samples, and their tokens
        (None unless every batch in it stated its tokens)."""
        tokens = None if not self.tokens or None in self.tokens \
            else sum(self.tokens)  # type: ignore[arg-type]
        return sum(self.iter_times), sum(self.samples), tokens

    def eta_seconds(self, remaining_iters: int) -> float:
        return self.iter_time * remaining_iters
