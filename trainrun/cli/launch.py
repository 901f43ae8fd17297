"""``trainrun train CONFIG --nproc N``: N workers on this machine, started from this process by
torch's elastic launcher (what ``torchrun --standalone --nproc_per_node N`` runs), each
running ``python -m trainrun train CONFIG ... --launcher pytorch``.

torchrun alone ends a failed job with its own traceback (``ChildFailedError``) and the exit
code 1, whatever the workers said. Here each worker also leaves its exit code and the one
line it said last in a file of a directory this process names in ``TRAINRUN_REPORT_DIR``
(`leave_report`), and this process ends with the failing worker's line as the last line of
the output and that worker's exit code (2 a bad config, 1 a failure, 75 preempted, 130
interrupted). Ctrl-C and SIGTERM reach the workers through torchrun's agent, which passes the
signal on and waits for them (to checkpoint and stop) before it returns.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from trainrun.cli import TRAIN
from trainrun.exits import EXIT_OK

# where the workers of ``--nproc`` leave their reports (set by the process that starts them)
REPORT_DIR = "TRAINRUN_REPORT_DIR"
# the signals torchrun's agent turns into a shutdown of its workers; their handlers come back
# once the workers are gone
AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


@dataclass
class Report:
    """How one worker ended: its rank, exit code and the one line it said last (None where
    another rank says it); ``peer``: it stopped because another rank failed, whose own line
    names the cause; ``time``: when it was written (the first failure is the cause)."""

    rank: int
    code: int
    line: str | None
    peer: bool = False
    time: float = 0.0


def leave_report(code: int, line: str | None, peer: bool = False) -> None:
    """Under ``--nproc``, leave this worker's exit code and last line where the process that
    started it reads them (``$TRAINRUN_REPORT_DIR/rank<RANK>.json``, written whole or not at
    all); elsewhere nothing. Called as soon as the ending is known, before the run is closed:
    torchrun may end this process once another rank has exited."""
    directory = os.environ.get(REPORT_DIR)
    if not directory:
        return
    rank = int(os.environ.get("RANK", "0"))
    path = Path(directory) / f"rank{rank}.json"
    partial = path.with_name(path.name + ".part")
    record = {"rank": rank, "code": code, "line": line, "peer": peer, "time": time.time()}
    try:
        partial.write_text(json.dumps(record), encoding="utf-8")
        os.replace(partial, path)
    except OSError:  # the starter is gone, or its directory: it falls back on exit codes
        pass


def read_reports(directory: Path) -> list[Report]:
    """The reports the workers left in ``directory`` (a damaged one is passed over)."""
    reports = []
    for path in sorted(directory.glob("rank*.json")):
        try:
            reports.append(Report(**json.loads(path.read_text(encoding="utf-8"))))
        except (OSError, ValueError, TypeError):
            continue
    return reports


def worst_ending(reports: Sequence[Report], failure: tuple[int, int] | None = None,
                 signum: int | None = None) -> tuple[int, str | None]:
    """The job's exit code and last line: those of the worker whose failure came first (one
    that failed by itself before one stopped by another's failure); else, from torchrun,
    the first failed worker's ``(rank, exit code)`` (a negative code: killed by that signal);
    else the signal ``signum`` this process was stopped by; else success."""
    said = sorted((r for r in reports if r.code != EXIT_OK and r.line),
                  key=lambda r: (r.peer, r.time))
    if said:
        return said[0].code, said[0].line
    if failure is not None:
        rank, code = failure
        if code < 0:
            return 128 - code, f"rank {rank}: killed by {signal.Signals(-code).name}"
        return code, f"rank {rank}: exited with code {code} (its output above says why)"
    if signum is not None:
        return 128 + signum, f"stopped by {signal.Signals(signum).name}"
    return EXIT_OK, None


@contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` for the duration (the workers inherit it)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


@contextmanager
def _handlers_kept() -> Iterator[None]:
    """The handlers of the signals torchrun's agent takes over, put back afterwards."""
    names = [name for name in AGENT_SIGNALS if hasattr(signal, name)]
    kept = {name: signal.getsignal(getattr(signal, name)) for name in names}
    try:
        yield
    finally:
        for name, handler in kept.items():
            if handler is not None:
                signal.signal(getattr(signal, name), handler)


def launch_command(nproc: int, worker_args: Sequence[str]) -> list[str]:
    """torchrun's arguments for ``nproc`` workers of ``trainrun train WORKER_ARGS``."""
    return ["--standalone", "--nproc_per_node", str(nproc), *TRAIN, *worker_args]


def launch_workers(nproc: int, worker_args: Sequence[str]) -> int:
    """Run ``trainrun train WORKER_ARGS`` (which must include ``--launcher pytorch``) on
    ``nproc`` workers under torch's elastic launcher, here in this process, and wait for them.

    Returns:
        0 when every worker succeeded; else the exit code of the worker that failed first,
        whose one line is then said last on stderr.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from trainrun.dist.heartbeat import AGENT_PID

    arguments = parse_args(launch_command(nproc, worker_args))
    sys.stdout.flush()
    sys.stderr.flush()
    failure: tuple[int, int] | None = None
    signum: int | None = None
    # the workers' heartbeat ends this process when its store stops answering them
    # (trainrun.dist.heartbeat.end_agent): it knows this process by the pid named here
    with tempfile.TemporaryDirectory(prefix="trainrun-ranks-") as directory, \
            _environment(REPORT_DIR, directory), _environment(AGENT_PID, str(os.getpid())), \
            _handlers_kept():
        try:
            run(arguments)
        except ChildFailedError as error:
            rank, first = error.get_first_failure()
            failure = (rank, first.exitcode)
        except SignalException as error:  # the workers got it too, and have ended
            signum = int(error.sigval)
        except KeyboardInterrupt:  # before any worker started
            signum = int(signal.SIGINT)
        code, line = worst_ending(read_reports(Path(directory)), failure, signum)
    if line:
        print(line, file=sys.stderr, flush=True)
    return code
