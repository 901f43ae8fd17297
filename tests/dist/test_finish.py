"""The end of a job: ranks that finished wait for the others (``finish_together``), and a
process stuck at exit ends (``end_within``).

The whole path (a rank that hangs after training under torchrun ends the job, named) is
tested from the command line in tests/tools/test_train_faults.py; here are its parts, on real
gloo groups.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time

import pytest
import torch.distributed as torch_dist

import trainrun.dist as dist
from tests.cli import env
from trainrun.dist.heartbeat import PeerFailure, _prefix


def _together_body(late: float):
    """Every rank finishes; the last rank ``late`` seconds after the others. How long each
    waited."""
    rank, world_size = dist.get_dist_info()
    if rank == world_size - 1:
        time.sleep(late)
    began = time.monotonic()
    dist.finish_together(10)
    return time.monotonic() - began


def test_ranks_that_finish_together_wait_only_for_each_other(run_on, world_size):
    if world_size == 1:
        began = time.monotonic()
        dist.finish_together(10)  # nothing to wait for, without a group
        assert time.monotonic() - began < 0.1
        return
    *others, last = run_on(world_size)(_together_body, 0.5)
    assert all(0.4 < waited < 1.5 for waited in others), others  # for the last, no longer
    assert last < 0.5, last  # it came last: a store round or two


def _missing_rank_body(timeout: float):
    """Both ranks train (a heartbeat, to step 7); rank 1 then never finishes (until after
    rank 0 gave up). Rank 0: what it raised, and when; rank 1: the stop its heartbeat reads."""
    rank, _ = dist.get_dist_info()
    with dist.watch_ranks(30):
        dist.at_step(7, done=7)
        torch_dist.barrier()
    dist.at_step(None)
    store = torch_dist.distributed_c10d._get_default_store()
    if rank == 1:
        time.sleep(timeout + 3)
        stop = f"{_prefix()}/stop"  # what its heartbeat, had it still run, would read
        return json.loads(store.get(stop)) if store.check([stop]) else None
    began = time.monotonic()
    try:
        dist.finish_together(timeout)
    except PeerFailure as error:
        return str(error), error.said, time.monotonic() - began
    return None


def test_a_rank_that_does_not_finish_is_named_with_its_host_and_last_place(run_on, capfd):
    (message, said, waited), stop = run_on(2)(_missing_rank_body, 2.0)
    assert re.fullmatch(
        rf"rank 1 has not finished 2 s after rank 0 did \(hung after training\): rank 1 "
        rf"\(host {re.escape(socket.gethostname())}\) last seen finishing training at step 7 "
        r"\(then in its last hooks, closing, or its own code\)", message), message
    assert said and 2.0 <= waited < 4, waited  # it gave up at the timeout, and said so
    assert stop == {"message": message, "ranks": [1]}  # for rank 1's heartbeat to end it


def _late_comer_body():
    """Rank 1 comes after rank 0 gave up on it: it fails too, with rank 0's words."""
    rank, _ = dist.get_dist_info()
    if rank == 1:
        time.sleep(2.5)
    try:
        dist.finish_together(1.0)
    except PeerFailure as error:
        return str(error)
    return None


def test_a_rank_that_comes_after_the_others_gave_up_fails_with_their_words(run_on):
    first, late = run_on(2)(_late_comer_body)
    assert first is not None and first.startswith("rank 1 has not finished 1 s after rank 0")
    assert late == first


def _python(code: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, env=env())
    return done, time.monotonic() - began


@pytest.mark.slow
def test_a_process_stuck_at_exit_ends_itself_saying_so():
    done, took = _python("import atexit, time\n"
                         "from trainrun.dist.finish import end_within\n"
                         "atexit.register(time.sleep, 600)\n"
                         "end_within(2, rank=3)\n")
    assert done.returncode == 1 and took < 30, (done.returncode, took, done.stderr[-2000:])
    lines = [line for line in done.stderr.splitlines() if "stuck at exit" in line]
    assert len(lines) == 1 and re.search(r"ERROR rank 3 \(pid \d+\): stuck at exit: its run "
                                         r"ended 2 s ago", lines[0]), done.stderr[-2000:]
    assert "time.sleep" in done.stderr or "in _run_exitfuncs" in done.stderr or \
        "File" in done.stderr  # the stacks, which show where it hangs


@pytest.mark.slow
def test_a_process_that_ends_in_time_is_not_held_up_by_its_deadline():
    done, took = _python("from trainrun.dist.finish import end_within\n"
                         "end_within(30, rank=0)\n")
    assert done.returncode == 0 and took < 20, (took, done.stderr[-2000:])
    assert "stuck at exit" not in done.stderr
