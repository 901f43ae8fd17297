"""The heartbeat: who went silent or failed, and where every rank was.

The whole path (a frozen or failing rank under torchrun ends the job with one message) is
tested from the command line in tests/tools/test_train_cli.py; here are its parts.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as torch_dist

import trainrun.dist as dist
import trainrun.dist.heartbeat as heartbeat_module
from tests.cli import env
from trainrun.dist.heartbeat import Beat, Heartbeat, describe, one_line, rank_list


def test_rank_lists_shorten_runs():
    assert rank_list([1]) == "rank 1"
    assert rank_list([0, 1]) == "ranks 0, 1"
    assert rank_list([5, 0, 1, 2, 7, 8, 9, 10]) == "ranks 0-2, 5, 7-10"


class TruncatedImages(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        raise ValueError(f"sample {index}: image file is truncated")


def test_a_failure_in_one_line_says_a_dataloader_workers_own_error():
    """torch raises a worker's error again as "Caught ValueError in DataLoader worker process
    0." with the worker's traceback below: the line a failed run ends with shows the worker's
    own message instead (the line the heartbeat tells the other ranks, and the CLI's)."""
    with pytest.raises(ValueError) as raised:
        next(iter(torch.utils.data.DataLoader(TruncatedImages(), num_workers=1)))
    assert str(raised.value).startswith("Caught ValueError in DataLoader worker process 0.")
    assert one_line(raised.value) == \
        "sample 0: image file is truncated (in DataLoader worker process 0)"
    assert one_line(ValueError("the first line\nthe second")) == "the first line"


def test_describe_names_the_silent_ranks_and_groups_the_others():
    now = 1000.0
    beats = {0: Beat(9, now - 0.4, 58, "broadcast"), 1: Beat(5, now - 21.2, 57, "all_reduce"),
             2: Beat(9, now - 0.1, 58, "broadcast"), 3: None, 4: Beat(3, now - 50, 58, "finished")}
    message, silent = describe(beats, now, silent_after=3)
    assert silent == [1, 3]
    assert message == ("rank 1 silent for 21 s, last seen at step 57 in all_reduce; "
                       "rank 3 never reported; ranks 0, 2 waiting at step 58 in broadcast; "
                       "rank 4 finished")
    message, silent = describe({0: Beat(1, now, None, "setup"), 1: Beat(1, now, 3, "val")},
                               now, silent_after=3)
    assert (message, silent) == ("no rank is silent; rank 0 in setup; rank 1 at step 3 in val",
                                 [])
    # a rank that has not reported yet is starting, for the first seconds
    message, silent = describe({0: Beat(1, now, 2, "backward"), 1: None}, now, silent_after=3,
                               started=now - 1)
    assert (message, silent) == ("no rank is silent; rank 0 at step 2 in backward; "
                                 "rank 1 starting", [])


class RecordingHeartbeat(Heartbeat):
    """Records the stop it would end the process with, instead of ending it."""

    exits: list[tuple[str, list[int]]]

    def _exit(self, message: str, culprits: list[int]) -> None:
        self.conclude(message, culprits)
        self.exits.append((message, culprits))


def test_the_watcher_names_a_rank_that_stopped_beating():
    store = torch_dist.HashStore()
    dist.at_step(7)
    frozen = Heartbeat(store, 1, 2, silent_after=0.5, prefix="t")
    with dist.phase("forward"):
        frozen._beat()  # rank 1 reports once, then never again (as if SIGSTOPped)
    dist.at_step(8)
    watcher = RecordingHeartbeat(store, 0, 2, silent_after=0.5, prefix="t")
    watcher.exits = []
    with dist.phase("backward"):
        watcher.start()
        deadline = time.monotonic() + 10
        while not watcher.exits and time.monotonic() < deadline:
            time.sleep(0.02)
    watcher._stop.set()
    assert watcher.exits, "rank 1 was never found silent"
    message, culprits = watcher.exits[0]
    assert culprits == [1]
    assert re.fullmatch(r"rank 1 silent for \d s, last seen at step 7 in forward; "
                        r"rank 0 waiting at step 8 in backward", message), message
    assert watcher.posted() == (message, [1])  # for the other ranks to read
    assert watcher.reports([1]) and not frozen.reports([1])
    assert watcher.store.add(watcher.key("told"), 0) == 1


class CountingStore:
    """A store that counts the requests made through it."""

    def __init__(self, store):
        self.store, self.calls = store, []

    def __getattr__(self, name):
        call = getattr(self.store, name)

        def counted(*args):
            self.calls.append(name)
            return call(*args)
        return counted


def test_a_beat_costs_three_store_requests_and_an_account_two():
    shared = torch_dist.HashStore()
    ranks = [Heartbeat(CountingStore(shared), rank, 3, silent_after=10, prefix="t")
             for rank in range(3)]
    assert ranks[1]._read(0) is None  # not started: one check, and nothing read
    for rank in ranks:
        rank._beat()
    counting = ranks[1].store._store
    counting.calls.clear()
    for _ in range(3):  # what the thread does every beat, once rank 0 has reported
        ranks[1]._beat()
        ranks[1].store.check([ranks[1].key("stop")])
        assert ranks[1]._read(0).seq == 1
    assert counting.calls == ["set", "check", "check", "get"] + ["set", "check", "get"] * 2
    counting.calls.clear()
    message, silent = ranks[1].account()
    assert counting.calls == ["check", "multi_get"] and silent == []
    assert message.startswith("no rank is silent"), message


def test_the_ranks_beats_are_spread_over_the_interval_and_stay_on_their_grid():
    ranks = [Heartbeat(torch_dist.HashStore(), rank, 4, silent_after=10, prefix="t")
             for rank in range(4)]
    now = time.monotonic()
    for rank in ranks:  # as `_run` starts: rank r's beats at r / 4 of the interval
        rank._due = now + rank.interval * rank.rank / 4
    waits = [rank._until_next_beat() for rank in ranks]
    assert all(abs(w - e) < 0.05 for w, e in zip(waits, [1.0, 0.25, 0.5, 0.75], strict=True)), \
        waits
    late = ranks[1]
    late._due = time.monotonic() - 2.6  # its last beat ran 2.6 intervals late (a slow store)
    assert 0.3 < late._until_next_beat() <= 0.4  # the next slot of its grid, not at once


class Simulated(Heartbeat):
    """A rank of a job simulated in threads: records the stop it would end its process with
    (one it found, or one posted by another rank) instead of ending this test's process."""

    def _exit(self, message: str, culprits: list[int]) -> None:
        self.conclude(message, culprits)
        self.found = (message, culprits)
        self._stop.set()

    def _stop_for_posted(self) -> None:
        self.conclude(*self.posted())
        self._stop.set()


def test_ranks_with_clients_of_one_tcpstore_name_the_rank_that_froze():
    """What bench/heartbeat_scale.py runs by the thousand: every rank its own client."""
    master = torch_dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ranks = [Simulated(torch_dist.TCPStore("127.0.0.1", master.port, is_master=False,
                                           timeout=heartbeat_module.client_timeout(2)),
                       rank, 5, silent_after=2.0, prefix="sim") for rank in range(5)]
    dist.at_step(4)
    with dist.phase("forward"):
        for rank in ranks:
            rank.found = None
            rank.start()
        time.sleep(0.5)
        ranks[2]._stop.set()  # rank 2's heartbeat stops, as in a process that froze
        deadline = time.monotonic() + 10
        while not all(r._stop.is_set() for r in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
    for rank in ranks:
        rank._stop.set()
        rank._thread.join()
        rank._guard.join()
    assert ranks[3].found is not None, "the rank after the frozen one did not name it"
    message, culprits = ranks[3].found
    assert culprits == [2], message
    assert re.fullmatch(r"rank 2 silent for \d s, last seen at step 4 in forward; "
                        r"ranks 0, 1, 3, 4 waiting at step 4 in forward", message), message
    assert [r.found for r in ranks if r.rank != 3] == [None] * 4  # the others read it
    assert master.add("sim/told", 0) == 4


class BlockedStore:
    """A store whose host froze, or was cut off: every call blocks (torch's store client may
    never return then, whatever its timeout)."""

    host, port = "10.0.0.1", 29500

    def __getattr__(self, name):
        def call(*args):
            threading.Event().wait()
        return call


class RefusingStore:
    """A store whose host died: every call fails at once with a reset connection."""

    host, port = "10.0.0.1", 29500

    def __getattr__(self, name):
        def call(*args):
            raise torch_dist.DistNetworkError("Connection reset by peer")
        return call


class LostHeartbeat(Heartbeat):
    """Records why the rank would stop, and when, instead of ending the process."""

    def _exit_lost(self, reason: str, unanswered: bool = False) -> None:
        if not self._stop.is_set():
            self.lost.append((time.monotonic() - self.since, self.lost_contact(reason)))
            self.ends_agent = unanswered
            self._stop.set()


def _lost(store, launcher=None, training=True, silent_after=0.6):
    heartbeat = LostHeartbeat(store, 1, 2, silent_after=silent_after, prefix="t",
                              launcher=launcher, training=training)
    heartbeat.lost, heartbeat.since = [], time.monotonic()
    heartbeat._thread.start()  # start() would beat first, from this thread
    heartbeat._guard.start()
    heartbeat._guard.join(timeout=10)
    assert heartbeat.lost, "the rank was never stopped"
    assert heartbeat.ends_agent == isinstance(store, BlockedStore)  # only a silent store's
    return heartbeat.lost[0]


def test_a_store_that_blocks_ends_the_rank_after_the_timeout():
    dist.at_step(12)
    dist.at_checkpoint("iter_10.pth", 10)
    seconds, message = _lost(BlockedStore())
    assert 0.6 <= seconds < 5, seconds  # (the upper bound leaves a loaded machine seconds)
    assert message == ("rank 1: stopping: no answer from the job's store at 10.0.0.1:29500 for "
                       "1 s: its host froze, or the network between this node and it is "
                       "down, so the other ranks cannot be reached either; step 11 is lost "
                       "since checkpoint iter_10.pth (step 10); --resume continues from it"), \
        message


def test_a_store_that_refuses_ends_the_rank_within_seconds_whatever_the_timeout():
    dist.at_step(31)
    dist.at_checkpoint(None)
    heartbeat_gone = Heartbeat.GONE_AFTER
    Heartbeat.GONE_AFTER = 0.3
    try:
        seconds, message = _lost(RefusingStore(), silent_after=10)
    finally:
        Heartbeat.GONE_AFTER = heartbeat_gone
    assert seconds < 5  # long before the 10 s timeout: a dead store is not a slow one
    assert message == ("rank 1: stopping: the job's store at 10.0.0.1:29500 is gone "
                       "(Connection reset by peer): its host or the launcher hosting it died; "
                       "the 30 steps trained are lost (no checkpoint yet); --resume starts "
                       "again from the beginning")


def test_a_rank_whose_launcher_died_stops(monkeypatch):
    monkeypatch.setattr(heartbeat_module, "_PARENT", -5)  # not this process's parent
    dist.at_step(None)
    seconds, message = _lost(torch_dist.HashStore(), launcher="torchrun", training=False,
                             silent_after=10)
    assert seconds < 5  # at the guard's next look, long before any timeout
    assert message == "rank 1: stopping: its launcher (torchrun, pid -5) is gone"


# a stand-in for torchrun's agent: starts one worker that ends its agent (as a rank does whose
# store stopped answering), then waits for it; "stuck" ignores SIGTERM, as an agent blocked in a
# store call does
FAKE_AGENT = """
import os, signal, subprocess, sys
if sys.argv[1] == "stuck":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
env = {**os.environ, "TORCHELASTIC_RUN_ID": "t", "LOCAL_RANK": "0"}
if sys.argv[2] == "names-itself":  # as trainrun train --nproc does
    env["TRAINRUN_AGENT_PID"] = str(os.getpid())
worker = subprocess.Popen([sys.executable, "-c", "from trainrun.dist.heartbeat import end_agent; "
                           "end_agent(2, grace=0.5)"], env=env)
sys.exit(worker.wait())
"""


@pytest.mark.parametrize("name, agent, naming, code, killed", [
    ("torchrun", "stuck", "", -9, True),
    ("torchrun", "responsive", "", -15, False),
    ("launcher.py", "stuck", "names-itself", -9, True),
    ("launcher.py", "stuck", "", 0, False),  # not torchrun's agent: never signalled
])
def test_a_rank_ends_the_torchrun_agent_that_started_it_and_no_other_parent(
        tmp_path, name, agent, naming, code, killed):
    script = tmp_path / name
    script.write_text(FAKE_AGENT)
    done = subprocess.run([sys.executable, str(script), agent, naming or "-"], env=env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == code, done.stderr
    line = re.search(r"ERROR rank 2: torchrun's agent \(pid \d+\) cannot reach the job's store "
                     r"either and did not end within 0.5 s of a SIGTERM: killed it \(SIGKILL\), "
                     r"so that the job ends on this node", done.stderr)
    assert bool(line) == killed, done.stderr


class TimingOutStore:
    """A store cut off from this rank whose calls give up after their timeout."""

    host, port = "10.0.0.1", 29500

    def __getattr__(self, name):
        def call(*args):
            raise torch_dist.DistStoreError("wait timeout after 5000ms")
        return call


@pytest.mark.parametrize("store, ends_agent", [(TimingOutStore(), True),
                                               (RefusingStore(), False)])
def test_a_rank_whose_collective_and_silent_store_failed_ends_its_agent_at_exit(
        monkeypatch, store, ends_agent):
    """The main thread's way out (its collective failed, then the store too): an agent that
    cannot reach the store either is ended once the rank has said why (at its exit); one whose
    store refuses finds that out by itself."""
    from trainrun.runner.failures import tell_peers

    registered = []
    monkeypatch.setattr(heartbeat_module.atexit, "register",
                        lambda *call: registered.append(call))
    heartbeat = Heartbeat(store, 2, 4, silent_after=10, prefix="t")
    with pytest.raises(dist.PeerFailure, match=r"rank 2: stopping: lost contact with the other "
                       r"ranks \(Connection closed by peer\) and with the job's store"):
        tell_peers(RuntimeError("Connection closed by peer"), heartbeat)
    assert registered == ([(heartbeat_module.end_agent, 2)] if ends_agent else [])


def test_what_a_stop_loses():
    dist.at_checkpoint("epoch_2.pth", 40)
    for step, said in ((None, "nothing since checkpoint epoch_2.pth is lost"),
                       (41, "nothing since checkpoint epoch_2.pth is lost"),
                       (42, "step 41 is lost since checkpoint epoch_2.pth (step 40)"),
                       (50, "steps 41-49 are lost since checkpoint epoch_2.pth (step 40)")):
        dist.at_step(step)
        assert heartbeat_module.lost_work().startswith(said)
    dist.at_step(45, done=45)  # in step 45's hooks: the step itself is trained, and lost
    assert heartbeat_module.lost_work().startswith("steps 41-45 are lost since checkpoint")
    dist.at_checkpoint(None)
    dist.at_step(1)
    assert heartbeat_module.lost_work() == ("nothing trained is lost (no checkpoint yet); "
                                            "--resume starts again from the beginning")


def _posted_failure_body(failing):
    rank, world = dist.get_dist_info()
    with dist.watch_ranks(30) as heartbeat:
        dist.at_step(5)
        if rank == failing:
            with dist.phase("forward"):
                started = time.monotonic()
                heartbeat.post_failure(ValueError("boom\nsecond line"))  # returns once told
                told = heartbeat.store.add(heartbeat.key("told"), 0)
                waited = time.monotonic() - started
        else:
            with dist.phase("backward"):
                heartbeat.explain()
            told, waited = None, 0.0
        message, culprits = heartbeat.posted()
        return message, culprits, heartbeat.reports(culprits), told, waited


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("failing", [0, 1])
def test_a_failure_posted_by_one_rank_is_what_the_others_report(run_on, world_size, failing):
    results = run_on(world_size)(_posted_failure_body, failing)
    expected = f"rank {failing} failed at step 5 in forward: ValueError: boom"
    assert all(r[:2] == (expected, [failing]) for r in results), results
    reporters = [rank for rank, r in enumerate(results) if r[2]]
    assert reporters == [1 if failing == 0 else 0]  # one line for the whole job
    assert results[failing][3] == world_size - 1 and results[failing][4] < 5, results[failing]


def _explain_body():
    rank, _ = dist.get_dist_info()
    with dist.watch_ranks(30) as heartbeat:
        dist.at_step(3)
        with dist.phase("all_reduce" if rank == 0 else "broadcast"):
            heartbeat._beat()  # as the thread would within a second
            torch_dist.barrier()
            return heartbeat.explain(wait=0.3), heartbeat.posted()[1]


def test_with_nobody_silent_the_account_says_where_each_rank_waits(run_on):
    first, second = run_on(2)(_explain_body)
    assert first == second == ("no rank is silent; rank 0 at step 3 in all_reduce; "
                               "rank 1 at step 3 in broadcast", [])


def _collective_place_body():
    place = dist.heartbeat._place
    dist.set_phase("setup")
    with dist.watch_ranks(30) as heartbeat:
        inside = []
        with dist.phase("hooks"):
            inside.append(place.phase)
            with dist.phase("checkpoint save"):
                dist.all_reduce(torch.ones(1))  # a named collective reports its name, but
                inside.append(place.phase)  # only while it runs
        inside.append(place.phase)
    return heartbeat is not None, inside


def test_no_heartbeat_without_a_group_and_phases_nest(run_on, world_size):
    results = run_on(world_size)(_collective_place_body) if world_size > 1 \
        else [_collective_place_body()]
    assert all(r == (world_size > 1, ["hooks", "checkpoint save", "setup"]) for r in results)


def test_a_lost_rank_exits_with_the_command_lines_failure_code():
    from trainrun.dist.heartbeat import RANK_LOST_EXIT
    from trainrun.exits import EXIT_FAILED

    assert RANK_LOST_EXIT == EXIT_FAILED
