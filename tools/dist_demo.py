"""A small data-parallel training job built on trainrun.dist alone.

It shows the collectives of `trainrun.dist` without the runner. Each rank
trains a two-layer network on its shard of a synthetic two-spiral problem; gradients are
averaged with `all_reduce_params`, the logged loss with `all_reduce_dict`, and rank 0 scores
the whole validation set from `collect_results`.

    torchrun --nproc_per_node 2 tools/dist_demo.py [--launcher pytorch] [--steps 300]
"""

from __future__ import annotations

import argparse
import logging
import math

import torch
from torch import nn

import trainrun.dist as dist

log = logging.getLogger("dist_demo")


def spirals(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two interleaved spirals with a little noise: points (count, 2) and labels (count,)."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (count,), generator=generator)
    radius = torch.rand(count, generator=generator) * 3 + 0.3
    angle = radius * 2.2 + labels * math.pi
    points = torch.stack([radius * angle.cos(), radius * angle.sin()], dim=1)
    return points + 0.08 * torch.randn(count, 2, generator=generator), labels


def shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's items, dealt round-robin as a non-shuffling DistributedSampler deals them."""
    rank, world_size = dist.get_dist_info()
    return tensor[rank::world_size]


def train(steps: int, seed: int) -> float:
    """Train and return the validation accuracy (the same number on every rank)."""
    seed = dist.sync_random_seed(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                          nn.Linear(64, 2))
    dist.all_reduce_params(model.parameters(), op="mean")  # identical start on every rank
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    train_x, train_y = spirals(4000, seed)
    train_x, train_y = shard(train_x), shard(train_y)
    for step in range(1, steps + 1):
        batch = torch.randint(0, len(train_x), (128,))
        loss = nn.functional.cross_entropy(model(train_x[batch]), train_y[batch])
        optimizer.zero_grad()
        loss.backward()
        dist.all_reduce_params([p.grad for p in model.parameters()], op="mean")
        optimizer.step()
        if step % 50 == 0 or step == steps:
            logged = dist.all_reduce_dict({"loss": loss.item()}, op="mean")
            log.info("step %d/%d  loss %.4f (mean of %d ranks)", step, steps, logged["loss"],
                     dist.get_world_size())
    return evaluate(model, seed + 1)


def evaluate(model: nn.Module, seed: int) -> float:
    """Each rank predicts its shard; rank 0 scores them all; every rank gets the score."""
    val_x, val_y = spirals(1001, seed)
    with torch.no_grad():
        predictions = model(shard(val_x)).argmax(1).tolist()
    collected = dist.collect_results(predictions, len(val_x))
    score = [None]
    if dist.is_main_process():
        hits = sum(int(p == y) for p, y in zip(collected, val_y.tolist(), strict=True))
        score[0] = hits / len(val_x)
    dist.broadcast_object_list(score)
    return score[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launcher", choices=["none", "pytorch", "slurm", "mpi"],
                        default=dist.infer_launcher())
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    if args.launcher != "none":
        dist.init_dist(args.launcher, backend="auto", timeout=120)
    rank, world_size = dist.get_dist_info()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank {rank}] %(message)s")
    log.info("launcher %s, backend %s, world size %d", args.launcher, dist.get_backend(),
             world_size)
    accuracy = train(args.steps, args.seed)
    log.info("validation accuracy %.3f", accuracy)
    dist.leave_dist()


if __name__ == "__main__":
    main()
