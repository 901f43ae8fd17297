"""Running a test body on every rank of a real gloo process group.

`DistPool` keeps N worker processes alive for the whole test session and gives each call a
fresh process group, so a multi-process test costs tens of milliseconds instead of the
seconds a new interpreter per test would. A body is a module-level function (it is pickled
by name); what it returns on each rank comes back as a list, and an exception on any rank
fails the test with that rank's traceback.
"""

from __future__ import annotations

import datetime
import gc
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

GROUP_TIMEOUT_S = 30.0


def _worker(conn: Connection, rank: int, world_size: int) -> None:
    """Join a new group for each body the parent sends, run it, report, leave the group.

    One key-value store serves the pool's whole life; each group gets its own prefix in it.
    Rank 0 opens the store on a port the system picks and says which through the parent, so
    no other pool or job can take the port between its choice and its use.
    """
    import torch
    import torch.distributed as torch_dist

    from trainrun.dist import timeouts

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    port = 0 if rank == 0 else conn.recv()
    store = torch_dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0,
                                timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    if rank == 0:
        conn.send(store.port)
    while True:
        message = conn.recv()
        if message is None:
            return
        body, args, call, timeout_s = message
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            torch_dist.init_process_group(
                "gloo", store=torch_dist.PrefixStore(f"call{call}", store), rank=rank,
                world_size=world_size, timeout=timeout,
            )
            # gloo's mesh can be whole for one rank while another still finishes its
            # handshake: without this, a body that makes no collective lets a quick rank
            # leave the group and close a socket the slower one is still reading from
            torch_dist.barrier()
            timeouts.set_timeout(timeout)
            reply = ("ok", body(*args))
        except BaseException:  # noqa: B036 - report everything, the parent decides
            reply = ("error", traceback.format_exc())
        finally:
            if torch_dist.is_initialized():
                torch_dist.destroy_process_group()
            timeouts.set_timeout(timeouts.DEFAULT_TIMEOUT)
        try:
            conn.send(reply)
        except Exception:
            conn.send(("error", f"the result of rank {rank} cannot be pickled: {reply[1]!r}"))


class RankFailure(AssertionError):
    """One or more ranks of a test body raised or did not answer."""


class DistPool:
    """``world_size`` spawned worker processes that run test bodies in a gloo group."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._procs: list[mp.Process] = []
        self._conns: list[Connection] = []
        self._calls = 0

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(child, rank, self.world_size), daemon=True)
            proc.start()
            self._procs.append(proc)
            self._conns.append(parent)
        if not self._conns[0].poll(GROUP_TIMEOUT_S * 4):
            raise RankFailure("rank 0 of the pool did not open its store")
        port = self._conns[0].recv()
        for conn in self._conns[1:]:
            conn.send(port)

    def run(self, body: Callable[..., Any], *args: Any,
            timeout: float = GROUP_TIMEOUT_S) -> list[Any]:
        """Run ``body(*args)`` on every rank; the list of what each rank returned."""
        if not self._procs:
            self._start()
        self._calls += 1
        for conn in self._conns:
            conn.send((body, args, self._calls, timeout))
        replies = self._collect(deadline=time.monotonic() + timeout + 30)
        failures = {r: rep for r, rep in replies.items() if rep is None or rep[0] == "error"}
        if failures:
            # the ranks may now be out of step (one stuck, or one in a group the others left):
            # the next test starts on fresh processes, so one failure never spreads
            self.close()
            raise RankFailure(self._describe(body, failures))
        return [replies[r][1] for r in range(self.world_size)]

    def _collect(self, deadline: float) -> dict[int, tuple | None]:
        """Every rank's reply; once one rank has failed, the others get a short grace period."""
        replies: dict[int, tuple | None] = {}
        pending = set(range(self.world_size))
        while pending and time.monotonic() < deadline:
            for rank in sorted(pending):
                if self._conns[rank].poll(0.005):
                    try:
                        replies[rank] = self._conns[rank].recv()
                    except EOFError:
                        replies[rank] = ("error", f"rank {rank}'s process died")
                    pending.discard(rank)
                    if replies[rank][0] == "error":
                        deadline = min(deadline, time.monotonic() + 3)
                elif not self._procs[rank].is_alive():
                    replies[rank] = ("error", f"rank {rank}'s process died "
                                              f"(exit code {self._procs[rank].exitcode})")
                    pending.discard(rank)
        for rank in pending:
            replies[rank] = None
        return replies

    def _describe(self, body: Callable, failures: dict[int, tuple | None]) -> str:
        lines = [f"{body.__name__} failed on {len(failures)} of {self.world_size} ranks"]
        for rank, reply in sorted(failures.items()):
            text = reply[1] if reply is not None else "no answer (hung or waiting on the others)"
            lines.append(f"--- rank {rank} ---\n{text}")
        return "\n".join(lines)

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._procs, self._conns = [], []


def released(*objects: Any) -> None:
    """Let go of a body's DDP objects at once: DDP's reducer must be gone before the pool
    destroys the group (gloo can abort)."""
    del objects
    gc.collect()
