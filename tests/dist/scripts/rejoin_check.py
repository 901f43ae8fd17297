"""Join the default group, use it and leave it, three times in one process (as two Runners
one after the other do); print one JSON line per rank: what each group's all_reduce gave.

    python rejoin_check.py dist          # init_dist / all_reduce / leave_dist, three times
    python rejoin_check.py runner WORKDIR  # Runner.from_cfg(...).train(), twice

Started under torchrun (its agent serves the store every group shares) or given torchrun's
variables by hand (rank 0 serves it).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from trainrun import dist


def joins() -> list[float]:
    sums = []
    for _ in range(3):
        dist.init_dist("pytorch", "gloo", timeout=20)
        value = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(value, op="sum")
        sums.append(value.item())
        dist.leave_dist()
    return sums


def runners(work_dir: str) -> list[float]:
    from trainrun.runner.config import load_config
    from trainrun.runner.runner import Runner

    ends = []
    config = os.path.join(os.path.dirname(__file__), "..", "..", "..", "configs",
                          "digits_ddp.yaml")
    for run in (1, 2):
        cfg = load_config(config, ["launcher=pytorch", "backend=gloo", "dist_timeout=20",
                                   f"work_dir={work_dir}/run{run}", "schedule.max_epochs=1"])
        with Runner.from_cfg(cfg) as runner:
            runner.train()
            ends.append(runner.iter)
    return ends


if __name__ == "__main__":
    began = time.monotonic()
    found = joins() if sys.argv[1] == "dist" else runners(sys.argv[2])
    report = {"rank": int(os.environ["RANK"]), "found": found, "seconds": time.monotonic() - began}
    # one write call: the ranks share stdout, and print() may write the line and its newline
    # apart, so another rank's line can land between them
    os.write(sys.stdout.fileno(), (json.dumps(report) + "\n").encode())
