"""What `compile: true` costs and gains: the shipped digits (ddp) and tiny-LM (fsdp, each block
compiled) configs, uncompiled and compiled, in the same job.

Run under ``torchrun --nproc_per_node 2`` with one thread per rank (``bench/run_compile.sh``
does, with an empty inductor cache, so the first compiled step pays the whole compile). For
each config, one uncompiled then one compiled run of ``--steps`` steps (no validation, no
checkpoints but the last); a hook takes the time at the end of every step. Printed (rank 0):
the first step's seconds (the compile happens there, and again where a graph's guards fail,
e.g. the smaller last batch of an epoch), the median seconds of the steps after ``--warmup``,
the ratio compiled/uncompiled of each, the largest loss difference between the two runs and
the first step where it exceeds 1e-5 (a compiled kernel sums in another order: the difference
of the last bits grows as training goes on).
The times are rank 0's; on a shared 2-core machine they vary by several
percent between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from trainrun.dist import init_dist, leave_dist
from trainrun.runner import Runner
from trainrun.runner.config import load_config
from trainrun.runner.hooks import Hook
from trainrun.runner.run_dir import RunDir

CONFIGS = {"digits (ddp)": "configs/digits_ddp.yaml",
           "tiny-LM (fsdp, per block)": "configs/tinylm_fsdp.yaml"}


RANK = int(os.environ.get("RANK", "0"))  # torchrun's (the runner leaves its group when done)


class StepClock(Hook):
    """The time at the start of training and at the end of every step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def before_train(self, runner: Any) -> None:
        self.times = [time.perf_counter()]

    def after_train_iter(self, runner: Any, batch_idx: int, batch: Any, outputs: Any) -> None:
        self.times.append(time.perf_counter())


def one_run(config: str, compile_: bool, steps: int, work_dir: Path) -> tuple[list[float],
                                                                           list[float]]:
    """Seconds of each step, and the logged losses."""
    cfg = load_config(config, [f"schedule.max_iters={steps}", "schedule.val_interval=1000000",
                               "data.val=null", "logging.interval=1",
                               "logging.backends=[jsonl]", f"compile={str(compile_).lower()}",
                               f"work_dir={work_dir}", "checkpoint.interval=1000000"])
    clock = StepClock()
    with Runner.from_cfg(cfg) as runner:
        runner.hooks.append(clock)
        runner.train()
    seconds = [b - a for a, b in zip(clock.times, clock.times[1:], strict=False)]
    lines = RunDir(work_dir).metrics.read_text().splitlines() if RANK == 0 else []
    return seconds, [r["loss"] for r in map(json.loads, lines) if "loss" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--work-dir", required=True,
                        help="an empty directory for the runs (run_compile.sh makes one)")
    args = parser.parse_args()
    root = Path(args.work_dir)
    init_dist("pytorch", "gloo")  # one group for all runs: a runner joins none of its own
    try:
        compare(root, args.steps, args.warmup)
    finally:
        leave_dist()


def compare(root: Path, steps: int, warmup: int) -> None:
    """Each config uncompiled, then compiled; rank 0 prints the comparison."""
    for label, config in CONFIGS.items():
        runs = {flag: one_run(config, flag, steps, root / f"{label[:6]}-{flag}")
                for flag in (False, True)}
        if RANK != 0:
            continue
        (plain, plain_losses), (compiled, compiled_losses) = runs[False], runs[True]
        first = compiled[0] / plain[0]
        plain_step = statistics.median(plain[warmup:])
        compiled_step = statistics.median(compiled[warmup:])
        gaps = [abs(a - b) for a, b in zip(plain_losses, compiled_losses, strict=True)]
        apart = next((step for step, gap in enumerate(gaps, 1) if gap > 1e-5), None)
        print(f"{label}: first step {plain[0]:.2f} s -> {compiled[0]:.2f} s compiled "
              f"({first:.1f}x); median step after {warmup}: {plain_step * 1e3:.2f} ms "
              f"-> {compiled_step * 1e3:.2f} ms (compiled/uncompiled "
              f"{compiled_step / plain_step:.2f}); "
              f"losses: largest difference {max(gaps):.1e}, "
              f"{f'first above 1e-5 at step {apart}' if apart else 'all within 1e-5'}",
              flush=True)


if __name__ == "__main__":
    main()
