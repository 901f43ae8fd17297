"""Join a job through `trainrun.dist.init_dist` and print, per rank, one JSON line of what it saw.

Run by tests/dist/test_launchers.py under torchrun, mpirun and srun:

    python launch_check.py LAUNCHER [check | timeout DONE_FILE]

check    all_reduce, all_gather_object and a local group, plus the exported variables; then
         `check_ranks` with a world size that rank 1 gets wrong, whose error each rank reports;
         then `leave_dist`, after which no group, the local one included, is left.
timeout  rank 1 calls all_reduce alone (timeout 3 s), reports the error it got and creates
         DONE_FILE; rank 0 stays alive until then (had it exited, rank 1 would see a closed
         connection instead of a timeout).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist

import trainrun.dist as dist
from trainrun.dist.launch import check_ranks

EXPORTED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LAUNCHER_VARS = ("SLURM_PROCID", "SLURM_JOB_ID", "OMPI_COMM_WORLD_RANK")
TIMEOUT_S = 3


def check() -> dict[str, Any]:
    """Run one of each kind of collective and report what every query answers."""
    rank, world_size = dist.get_dist_info()
    summed = torch.tensor([rank + 1])
    dist.all_reduce(summed)
    gathered = dist.all_gather_object({"rank": rank, "host": socket.gethostname()})
    env_before_group = (dist.get_local_rank(), dist.get_local_size())
    dist.init_local_group(node_rank=0, num_gpus_per_node=world_size)
    return {
        "sum": int(summed.item()),
        "gathered": gathered,
        "local_from_env": list(env_before_group),
        "local_from_group": [dist.get_local_rank(), dist.get_local_size()],
        "local_group_size": torch_dist.get_world_size(dist.get_local_group()),
        "rank_check": rank_check(),
    }


def timeout(done_file: str) -> dict[str, Any]:
    """Rank 1 waits in all_reduce for a rank 0 that never joins it."""
    done = Path(done_file)
    if dist.get_rank() == 0:
        deadline = time.monotonic() + 10 * TIMEOUT_S
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        return {}
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
        report = {"error": None}
    except Exception as exc:  # reported, so the test can say what was raised instead
        report = {"error": type(exc).__name__, "message": str(exc)}
    done.touch()
    return {**report, "elapsed": time.monotonic() - start}


def rank_check() -> dict[str, Any]:
    """Every rank must refuse a group in which rank 1 was told a different world size.

    (Real launchers cannot produce such a group: their rendezvous fails first.)
    """
    rank, world_size = dist.get_dist_info()
    try:
        check_ranks(world_size + rank)
    except dist.DistInitError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


MODES = {"check": check, "timeout": timeout}


def main(launcher: str, mode: str = "check", *args: str) -> None:
    inferred = dist.infer_launcher()  # before init_dist exports torchrun's variables
    dist.init_dist(launcher, "gloo", timeout=TIMEOUT_S if mode == "timeout" else 60)
    report = {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "local_rank": dist.get_local_rank(),
        "local_size": dist.get_local_size(),
        "host": socket.gethostname(),
        "inferred": inferred,
        "env": {name: os.environ.get(name) for name in EXPORTED + LAUNCHER_VARS},
        **MODES[mode](*args),
    }
    if mode != "timeout":
        dist.leave_dist()
        report["left"] = not dist.is_distributed() and dist.get_local_group() is None
    # one write call: the ranks share stdout, and a pipe keeps writes under 4 KiB whole
    os.write(sys.stdout.fileno(), (json.dumps(report) + "\n").encode())
    if mode == "timeout":
        # after a timeout the group is broken and cannot be left; the interpreter's shutdown
        # would tear down gloo's threads with the timed-out send still queued, which aborts
        # the process now and then ('terminate called without an active exception', exit -6,
        # seen once in CI): end here instead, the report written
        os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
