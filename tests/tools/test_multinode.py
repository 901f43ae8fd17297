"""Two nodes on one machine: two network namespaces joined by a veth pair, each with its own
address, and ``torchrun --nnodes 2 --nproc_per_node 2`` in each, meeting through c10d
rendezvous on the first node's address. The job trains across both, and every rank's place
follows torchrun's numbering (global rank = node rank x processes per node + local rank)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import free_port
from tests.tools.test_train_cli import CONFIG, TRAIN, env, train_records
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


@pytest.mark.slow
def test_torchrun_across_two_namespaces_numbers_ranks_by_node_and_trains(two_nodes, tmp_path):
    reports, work_dir = tmp_path / "places", tmp_path / "run"
    reports.mkdir()
    endpoint = f"{two_nodes[0][2]}:{free_port()}"
    jobs = []
    for index, (name, interface, address) in enumerate(two_nodes):
        # the first node hosts the rendezvous: torchrun cannot tell from the hostname, which
        # both namespaces share (as it cannot on a cluster whose nodes name themselves alike)
        cmd = ["ip", "netns", "exec", name, sys.executable, "-m", "torch.distributed.run",
               "--nnodes", "2", "--nproc_per_node", str(NPROC), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", endpoint, "--rdzv-id", "two-nodes", "--local-addr", address,
               "--rdzv-conf", f"is_host={int(index == 0)}",
               str(TRAIN), str(CONFIG), "--launcher", "pytorch", "--work-dir", str(work_dir),
               "--cfg-options", "schedule.max_epochs=2", "logging.interval=4",
               "model.type=tests.tools.test_multinode.PlaceReportingMLP",
               f"model.report_dir={reports}"]
        jobs.append(subprocess.Popen(cmd, env={**env(), "GLOO_SOCKET_IFNAME": interface},
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
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
