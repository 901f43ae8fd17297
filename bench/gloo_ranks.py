"""What the Python benches share: running a function on N local gloo ranks, and the model
they measure (square ``Linear`` layers, so its size is set exactly)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from trainrun.dist.launch import free_port
from trainrun.wrappers.base_model import BaseModel


class Layers(BaseModel):
    """``layers`` square ``Linear(width, width)``; the loss is the output's mean square."""

    def __init__(self, layers: int, width: int):
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

    def forward(self, batch: Tensor, mode: str = "loss") -> dict[str, Tensor]:
        return {"loss": self.net(batch).pow(2).mean()}


def _worker(rank: int, world_size: int, port: int, body: Callable[..., Any], args: tuple,
            results: dict) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch_dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        results[rank] = body(*args)
    finally:
        torch_dist.destroy_process_group()


def run_on_ranks(world_size: int, body: Callable[..., Any], *args: Any) -> list[Any]:
    """``body(*args)`` on ``world_size`` spawned gloo ranks (one thread each); their results
    in rank order. ``body`` must be a module-level function."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(world_size, free_port(), body, args, results), nprocs=world_size,
             join=True)
    return [results[rank] for rank in range(world_size)]
