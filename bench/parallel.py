"""Tensor and pipeline parallelism against plain fsdp on the same ranks: time per step and
peak memory, by model width.

    python bench/parallel.py [--ranks 4] [--widths 128 512 1024] [--steps 10]
                             [--microbatches 4]

For each width, N gloo processes (spawned here, one thread each) train the shipped tinylm
config (``configs/tinylm_fsdp.yaml``: a shard unit per block, activation checkpointing) for
``--steps`` steps through the Runner, three times: plain fsdp over all N ranks; fsdp with
``strategy.tp=2`` (N/2 data-parallel ranks, each pair splitting every block); and fsdp with
``strategy.pp=2`` (N/2 data-parallel ranks, each pair a pipeline of two stages of one block,
running each batch in ``--microbatches``). All see the same global batch (``--batch`` blocks
of 64 characters per data-parallel rank under fsdp, twice that per rank under tp and pp), so
their losses agree and only the work differs.

Printed per width: the median seconds per step of rank 0 (the first two steps left out) and the
largest peak memory of any rank, as the run logs it (on the CPU, the process's peak resident
set, which includes torch itself, about 300 MiB), each as a ratio to fsdp's. Ratios below 1
mean the layout pays off. The parameters, gradients and optimiser state each rank holds are
checked against the memory plan by ``bench/memory_plan.py --cases 'fsdp tp=2'`` and by
tests/wrappers/test_pipeline.py for pp.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from gloo_ranks import run_on_ranks

from trainrun.runner.config import load_config
from trainrun.runner.run_dir import RunDir
from trainrun.runner.runner import Runner

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tinylm_fsdp.yaml"
RUN = ["data.val=null", "checkpoint.interval=0", "checkpoint.save_last=false",
       "logging.interval=1", "logging.backends=[jsonl]", "launcher=pytorch"]


# the layouts, each against fsdp: its options, given the microbatches
LAYOUTS = {"fsdp": lambda micro: [],
           "tp=2": lambda micro: ["strategy.tp=2"],
           "pp=2": lambda micro: ["strategy.pp=2", f"strategy.pp_microbatches={micro}"]}


def _options(width: int, layout: str, batch: int, steps: int, micro: int,
             work_dir: str) -> list[str]:
    peers = 1 if layout == "fsdp" else 2  # ranks that share a batch
    return [*RUN, f"model.n_embd={width}", "model.n_head=8", *LAYOUTS[layout](micro),
            f"data.train.batch_size={batch * peers}", f"schedule.max_iters={steps}",
            f"work_dir={work_dir}"]


def _train(width: int, layout: str, batch: int, steps: int, micro: int,
           work_dir: str) -> dict[str, Any]:
    """On one rank: train; rank 0's step times, losses and the peak memory of the rank that
    held most (rank 0 logs it); empty on the other ranks."""
    cfg = load_config(str(CONFIG), _options(width, layout, batch, steps, micro, work_dir))
    with Runner.from_cfg(cfg) as runner:
        runner.train()
        rank = runner.rank
    lines = []
    if rank == 0:
        lines = [json.loads(line) for line in RunDir(work_dir).metrics.open()]
    return {"times": [line["time"] for line in lines if "loss" in line][2:],
            "losses": [line["loss"] for line in lines if "loss" in line],
            "peak_mb": max((line.get("peak_memory_mb", 0) for line in lines), default=0)}


def _all_widths(widths: list[int], batch: int, steps: int, micro: int, root: str) -> dict:
    rank = torch.distributed.get_rank()
    return {(width, layout): _train(width, layout, batch, steps, micro,
                                    f"{root}/w{width}-{layout}-{rank}")
            for width in widths for layout in LAYOUTS}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4, help="processes (even)")
    parser.add_argument("--widths", type=int, nargs="+", default=[128, 512, 1024],
                        help="model.n_embd values (8 heads; 2 blocks)")
    parser.add_argument("--batch", type=int, default=8,
                        help="blocks per data-parallel rank under fsdp")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--microbatches", type=int, default=4,
                        help="strategy.pp_microbatches under pp=2 (at least 2)")
    args = parser.parse_args()
    if args.ranks % 2:
        parser.error(f"--ranks: tp=2 and pp=2 need an even number of ranks; got {args.ranks}")
    if args.microbatches < 2 or (2 * args.batch) % args.microbatches:
        parser.error(f"--microbatches: at least 2, dividing a pipeline's batch of "
                     f"{2 * args.batch}; got {args.microbatches}")
    with tempfile.TemporaryDirectory() as root:
        per_rank = run_on_ranks(args.ranks, _all_widths, args.widths, args.batch, args.steps,
                                args.microbatches, root)
    print(f"\n{args.ranks} gloo ranks, one thread each; torch {torch.__version__}; tinylm, "
          f"2 blocks, 8 heads; global batch {args.batch * args.ranks} blocks of 64; "
          f"{args.steps} steps; pp=2 in {args.microbatches} microbatches (1f1b)\n")
    print("| n_embd | layout | s/step | time / fsdp | peak MiB | memory / fsdp | "
          "losses agree with fsdp within |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for width in args.widths:
        fsdp = per_rank[0][(width, "fsdp")]
        base_time = statistics.median(fsdp["times"])
        for layout in LAYOUTS:
            run = per_rank[0][(width, layout)]
            time = statistics.median(run["times"])
            agree = max(abs(a - b) / abs(b)
                        for a, b in zip(run["losses"], fsdp["losses"], strict=True))
            print(f"| {width} | {layout} | {time:.3f} | {time / base_time:.2f} | "
                  f"{run['peak_mb']:.0f} | {run['peak_mb'] / fsdp['peak_mb']:.2f} | "
                  f"{agree:.0e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
