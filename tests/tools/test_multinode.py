"""Two nodes on one machine: two network namespaces joined by a veth pair, each with its own
address, and ``torchrun --nnodes 2 --nproc_per_node 2`` in each, meeting through c10d
rendezvous on the first node's address. The job trains across both, and every rank's place
follows torchrun's numbering (global rank = node rank x processes per node + local rank)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli import CONFIG, TRAIN, env
from tests.records import train_records
from trainrun.cli.processes import alive, descendants
from trainrun.dist.launch import free_port
from trainrun.examples.digits import DigitsMLP

NPROC = 2
SUBNET = "10.231.{}.{}"


class PlaceReportingMLP(DigitsMLP):
    """The digits model, writing where its process runs (ranks, node, network namespace) to
    ``report_dir`` when it is built."""

    def __init__(self, report_dir: str, **kwargs):
        super().__init__(**kwargs)
        import trainrun.dist as dist

        place = {name: int(os.environ[name]) for name in ("RANK", "LOCAL_RANK", "GROUP_RANK",
                                                          "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
        place.update(rank=dist.get_rank(), local_rank=dist.get_local_rank(),
                     local_size=dist.get_local_size(), netns=os.readlink("/proc/self/ns/net"))
        Path(report_dir, f"rank{place['RANK']}.json").write_text(json.dumps(place))


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_nodes():
    """Two network namespaces joined by a veth pair: [(namespace, interface, address)] x 2."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = f"{os.getpid() % 100000}"
    octet = os.getpid() % 250 + 1
    nodes = [(f"trainrun{tag}n{i}", f"trv{tag}n{i}", SUBNET.format(octet, i + 1))
             for i in range(2)]
    made: list[str] = []
    try:
        for name, _, _ in nodes:
            done = _ip("netns", "add", name)
            if done.returncode != 0:
                pytest.skip(f"this machine refuses network namespaces: {done.stderr.strip()}")
            made.append(name)
        (ns0, if0, _), (ns1, if1, _) = nodes
        steps = [("link", "add", if0, "type", "veth", "peer", "name", if1),
                 ("link", "set", if0, "netns", ns0), ("link", "set", if1, "netns", ns1)]
        for name, interface, address in nodes:
            steps += [("-n", name, "addr", "add", f"{address}/24", "dev", interface),
                      ("-n", name, "link", "set", interface, "up"),
                      ("-n", name, "link", "set", "lo", "up")]
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                pytest.skip(f"cannot wire the namespaces (ip {' '.join(step)}): "
                            f"{done.stderr.strip()}")
        yield nodes
    finally:
        for name in made:
            _ip("netns", "delete", name)  # takes its end of the veth pair, and so both


def _start_nodes(nodes, work_dir: Path, options: list[str], resume: bool = False,
                 logs: Path | None = None):
    """``torchrun --nnodes 2`` in each namespace of ``nodes``, training the digits config
    into ``work_dir`` with ``options``; the first node hosts the rendezvous (torchrun cannot
    tell from the hostname, which both namespaces share, as it cannot on a cluster whose
    nodes name themselves alike). Each node's output comes through pipes, or goes to
    ``logs/node<i>.out`` and ``.err`` (a test that polls the processes reads no pipe)."""
    endpoint = f"{nodes[0][2]}:{free_port()}"
    jobs = []
    for index, (name, interface, address) in enumerate(nodes):
        cmd = ["ip", "netns", "exec", name, sys.executable, "-m", "torch.distributed.run",
               "--nnodes", "2", "--nproc_per_node", str(NPROC), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", endpoint, "--rdzv-id", "trainrun", "--local-addr", address,
               "--rdzv-conf", f"is_host={int(index == 0)}",
               str(TRAIN), str(CONFIG), "--launcher", "pytorch", "--work-dir", str(work_dir),
               *(["--resume"] if resume else []), "--cfg-options", *options]
        out = err = subprocess.PIPE
        if logs is not None:
            out, err = (open(logs / f"node{index}.{kind}", "w") for kind in ("out", "err"))
        jobs.append(subprocess.Popen(cmd, env={**env(), "GLOO_SOCKET_IFNAME": interface},
                                     stdout=out, stderr=err, text=True,
                                     start_new_session=True))
        if logs is not None:
            out.close()
            err.close()
    return jobs


@pytest.mark.slow
def test_torchrun_across_two_namespaces_numbers_ranks_by_node_and_trains(two_nodes, tmp_path):
    reports, work_dir = tmp_path / "places", tmp_path / "run"
    reports.mkdir()
    jobs = _start_nodes(two_nodes, work_dir, [
        "schedule.max_epochs=2", "logging.interval=4",
        "model.type=tests.tools.test_multinode.PlaceReportingMLP", f"model.report_dir={reports}"])
    outputs = [job.communicate(timeout=180) for job in jobs]
    for job, (_, err) in zip(jobs, outputs, strict=True):
        assert job.returncode == 0, err[-3000:]

    places = [json.loads(p.read_text()) for p in sorted(reports.glob("rank*.json"))]
    assert sorted(p["RANK"] for p in places) == list(range(2 * NPROC))
    for place in places:
        assert place["WORLD_SIZE"] == 2 * NPROC and place["LOCAL_WORLD_SIZE"] == NPROC
        assert place["RANK"] == place["GROUP_RANK"] * NPROC + place["LOCAL_RANK"]
        assert (place["rank"], place["local_rank"], place["local_size"]) == \
            (place["RANK"], place["LOCAL_RANK"], NPROC)
    by_node = {}
    for place in places:
        by_node.setdefault(place["GROUP_RANK"], set()).add(place["netns"])
    assert sorted(by_node) == [0, 1]
    assert all(len(spaces) == 1 for spaces in by_node.values())  # a node is one namespace
    assert by_node[0] != by_node[1]  # and the two nodes are two

    # 1258 training images dealt to 4 ranks (315 each) in batches of 32: 10 steps an epoch
    assert [r["step"] for r in train_records(work_dir)] == [4, 8, 12, 16, 20]
    assert (work_dir / "checkpoints" / "last").read_text().strip() == "epoch_2.pth"


# ---------------------------------------------------------------- a network partition

def _cut(nodes, cut: bool) -> None:
    """Drop every packet either node sends to the other (a queue of length 0 on both ends of
    the link), or let them through again: a partition, silent as a cut cable far away."""
    for name, interface, _ in nodes:
        args = ("replace", "dev", interface, "root", "pfifo", "limit", "0") if cut else \
            ("del", "dev", interface, "root")
        done = subprocess.run(["tc", "-n", name, "qdisc", *args], capture_output=True, text=True,
                              timeout=30)
        if cut and done.returncode != 0:
            pytest.skip(f"cannot drop packets with tc here: {done.stderr.strip()}")


@pytest.mark.slow
def test_a_partition_ends_both_sides_and_resume_continues_exactly(two_nodes, tmp_path):
    """The link between the nodes cut mid-run: the node hosting the store names the silent
    ranks, the other one, cut off from the store, says so; both end within dist_timeout and a
    few seconds, nothing left running. With the link back, --resume on both nodes continues
    from the newest checkpoint with the losses the first run logged after it."""
    work_dir, timeout = tmp_path / "run", 10
    # find_unused_parameters: DDP keeps its gradient buckets as built, so that 4 ranks resume
    # bit for bit (re-arranged after DDP's first step, they sum the resumed run's first step
    # in another order: docs/checkpoints.md, "What makes a resume exact")
    options = ["schedule.max_epochs=null", "schedule.max_iters=200", "checkpoint.interval=10",
               "logging.interval=1", "schedule.val_interval=1000",
               "model.type=tests.tools.models.SlowDigitsMLP", "model.step_seconds=0.05",
               "strategy.find_unused_parameters=true", f"dist_timeout={timeout}"]
    jobs = _start_nodes(two_nodes, work_dir, options)
    workers: list[int] = []
    try:
        # (metrics.jsonl can exist before its first training line is in)
        while not (work_dir / "metrics.jsonl").exists() or \
                max((r["step"] for r in train_records(work_dir)), default=0) < 27:
            assert all(job.poll() is None for job in jobs), "a node ended before step 27"
            time.sleep(0.02)
        workers = [pid for job in jobs for pid in descendants(job.pid)
                   if "train.py" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")]
        _cut(two_nodes, True)
        cut = time.monotonic()
        ended = []
        for job in jobs:
            _, err = job.communicate(timeout=timeout + 120)
            ended.append((time.monotonic() - cut, job.returncode, err))
    finally:
        _cut(two_nodes, False)
        for job in jobs:
            if job.poll() is None:
                os.killpg(job.pid, 9)
    assert len(workers) == 2 * NPROC
    assert not [pid for pid in workers if alive(pid)], "workers left running after the cut"
    (seconds0, code0, err0), (seconds1, code1, err1) = ended
    assert code0 != 0 and code1 != 0
    assert max(seconds0, seconds1) < timeout + 60, (seconds0, seconds1)
    # the store's side names the ranks it lost; the other side says it lost the store
    assert re.search(r"stopping every rank: rank 2 silent for \d+ s, last seen at step \d+ "
                     r"in [^;]+; rank 3 silent", err0), err0[-3000:]
    # (said by the heartbeat's guard, or by the main thread when its collective timed out
    # first, which then finds the store gone too)
    cut_off = re.findall(rf"rank [23]: stopping: (?:no answer from|lost contact with the other "
                         rf"ranks \([^)]*\) and with) the job's store at {two_nodes[0][2]}:\d+.*"
                         rf"; --resume continues from it", err1)
    assert cut_off, err1[-3000:]
    first = {r["step"]: r["loss"] for r in train_records(work_dir)}
    saved = int((work_dir / "checkpoints" / "last").read_text().strip()[5:-4])
    assert saved >= 20 and max(first) > saved  # steps after the checkpoint to compare

    options[1] = "schedule.max_iters=40"
    jobs = _start_nodes(two_nodes, work_dir, options, resume=True)
    for job in jobs:
        _, err = job.communicate(timeout=180)
        assert job.returncode == 0, err[-3000:]
    assert f"resumed from {work_dir / 'checkpoints' / f'iter_{saved}.pth'}" in \
        (work_dir / "train.log").read_text()
    records = train_records(work_dir)  # the first job's steps after the checkpoint taken out
    assert [r["step"] for r in records] == list(range(1, 41))
    assert all(r["loss"] == first[r["step"]] for r in records if r["step"] in first)


# ---------------------------------------------------------------- torchrun's agents after a cut

def _link_down(nodes) -> None:
    """Take the second node's end of the link down (its cable pulled, its switch port dead):
    that node loses its route to the first, which hosts the rendezvous store."""
    name, interface, _ = nodes[1]
    done = _ip("-n", name, "link", "set", interface, "down")
    if done.returncode != 0:
        pytest.skip(f"cannot take the link down here: {done.stderr.strip()}")


@pytest.mark.slow
@pytest.mark.parametrize("cut", ["link down", "packets dropped"])
def test_a_cut_ends_the_torchrun_agent_on_each_side(two_nodes, tmp_path, cut):
    """Cut mid-run, both kinds: each node's torchrun process (its agent) ends non-zero within
    dist_timeout + 60 s of the cut, nothing left running, each side saying why. With the link
    down, the agent cut off from the rendezvous store blocks in a store call for minutes
    (measured: over 200 s): its workers end it as they stop for the silent store."""
    work_dir, logs, timeout = tmp_path / "run", tmp_path / "logs", 10
    logs.mkdir()
    options = ["schedule.max_epochs=null", "schedule.max_iters=5000", "checkpoint.interval=10",
               "logging.interval=1", "schedule.val_interval=100000",
               "model.type=tests.tools.models.SlowDigitsMLP", "model.step_seconds=0.05",
               f"dist_timeout={timeout}"]
    jobs = _start_nodes(two_nodes, work_dir, options, logs=logs)
    ended: dict[int, tuple[float, int]] = {}
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while not (work_dir / "metrics.jsonl").exists() or \
                max((r["step"] for r in train_records(work_dir)), default=0) < 12:
            assert all(job.poll() is None for job in jobs), "a node ended before step 12"
            assert time.monotonic() < deadline, "no step 12 in 180 s"
            time.sleep(0.05)
        workers = [pid for job in jobs for pid in descendants(job.pid)
                   if "train.py" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")]
        if cut == "link down":
            _link_down(two_nodes)
        else:
            _cut(two_nodes, True)
        started = time.monotonic()
        before = max(r["step"] for r in train_records(work_dir))
        while len(ended) < len(jobs) and time.monotonic() - started < timeout + 60:
            for index, job in enumerate(jobs):
                if index not in ended and job.poll() is not None:
                    ended[index] = (time.monotonic() - started, job.returncode)
            time.sleep(0.1)
    finally:
        for job in jobs:
            if job.poll() is None:
                os.killpg(job.pid, 9)
        for pid in workers:  # (in sessions of their own: not in the agent's group)
            if alive(pid):
                os.kill(pid, 9)
    errs = [(logs / f"node{index}.err").read_text() for index in range(len(jobs))]
    assert sorted(ended) == [0, 1], f"torchrun still running {timeout + 60} s after the cut: " \
        f"{sorted(set(range(len(jobs))) - set(ended))}\n{errs[1][-3000:]}"
    assert all(code != 0 for _, code in ended.values()), ended
    assert len(workers) == 2 * NPROC
    assert not [pid for pid in workers if alive(pid)], "workers left running after the cut"
    # the cut landed mid-run: training lines before it, the run far from its end after it
    steps = [r["step"] for r in train_records(work_dir)]
    assert 12 <= before <= max(steps) < 5000
    # the store's side names the ranks it lost; the other side says it lost the store
    assert re.search(r"stopping every rank: rank 2 silent for \d+ s, last seen at step \d+ "
                     r"in [^;]+; rank 3 silent", errs[0]), errs[0][-3000:]
    assert re.search(rf"rank [23]: stopping: (?:no answer from|lost contact with the other "
                     rf"ranks \([^)]*\) and with) the job's store at {two_nodes[0][2]}:\d+",
                     errs[1]), errs[1][-3000:]


# ---------------------------------------------------------------- a slow link to one node

# a slow link two ways: each of node 1's packets held back 50 ms (netem), or its sending
# rate limited (tbf); a kernel without the qdisc skips that one
SLOW_LINKS = {"delay": ("netem", "delay", "50ms"),
              "rate": ("tbf", "rate", "8mbit", "burst", "32kbit", "latency", "1s")}


@pytest.mark.slow
@pytest.mark.parametrize("shape", sorted(SLOW_LINKS))
def test_a_slow_link_to_one_node_slows_every_ranks_collectives_alike(two_nodes, tmp_path,
                                                                     shape):
    """A slow link to node 1 in the step metrics: in synchronous data parallelism every
    rank's gradient collectives wait on it alike, so every rank's comm_time grows and no rank
    is named in data loading or compute. Delayed, node 1's ranks also take 50 ms more for
    their heartbeat's round trip to the job's store (on node 0), and one of them is named in
    communication; rate-limited, the store's small requests pass as fast as the others'
    (measured: 0.1 to 0.2 ms on every rank), and no rank is named."""
    name, interface, _ = two_nodes[1]
    done = subprocess.run(["tc", "-n", name, "qdisc", "add", "dev", interface, "root",
                           *SLOW_LINKS[shape]], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"cannot shape the link with tc {SLOW_LINKS[shape][0]} here: "
                    f"{done.stderr.strip()}")
    work_dir = tmp_path / "run"
    jobs = _start_nodes(two_nodes, work_dir, [
        "schedule.max_epochs=null", "schedule.max_iters=30", "logging.interval=5",
        "schedule.val_interval=1000", "checkpoint.interval=1000"])
    outputs = [job.communicate(timeout=300) for job in jobs]
    for job, (_, err) in zip(jobs, outputs, strict=True):
        assert job.returncode == 0, err[-3000:]
    records = train_records(work_dir)
    assert [r["step"] for r in records] == [5, 10, 15, 20, 25, 30]
    for record in records:  # (measured with tbf: 0.12 s of a 0.127 s step on every rank)
        assert record["comm_time"] > 0.04, record  # a step without the link's: ~5 ms in all
        assert record["comm_time_max"] < 1.5 * record["comm_time"], record  # rank 0 as all
        assert record["compute_time_max"] < record["comm_time"], record
    log = (work_dir / "train.log").read_text()
    named = re.findall(r"WARNING straggler: rank (\d+) .* is the slowest in (.*?) for", log)
    if shape == "rate":
        assert named == [], log
    else:
        # a rank of node 1 (both of its ranks are as slow: either may be named, or both in
        # turn), and never one of node 0
        assert named and {(int(rank) // NPROC, phase) for rank, phase in named} \
            == {(1, "communication")}, log
        assert "its round trip to the job's store takes" in log, log
