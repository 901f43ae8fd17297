"""Per-rank memory of the training state under ddp, fsdp and DeepSpeed ZeRO-3, for N ranks.

    python bench/memory.py [--ranks 2 3 4] [--layers 8] [--width 1024]

For each N, N gloo processes (spawned here, one thread each) build the same model (``--layers``
square ``Linear`` layers of ``--width``, fp32) with trainrun's strategies and take one AdamW
step on it. Then every rank counts the bytes of the tensors it holds, by kind:

- parameters: ddp every parameter; fsdp each parameter's local shard (`DTensor.to_local`);
  ZeRO-3 the flat buffers of its parameter partitions and the fp32 master partitions (aliased
  to them in fp32), plus the small parameters ZeRO-3 keeps whole on every rank;
- gradients: ddp ``p.grad``; fsdp its local shard; ZeRO-3 its flat gradient-partition buffer;
- optimiser state: AdamW's ``exp_avg`` and ``exp_avg_sq`` (local shards / partitions).

Tensors are counted once per storage. Communication buffers (DDP's gradient buckets,
DeepSpeed's reduce buckets) are not part of the state and are not counted. The table prints
each strategy's worst rank and ``ratio``: that total over DDP's total / N (1.00 is a perfect
1/N share; the bar is 1.10). Exit status 1 when a ratio is above 1.10.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable

import torch
from gloo_ranks import Layers, run_on_ranks
from torch import Tensor

from trainrun.wrappers import STRATEGIES

STRATEGY_OPTIONS = {
    "ddp": {},
    "fsdp": {"sharding": "full", "wrap": {"classes": ["Linear"]}},
    "zero3": {"zero_stage": 3},
}
KINDS = ("params", "grads", "optim")
BAR = 1.10


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def unique_bytes(tensors: Iterable[Tensor | None], seen: set[int]) -> int:
    """Bytes of the storages behind ``tensors`` not in ``seen`` (which grows)."""
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        storage = _local(tensor).untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _optimizer_state(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [t for state in optimizer.state.values() for t in state.values()
            if isinstance(t, Tensor) and t.dim() > 0]


def step_and_count(kind: str, layers: int, width: int, precision: str) -> dict[str, int]:
    """Build the model under strategy ``kind``, take one step, count this rank's bytes."""
    torch.manual_seed(0)
    strategy = STRATEGIES["deepspeed" if kind == "zero3" else kind](**STRATEGY_OPTIONS[kind])
    strategy.configure(batch_size=4, optim={"type": "AdamW", "lr": 1e-3}, precision=precision)
    model, optimizer = strategy.setup(Layers(layers, width), torch.device("cpu"),
                                      lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
    with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
        loss = model(torch.randn(4, width))["loss"]
    seen: set[int] = set()
    if kind == "zero3":
        engine = strategy.engine
        engine.backward(loss)
        zero = engine.optimizer
        grads = unique_bytes([zero.grad_partitions_flat_buffer], seen)
        engine.step()
        params = unique_bytes([*zero.fp16_partitioned_groups_flat,
                               *zero.fp32_partitioned_groups_flat,
                               *(p.data for p in engine.module.parameters())], seen)
        optim = unique_bytes(_optimizer_state(zero.optimizer), seen)
    else:
        loss.backward()
        module = strategy.unwrap(model)
        grads = unique_bytes((p.grad for p in module.parameters()), seen)
        optimizer.step()
        params = unique_bytes(module.parameters(), seen)
        optim = unique_bytes(_optimizer_state(optimizer), seen)
    strategy.teardown()
    return {"params": params, "grads": grads, "optim": optim}


def _all_counts(args: argparse.Namespace) -> dict[str, dict[str, dict[str, int]]]:
    """On one rank: every precision's and strategy's counts."""
    return {precision: {kind: step_and_count(kind, args.layers, args.width, precision)
                        for kind in STRATEGY_OPTIONS} for precision in args.precision}


def table(results: dict[tuple[str, int], list[dict[str, dict[str, int]]]],
          precision: str) -> tuple[str, float]:
    """The Markdown table of the worst rank per strategy and N; and the worst ratio."""
    mib = 2 ** 20
    lines = ["| N | strategy | params MiB | grads MiB | optim MiB | total MiB | ratio to DDP/N |",
             "|---|---|---:|---:|---:|---:|---:|"]
    worst = 0.0
    for (prec, n), per_rank in sorted(results.items()):
        if prec != precision:
            continue
        ddp_total = max(sum(r["ddp"].values()) for r in per_rank)
        for kind in STRATEGY_OPTIONS:
            top = max(per_rank, key=lambda r, k=kind: sum(r[k].values()))[kind]
            total = sum(top.values())
            ratio = total / (ddp_total / n)
            if kind != "ddp":
                worst = max(worst, ratio)
            cells = " | ".join(f"{top[k] / mib:.1f}" for k in KINDS)
            shown = f"{ratio:.3f}" if kind != "ddp" else "baseline"
            lines.append(f"| {n} | {kind} | {cells} | {total / mib:.1f} | {shown} |")
    return "\n".join(lines), worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--precision", nargs="+", choices=("fp32", "bf16"),
                        default=["fp32", "bf16"])
    args = parser.parse_args()
    results = {}
    for n in args.ranks:
        print(f"[memory] {n} ranks: ddp, fsdp, zero3 ...", flush=True)
        per_rank = run_on_ranks(n, _all_counts, args)
        for precision in args.precision:
            results[(precision, n)] = [counts[precision] for counts in per_rank]
    worst = 0.0
    for precision in args.precision:
        print(f"\n{args.layers} x Linear({args.width}, {args.width}), precision {precision}, "
              f"AdamW; torch {torch.__version__}; the worst rank of each strategy\n")
        text, ratio = table(results, precision)
        print(text)
        worst = max(worst, ratio)
    print(f"\nworst ratio of a sharded strategy: {worst:.3f} (bar {BAR:.2f})")
    return 0 if worst <= BAR else 1


if __name__ == "__main__":
    sys.exit(main())
