"""Stopping cleanly when the cluster asks: by default SIGTERM (torchrun passing on its own,
SLURM at preemption or the time limit) or SIGUSR1 (what ``sbatch --signal=USR1@120`` sends
before the time limit, as tools/slurm_train.sbatch asks); ``preemption.signals`` in the config
names others.

The handler only records the signal: no collectives and no I/O run inside it. At step
boundaries (about every quarter of a second) the ranks agree through one small all_reduce of
that record, so all of them stop after the same step even when the signal reached only some;
then a checkpoint is written, a
SLURM job requeues itself where ``scontrol`` allows it, and `Preempted` ends the run (exit
code `trainrun.exits.EXIT_PREEMPTED` from the command line).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import torch

from trainrun.dist import all_reduce, get_rank, is_distributed
from trainrun.dist.waits import waiting
from trainrun.messages import first_line
from trainrun.runner.schema import bad_value, names, section

log = logging.getLogger("trainrun")

STOP_SIGNALS = ("SIGTERM", "SIGUSR1")  # the default of preemption.signals
UNCATCHABLE = ("SIGKILL", "SIGSTOP")


class Preempted(Exception):  # noqa: N818 - a stop, not an error
    """Training stopped at ``step`` because of ``signal_name``, after saving a checkpoint;
    ``requeued``: the SLURM job requeued itself; ``not_requeued``: why a SLURM job could not."""

    def __init__(self, step: int, signal_name: str, checkpoint: str, requeued: bool,
                 not_requeued: str | None = None):
        self.step, self.signal_name = step, signal_name
        self.checkpoint, self.requeued = checkpoint, requeued
        if requeued:
            then = "the job is requeued"
        else:
            then = (f"this SLURM job could not requeue itself ({not_requeued}): submit it "
                    f"again, or " if not_requeued else "") + \
                "run the same command with --resume to continue from it"
        super().__init__(f"stopped by {signal_name} after step {step}; checkpoint "
                         f"{checkpoint} written; {then}")


class StopRequest:
    """The signal this process received, if any (set by the handler, read between steps).

    Agreeing costs an all_reduce; so that a 10 ms step does not pay it every time, the ranks
    agree every ``interval`` steps, rank 0 choosing the next interval so that agreements
    happen about every `CHECK_SECONDS` (at every step when steps are slower than that). The
    interval travels in the same all_reduce, so every rank checks at the same steps.
    """

    CHECK_SECONDS = 0.25

    def __init__(self) -> None:
        self.signum: int | None = None
        self._countdown = 1  # steps until the next agreement
        self._interval = 1  # steps between the last two agreements
        self._since: float | None = None  # when the ranks last agreed

    def handler(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum  # nothing else: a handler runs between any two bytecodes

    def agreed(self) -> str | None:
        """The name of a stop signal if some rank had one, at the steps the ranks agree on;
        None otherwise. Every rank calls this at every step boundary; without a group the
        answer is this process's own, at once."""
        self._countdown -= 1
        if self._countdown > 0:  # first: this is every step's whole cost between agreements
            return None
        if not is_distributed():
            self._countdown = 1
            return signal.Signals(self.signum).name if self.signum else None
        proposal = 0
        if get_rank() == 0:  # the step time is known from the second agreement on
            proposal = 1
            if self._since is not None:
                per_step = max(time.monotonic() - self._since, 1e-6) / self._interval
                proposal = max(1, min(1000, int(self.CHECK_SECONDS / per_step)))
        message = torch.tensor([self.signum or 0, proposal], dtype=torch.int32)
        with waiting():  # the step metrics' comm_time, not the data loader's
            all_reduce(message, op="max")
        signum, interval = (int(v) for v in message.tolist())
        self._countdown = self._interval = interval
        self._since = time.monotonic()
        return signal.Signals(signum).name if signum else None


def signal_number(name: str) -> signal.Signals:
    """The signal called ``name`` ('SIGTERM', 'TERM', 'usr1'); ValueError for an unknown or
    uncatchable one."""
    full = name.upper() if name.upper().startswith("SIG") else f"SIG{name.upper()}"
    if full in UNCATCHABLE:
        raise ValueError(f"{name} cannot be caught, so it cannot stop training cleanly")
    try:
        return signal.Signals[full]
    except KeyError:
        raise ValueError(f"{name!r} is not a signal of this system") from None


@contextmanager
def stop_signals(names: tuple[str, ...] | list[str] = STOP_SIGNALS) -> Iterator[StopRequest]:
    """Record the signals ``names`` (SIGTERM and SIGUSR1 by default) instead of dying of them,
    for the duration; the handlers that were there before come back afterwards, except after a
    run that requeued its SLURM job: SLURM then cancels the job's tasks (SIGTERM, SIGKILL
    after its KillWait, 30 s by default), and this process ignores the SIGTERM and these
    signals so that it can still close the run and say why it stopped. Outside the main thread
    (where Python cannot install handlers) signals keep their previous handling."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {signum: signal.signal(signum, request.handler)
                for signum in map(signal_number, names)}
    try:
        yield request
    except Preempted as stop:
        if stop.requeued:
            for signum in {*previous, signal.SIGTERM}:
                signal.signal(signum, signal.SIG_IGN)
            previous = {}
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def requeue_slurm_job() -> tuple[bool, str | None]:
    """``scontrol requeue $SLURM_JOB_ID`` when inside a SLURM job: whether the job is
    requeued, and if it is a SLURM job that is not, why (None outside SLURM)."""
    array_job, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job_id = f"{array_job}_{task}" if array_job and task else os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return False, None
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return False, "scontrol is not installed here, as in many containers"
    try:
        done = subprocess.run([scontrol, "requeue", job_id], capture_output=True, text=True,
                              timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return False, f"scontrol requeue {job_id} failed: {error}"
    if done.returncode != 0:
        why = first_line(done.stderr or done.stdout) or f"exit {done.returncode}"
        return False, f"scontrol requeue {job_id} refused: {why}"
    return True, None


def stop_signal(key: str, value: Any) -> str:
    """A signal name ('SIGTERM', 'TERM', 'usr1') that can be caught, as 'SIGTERM'."""
    if not isinstance(value, str):
        raise bad_value(key, value, "a signal name such as SIGTERM or SIGUSR1")
    try:
        return signal_number(value).name
    except ValueError as error:
        raise bad_value(key, value, f"a signal that can be caught ({error})") from None


stop_signal.expected = "signal names such as SIGTERM or SIGUSR1"  # type: ignore[attr-defined]


PREEMPTION_KEYS = {
    "signals": (list(STOP_SIGNALS), names(stop_signal),
                "the signals that stop training at the next step with a checkpoint and exit "
                "75 (SLURM: requeued); SIGKILL and SIGSTOP cannot be caught"),
}
check_preemption = section(PREEMPTION_KEYS)
