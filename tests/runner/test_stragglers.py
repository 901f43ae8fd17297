"""Stragglers: the step metrics carry each phase's largest time over the ranks and its rank,
and rank 0 names the rank the others wait for (its host, its phase, how much slower)."""

from __future__ import annotations

import json
import re
import socket
import time

import pytest

import trainrun.dist as dist
import trainrun.dist.heartbeat as heartbeat
from tests.runner.toy import ToyModel, ToyRegression
from trainrun.runner.hooks.stragglers import LINK, StragglerWatch, standout
from trainrun.runner.runner import Runner

HOSTS = ["node-a", "node-b", "node-c"]


def _interval(data=0.001, compute=0.01, comm=0.002, steps=10, trip=0.0002):
    return [data, compute, comm, steps, trip]


def test_the_rank_slow_in_data_stands_out_not_the_ones_that_wait_for_it():
    # rank 1 loads for 50 ms more; ranks 0 and 2 wait for it at the end of backward
    ranks = [_interval(comm=0.052), _interval(data=0.051), _interval(comm=0.052)]
    assert standout(ranks) == (1, 0, 0.051, 0.001)
    # on two ranks too, where the waiting rank's wait is far above the straggler's
    assert standout(ranks[:2]) == (1, 0, 0.051, 0.001)


def test_a_rank_slow_in_compute_stands_out_in_compute():
    ranks = [_interval(comm=0.032), _interval(comm=0.032), _interval(compute=0.04)]
    assert standout(ranks)[:2] == (2, 1)


def test_a_rank_whose_own_collectives_are_slow_stands_out_in_communication():
    ranks = [_interval(), _interval(comm=0.03), _interval()]
    assert standout(ranks)[:2] == (1, 2)


def test_small_or_even_differences_name_no_one():
    # twice the others' data time, but 1 ms against an 11 ms iteration: below the share
    assert standout([_interval(), _interval(data=0.002), _interval()]) is None
    # every rank's collectives slow alike (a slow link)
    assert standout([_interval(comm=0.1), _interval(comm=0.11), _interval(comm=0.1)]) is None
    assert standout([_interval()]) is None


def test_a_node_whose_store_round_trip_is_slow_is_named_in_communication():
    """A slow link to node 1 (ranks 2 and 3): every rank waits in its collectives alike,
    node 1's heartbeat takes 50 ms more to reach the store on node 0."""
    ranks = [_interval(comm=0.12), _interval(comm=0.12), _interval(comm=0.12, trip=0.0502),
             _interval(comm=0.12, trip=0.0503)]
    assert standout(ranks) == (3, LINK, 0.0503, 0.0002)
    # where a rank's own work stands out, that is the answer, whatever the round trips say
    ranks[1] = _interval(compute=0.05, comm=0.08)
    assert standout(ranks)[:2] == (1, 1)
    # round trips a few ms long are no slow link
    assert standout([_interval(comm=0.12, trip=0.008), _interval(comm=0.12)]) is None
    watch = StragglerWatch(HOSTS[:2])
    slow = [_interval(comm=0.12), _interval(comm=0.12, trip=0.05)]
    assert watch.update(slow) == []
    [(level, message)] = watch.update(slow)
    assert message == ("straggler: rank 1 (host node-b) is the slowest in communication for "
                       "the last 20 steps: its round trip to the job's store takes 250.0 times "
                       "the median of the other ranks' (0.0500 s against 0.0002 s), as on a "
                       "slow link to its node, which every rank's collectives wait on "
                       "(comm_time in metrics.jsonl)")


def test_the_store_round_trip_is_the_median_of_the_last_three_beats(monkeypatch):
    monkeypatch.setattr(heartbeat._place, "round_trips", heartbeat.deque(maxlen=3))
    trips = heartbeat._place.round_trips
    trips.append(0.3)
    assert heartbeat.store_round_trip() == 0.0  # one beat is not enough
    trips.append(0.001)
    assert heartbeat.store_round_trip() == 0.001  # nor one slow beat
    trips.extend([0.002, 0.05])
    assert heartbeat.store_round_trip() == 0.002
    trips.append(0.06)
    assert heartbeat.store_round_trip() == 0.05  # two slow beats of the last three


def test_the_warning_comes_once_after_enough_lines_and_steps_and_clears():
    watch = StragglerWatch(HOSTS)
    slow = [_interval(comm=0.052), _interval(data=0.051), _interval(comm=0.052)]
    even = [_interval(), _interval(), _interval()]
    assert watch.update(slow) == []  # one line is not enough
    assert watch.update(even) == []  # nor a spike that went
    assert watch.update(slow) == []
    [(level, message)] = watch.update(slow)
    assert level == "warning"
    assert message == ("straggler: rank 1 (host node-b) is the slowest in data loading for the "
                       "last 20 steps: 51.0 times the median of the other ranks (0.0510 s "
                       "against 0.0010 s an iteration); the other ranks wait for it "
                       "(data_time_max_rank in metrics.jsonl)")
    assert watch.update(slow) == [] and watch.update(slow) == []  # said once
    assert watch.update(even) == []
    [(level, message)] = watch.update(even)
    assert (level, message) == ("info", "rank 1 (host node-b) no longer holds the others up "
                                        "in data loading")
    # another straggler is named in its turn
    other = [_interval(compute=0.05), _interval(comm=0.04), _interval(comm=0.04)]
    watch.update(other)
    assert "rank 0 (host node-a) is the slowest in compute" in watch.update(other)[0][1]


def test_lines_of_few_steps_wait_for_enough_steps():
    watch = StragglerWatch(HOSTS[:2])
    slow = [_interval(comm=0.05, steps=1), _interval(data=0.05, steps=1)]
    said = [watch.update(slow) for _ in range(20)]
    assert [i for i, lines in enumerate(said) if lines] == [9]  # on the 10th step's line


class SlowOnOneRank(ToyRegression):
    """``ToyRegression`` whose items take ``seconds`` each to load on rank ``slow_rank``."""

    def __init__(self, slow_rank: int = 1, seconds: float = 0.005, **kwargs):
        super().__init__(**kwargs)
        self.seconds = seconds if dist.get_rank() == slow_rank else 0.0

    def __getitem__(self, index: int):
        if self.seconds:
            time.sleep(self.seconds)
        return super().__getitem__(index)


class SlowModelOnOneRank(ToyModel):
    """``ToyModel`` whose training forward takes ``seconds`` more on rank ``slow_rank``."""

    def __init__(self, slow_rank: int = 1, seconds: float = 0.02, **kwargs):
        super().__init__(**kwargs)
        self.seconds = seconds if dist.get_rank() == slow_rank else 0.0

    def forward(self, batch, mode="loss"):
        if self.seconds and mode == "loss":
            time.sleep(self.seconds)
        return super().forward(batch, mode)


def _slow_body(work_dir, data="tests.runner.test_stragglers.SlowOnOneRank",
               model="tests.runner.toy.ToyModel"):
    runner = Runner(
        model={"type": model}, work_dir=work_dir,
        train_dataloader={"type": data, "size": 256, "batch_size": 4},
        optim={"type": "SGD", "lr": 0.01}, strategy="ddp", schedule={"max_iters": 30},
        logging={"interval": 5, "backends": ["console", "jsonl"]},
        checkpoint={"interval": 0},
    )
    runner.train()
    runner.close()
    return socket.gethostname()


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_with_slow_data_is_named_with_its_host_and_phase(run_on, tmp_path, world_size):
    hosts = run_on(world_size)(_slow_body, str(tmp_path))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "mode" not in r]
    assert [r["step"] for r in train] == [5, 10, 15, 20, 25, 30]
    for record in train:
        assert record["data_time_max_rank"] == 1
        assert record["data_time_max"] > 0.015  # 4 items of 5 ms
        assert record["data_time"] < record["data_time_max"]  # rank 0's own
        assert record["comm_time_max_rank"] != 1  # the others wait for it
        assert {"compute_time_max", "compute_time_max_rank", "comm_time_max"} <= set(record)
        assert record["data_time"] + record["compute_time"] + record["comm_time"] \
            == pytest.approx(record["time"])
    log = (tmp_path / "train.log").read_text()
    warnings = re.findall(r"WARNING straggler: .*", log)
    assert len(warnings) == 1, log  # said once
    assert re.fullmatch(
        rf"WARNING straggler: rank 1 \(host {re.escape(hosts[1])}\) is the slowest in data "
        r"loading for the last (\d+) steps: \d+\.\d times the median of the other ranks "
        r"\(\d\.\d{4} s against \d\.\d{4} s an iteration\); the other ranks wait for it "
        r"\(data_time_max_rank in metrics\.jsonl\)", warnings[0]), warnings[0]
    # named within a few logged lines: by the 4th line (step 20)
    lines = log.splitlines()
    named = next(i for i, line in enumerate(lines) if "straggler" in line)
    assert sum("step " in line and "/30" in line for line in lines[:named]) <= 4


def test_a_rank_with_slow_compute_is_named_in_compute_not_the_ranks_that_wait(run_on, tmp_path):
    """The others' wait for it is in comm_time (at the end of backward), not in compute."""
    hosts = run_on(2)(_slow_body, str(tmp_path), "tests.runner.toy.ToyRegression",
                      "tests.runner.test_stragglers.SlowModelOnOneRank")
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for record in (r for r in records if "mode" not in r):
        assert record["compute_time_max_rank"] == 1 and record["comm_time_max_rank"] == 0
        assert record["compute_time_max"] > 0.02 > record["compute_time"]  # rank 0's own
        assert record["comm_time"] > 0.015  # rank 0 waits for rank 1
    log = (tmp_path / "train.log").read_text()
    assert re.search(rf"WARNING straggler: rank 1 \(host {re.escape(hosts[1])}\) is the "
                     r"slowest in compute for the last \d+ steps", log), log


def test_a_healthy_small_runs_differences_name_no_one_under_the_floor():
    """A 2-process CPU run of a 4,353-parameter model: rank 0's data loading 2.4 times the
    other's, and a tenth of its 4 ms iteration longer, but by 0.7 ms: under the floor (10 ms
    by default, ``logging.straggler_floor``), no one is named; with a floor of 0 it was."""
    ranks = [_interval(data=0.0012, compute=0.002, comm=0.0008),
             _interval(data=0.0005, compute=0.002, comm=0.0015)]
    assert standout(ranks) is None
    assert standout(ranks, floor=0.0)[:2] == (0, 0)
    watch = StragglerWatch(HOSTS[:2])
    assert [watch.update(ranks) for _ in range(5)] == [[]] * 5
    named = StragglerWatch(HOSTS[:2], floor=0.0)
    assert any(named.update(ranks) for _ in range(5))
