"""The memory plan (``--dry-run``) against what N real gloo ranks hold, and beside DeepSpeed's
own estimate.

    python bench/memory_plan.py [--ranks 2 3 4] [--n-embd 256] [--n-layer 2] [--cases ...]

Measured: for each N, N gloo processes (spawned here, one thread each) train the tinylm config
(``configs/tinylm_ddp.yaml`` with ``--n-embd`` and ``--n-layer``) for 2 steps through the
Runner under ddp, fsdp (a shard unit per block; with tensor parallelism over 2 ranks, on the N
that 2 divides) and DeepSpeed ZeRO-1/2/3 (fp32; ZeRO-0/2/3 in bf16; offloads). Every rank
measures what it holds by kind (`Strategy.state_tensors`: parameters, gradients, optimiser
state; each storage counted once, by its data_ptr) just before and after each optimiser step
(`trainrun.runner.memory_watch.watch_memory`), and keeps each kind's peak.
The table sets the plan (`Strategy.memory_plan`, the most any rank holds) beside the rank that
held most, in MiB, and their ratio (plan / measured total); the bar is within 10 % for every
kind.

Extrapolated: the plan alone for a 7B-parameter tinylm (n_embd 4096, 34 layers) on 64 ranks,
with DeepSpeed's estimate (``estimate_zero2/3_model_states_mem_needs``, which assumes 16-bit
parameters with fp32 master copies) beside the bf16 rows. Exit status 1 when a ratio is off.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from gloo_ranks import run_on_ranks
from omegaconf import OmegaConf

from trainrun.runner.config import load_config
from trainrun.runner.memory_watch import watch_memory
from trainrun.runner.plan import build_meta_model, plan_memory
from trainrun.runner.runner import Runner
from trainrun.wrappers.memory import KINDS, StateBytes

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tinylm_ddp.yaml"
RUN = ["data.train.batch_size=4", "data.val=null", "schedule.max_iters=2",
       "checkpoint.interval=0", "checkpoint.save_last=false", "logging.interval=1",
       "logging.backends=[jsonl]", "launcher=pytorch", "optim.clip_grad=null"]
CASES = {
    "ddp": ["strategy.type=ddp"],
    "fsdp": ["strategy.type=fsdp", "strategy.wrap={classes: [Block]}"],
    "fsdp tp=2": ["strategy.type=fsdp", "strategy.wrap={classes: [Block]}", "strategy.tp=2"],
    "zero0 bf16": ["strategy.type=deepspeed", "strategy.zero_stage=0", "precision=bf16"],
    "zero1": ["strategy.type=deepspeed", "strategy.zero_stage=1"],
    "zero2": ["strategy.type=deepspeed", "strategy.zero_stage=2"],
    "zero3": ["strategy.type=deepspeed", "strategy.zero_stage=3"],
    "zero2 bf16": ["strategy.type=deepspeed", "strategy.zero_stage=2", "precision=bf16"],
    "zero3 bf16": ["strategy.type=deepspeed", "strategy.zero_stage=3", "precision=bf16"],
    # offloaded: on a CPU-only machine the CPU is the device too: the totals are compared
    "fsdp offload": ["strategy.type=fsdp", "strategy.wrap={classes: [Block]}",
                     "strategy.cpu_offload=true"],
    "zero2 offload": ["strategy.type=deepspeed", "strategy.zero_stage=2",
                      "strategy.offload_optimizer=true"],
    "zero3 offload": ["strategy.type=deepspeed", "strategy.zero_stage=3",
                      "strategy.offload_optimizer=true", "strategy.offload_param=true"],
}
SEVEN_B = ["model.n_embd=4096", "model.n_head=32", "model.n_layer=34", "model.block_size=2048"]
BAR = 0.10
MIB = 2 ** 20


def fits(case: str, world_size: int) -> bool:
    """Whether ``case`` runs on ``world_size`` ranks (its tp divides them)."""
    tp = next((int(o.split("=")[1]) for o in CASES[case] if o.startswith("strategy.tp=")), 1)
    return world_size % tp == 0


def _cfg(case: str, model: list[str], work_dir: str = "unused") -> Any:
    return load_config(str(CONFIG), [*RUN, *model, *CASES[case], f"work_dir={work_dir}"])


def _measure(case: str, model: list[str], work_dir: str) -> dict[str, int]:
    """On one rank: train 2 steps under ``case``; the peak bytes this rank held by kind."""
    with Runner.from_cfg(_cfg(case, model, work_dir)) as runner:
        watch = watch_memory(runner)
        runner.train()
        watch.close()
    return {kind: watch.peak.kind(kind) for kind in KINDS}


def _all_cases(model: list[str], root: str, cases: list[str]) -> dict[str, dict[str, int]]:
    rank = torch.distributed.get_rank()
    return {case: _measure(case, model, f"{root}/{case.replace(' ', '-')}-{rank}")
            for case in cases}


def planned(case: str, model: list[str], world_size: int) -> StateBytes | str:
    return plan_memory(OmegaConf.to_container(_cfg(case, model), resolve=True), world_size)


def deepspeed_estimate(case: str, model: list[str], world_size: int) -> float | None:
    """DeepSpeed's per-GPU estimate for a ZeRO case (its functions for a model's parameter
    count, one node of ``world_size`` GPUs; with offload, its GPU figure plus a GPU's share of
    its node's CPU figure, which includes its 1.5 buffer factor); None for the others."""
    if not case.startswith(("zero1", "zero2", "zero3")):
        return None
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    meta = build_meta_model(OmegaConf.to_container(_cfg(case, model), resolve=True))
    total = sum(p.numel() for p in meta.parameters())
    offload = case.endswith("offload")
    if case.startswith("zero3"):
        largest = max(sum(p.numel() for p in m.parameters(recurse=False))
                      for m in meta.modules())
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            total, largest, world_size, 1, cpu_offload=offload, cpu_offload_params=offload)
    else:
        cpu, gpu = estimate_zero2_model_states_mem_needs(total, world_size, 1,
                                                         cpu_offload=offload)
    return gpu + (cpu / world_size if offload else 0)  # its CPU figure is the node's


def _mib(nbytes: float) -> str:
    return f"{nbytes / MIB:.2f}"


def measured_table(results: dict[int, list[dict[str, dict[str, int]]]], model: list[str]
                   ) -> tuple[str, float]:
    """Plan / measured per kind (the rank holding most), the ratio of the totals, DeepSpeed's
    estimate; and the worst ratio of any kind, off 1."""
    lines = ["| N | strategy | params MiB plan / held | grads MiB plan / held | "
             "optim MiB plan / held | total MiB plan / held | ratio | DeepSpeed's estimate MiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    worst = 0.0
    for n, per_rank in sorted(results.items()):
        for case in per_rank[0]:
            plan = planned(case, model, n)
            held = {kind: max(rank[case][kind] for rank in per_rank) for kind in KINDS}
            cells = [f"{_mib(plan.kind(kind))} / {_mib(held[kind])}" for kind in KINDS]
            for kind in KINDS:
                worst = max(worst, abs(plan.kind(kind) / held[kind] - 1))
            total_held = sum(held.values())
            estimate = deepspeed_estimate(case, model, n)
            lines.append(f"| {n} | {case} | {' | '.join(cells)} | {_mib(plan.total)} / "
                         f"{_mib(total_held)} | {plan.total / total_held:.3f} | "
                         f"{_mib(estimate) if estimate is not None else '-'} |")
    return "\n".join(lines), worst


def extrapolated_table(ranks: int) -> str:
    """The plan alone for the 7B model on ``ranks`` ranks, with DeepSpeed's estimate."""
    gib = 2 ** 30
    lines = ["| strategy | params GiB | grads GiB | optim GiB | per rank GiB | job GiB | "
             "DeepSpeed's estimate per rank GiB |", "|---|---:|---:|---:|---:|---:|---:|"]
    for case in CASES:
        plan = planned(case, SEVEN_B, ranks)
        estimate = deepspeed_estimate(case, SEVEN_B, ranks)
        cells = " | ".join(f"{plan.kind(kind) / gib:.2f}" for kind in KINDS)
        lines.append(f"| {case} | {cells} | {plan.total / gib:.2f} | "
                     f"{plan.total * ranks / gib:.1f} | "
                     f"{f'{estimate / gib:.2f}' if estimate is not None else '-'} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES),
                        help="the strategies to measure (default: all)")
    args = parser.parse_args()
    model = [f"model.n_embd={args.n_embd}", f"model.n_layer={args.n_layer}"]
    results = {}
    with tempfile.TemporaryDirectory() as root:
        for n in args.ranks:
            cases = [case for case in args.cases if fits(case, n)]
            print(f"[memory_plan] {n} ranks: {', '.join(cases)} ...", flush=True)
            results[n] = run_on_ranks(n, _all_cases, model, root, cases)
    meta = build_meta_model(OmegaConf.to_container(_cfg("ddp", model), resolve=True))
    count = sum(p.numel() for p in meta.parameters())
    print(f"\nmeasured: tinylm n_embd {args.n_embd}, {args.n_layer} layers ({count:,} "
          f"parameters), AdamW, 2 steps; torch {torch.__version__}; plan / the rank that "
          f"held most\n")
    text, worst = measured_table(results, model)
    print(text)
    print("\nextrapolated (planned only, no process started): tinylm n_embd 4096, 34 layers, "
          "64 ranks\n")
    print(extrapolated_table(64))
    print(f"\nworst plan / measured of any kind: off by {worst:.1%} (bar {BAR:.0%})")
    return 0 if worst <= BAR else 1


if __name__ == "__main__":
    sys.exit(main())
