"""The end of a job: every rank waits for the others to finish, and a rank stuck at exit ends.

A rank that has finished its run stops watching the others (its heartbeat ends with its
``after_run`` hooks), so a rank that hangs after the last collective (in its last hooks,
closing its run) would never be named: the other ranks exit, and the launcher waits on the
hung one for good.
``finish_together`` closes that gap: each finished rank says so in the job's store and waits
(at most the collective timeout) until every rank has; a rank still missing then is named,
with its host and where its heartbeat last saw it, and every waiting rank raises
``PeerFailure`` (a non-zero exit), which makes the launcher end the hung one. A rank still in
its heartbeat is ended by it, told through the store.

A rank that hangs at exit itself (an ``atexit`` handler, a thread that never ends) has passed
that point: ``end_within`` gives the process a deadline to end by, after which it says so and
ends with a non-zero exit.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from typing import NoReturn

import torch.distributed as torch_dist

from trainrun.dist.heartbeat import (
    Beat,
    Heartbeat,
    PeerFailure,
    _flush_logs,
    _prefix,
    exit_saying,
    log,
    one_line,
    rank_list,
)

POLL_SECONDS = 0.02  # how often a rank that has finished asks whether the others have too


def finish_together(timeout: float) -> None:
    """Wait until every rank of the default group has called this, for at most ``timeout``
    seconds; name the ranks that have not by then, and raise.

    Every rank must call it once its run is over and before the group is left (it talks
    through the group's store). A run that ends normally costs each rank a few store
    requests, and the ranks that come before the last one a poll every ``POLL_SECONDS``
    until it does. Rank 0 also waits until every rank has seen the others come (the store
    may live in its process, and a rank still asking must not find it gone), which names a
    rank frozen right there too. The ranks that come after another rank gave up fail too.
    A no-op in one process, or without a store (the MPI backend).

    Args:
        timeout: the most seconds to wait for the last rank (the collective timeout).

    Raises:
        PeerFailure: a rank did not come within ``timeout`` seconds (the message names it,
            its host and where it was last seen, and is logged once for the job), or the
            job's store stopped answering.
    """
    if not (torch_dist.is_available() and torch_dist.is_initialized()) \
            or torch_dist.get_world_size() == 1:
        return
    try:  # the group's own client: a new one (``clone``) now and then takes 5 s to connect
        store = torch_dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):  # no store, as under the MPI backend
        store = None
    if store is None:
        log.debug("no wait for the other ranks at the end: the default group has no store")
        return
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get(
        "SLURM_RESTART_COUNT") or "0"
    # the heartbeat of this rank's last run: where each rank was, and its stop key
    beats = Heartbeat(store, torch_dist.get_rank(), torch_dist.get_world_size(), timeout,
                      _prefix())
    _Finish(beats, f"trainrun/finish/{restart}", timeout).run()


class _Finish:
    """One ``finish_together``: each rank's keys in the store, and what a rank that waits
    says when one does not come."""

    def __init__(self, beats: Heartbeat, prefix: str, timeout: float):
        self.beats, self.base, self.timeout = beats, prefix, timeout
        self.store, self.rank, self.size = beats.store, beats.rank, beats.world_size
        self.prefix = prefix

    def key(self, name: str, rank: int | None = None) -> str:
        return f"{self.prefix}/{name}" if rank is None else f"{self.prefix}/{name}/{rank}"

    def run(self) -> None:
        started = time.monotonic()
        try:
            # the n-th finish of this rank in this group's store: keys of its own (a group
            # two runners used one after the other finishes twice)
            count = self.store.add(f"{self.base}/count/{self.rank}", 1)
            self.prefix = f"{self.base}/{count}"
            self.store.set(self.key("came", self.rank), "1")
            self._wait("came", started)
            self.store.set(self.key("seen", self.rank), "1")
            if self.rank == 0:
                self._wait("seen", started)
        except PeerFailure:
            raise
        except Exception as error:  # the store's host is gone or does not answer
            raise PeerFailure(
                f"rank {self.rank}: could not wait for the other ranks to finish: the job's "
                f"store at {self.beats.address}: {one_line(error)}", said=False) from None

    def _wait(self, name: str, started: float) -> None:
        """Poll until every rank has set its ``name`` key, or fail naming those that have not."""
        keys = [self.key(name, r) for r in range(self.size)]
        while True:
            if self.store.check([self.key("failed")]):  # a rank gave up on one: the job fails
                raise PeerFailure(json.loads(self.store.get(self.key("failed"))))
            if self.store.check(keys):
                return
            if time.monotonic() - started >= self.timeout:
                self._fail(name)
            time.sleep(POLL_SECONDS)

    def _fail(self, name: str) -> NoReturn:
        """Name the ranks that have not come (or not gone on), post that for the job, tell
        the missing ranks' heartbeats (which end them), and raise."""
        missing = [r for r in range(self.size) if not self.store.check([self.key(name, r)])]
        message = self.describe(missing, name)
        posted = json.loads(self.store.compare_set(self.key("failed"), "", json.dumps(message)))
        if posted == message:  # said once for the job, by the first rank that gave up
            log.error("stopping every rank: %s", message)
            _flush_logs()
            stop = json.dumps({"message": message, "ranks": missing})
            self.store.compare_set(self.beats.key("stop"), "", stop)
        raise PeerFailure(posted)

    def describe(self, missing: list[int], name: str) -> str:
        """'rank 1 (host h) has not finished 10 s after rank 0 did ...: last seen ...'."""
        now, beats = time.time(), self.beats.beats()
        parts = []
        for rank in missing:
            host = self._host(rank)
            where = f" (host {host})" if host else ""
            parts.append(f"rank {rank}{where} {_last_seen(beats.get(rank), now)}")
        others = rank_list([r for r in range(self.size) if r not in missing])
        verb = "has" if len(missing) == 1 else "have"
        if name == "seen":  # it came, then stopped before it could see the others come
            return (f"{rank_list(missing)} finished but {verb} not gone on {self.timeout:.0f} s "
                    f"later (stopped as the job ended): " + "; ".join(parts))
        return (f"{rank_list(missing)} {verb} not finished {self.timeout:.0f} s after "
                f"{others} did (hung after training): " + "; ".join(parts))

    def _host(self, rank: int) -> str | None:
        key = self.beats.key(f"host/{rank}")
        return self.store.get(key).decode() if self.store.check([key]) else None


def _last_seen(beat: Beat | None, now: float) -> str:
    """Where a rank's heartbeat last saw it, for the line naming a rank that did not finish."""
    if beat is None:
        return "never reported where it was"
    if beat.phase == "finished":
        return f"last seen finishing training at step {beat.step} (then in its last hooks, " \
               "closing, or its own code)"
    return f"last seen {beat.where()} {now - beat.time:.0f} s ago"


def end_within(seconds: float, rank: int) -> None:
    """End this process if it is still alive ``seconds`` from now: its run is over, so it is
    stuck at exit (an ``atexit`` handler, a thread that never ends). It then says so in one
    line on stderr, with every thread's stack, and exits non-zero, which a launcher such as
    torchrun reports (naming the rank). Python's ``faulthandler`` ends it a few seconds later
    where Python threads no longer run (the interpreter's last steps).

    Args:
        seconds: how long the process may take to end (the collective timeout).
        rank: this process's rank, for the message.
    """
    def watch() -> None:
        time.sleep(seconds)
        _flush_logs()
        try:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except (OSError, ValueError, RuntimeError):
            pass
        exit_saying(f"rank {rank} (pid {os.getpid()}): stuck at exit: its run ended "
                    f"{seconds:.0f} s ago and the process has not (an atexit handler or a "
                    "thread that does not end; their stacks are above); ending it")

    threading.Thread(target=watch, name="trainrun-exit-deadline", daemon=True).start()
    try:
        faulthandler.dump_traceback_later(seconds + 5, exit=True)
    except (OSError, ValueError, RuntimeError):  # no usable stderr
        pass

