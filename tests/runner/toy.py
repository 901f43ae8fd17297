"""A tiny model and data set for runner tests: fast, and random enough (dropout, shuffling)
that a resume restoring the wrong RNG state or data position shows in the losses; and the
means to damage or craft a checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from trainrun.checkpoint.manager import newest_first
from trainrun.runner.evaluation import MeanOf
from trainrun.wrappers import BaseModel


class MSE(MeanOf):
    """The mean squared error of the predictions (the model's per-sample outputs)."""

    def __init__(self, collect_device: str = "cpu"):
        super().__init__("mse", collect_device)


class ToyRegression(Dataset):
    """``size`` points of y = x @ w + noise, fixed by ``seed``."""

    DEFAULT_METRICS = ["tests.runner.toy.MSE"]

    def __init__(self, size: int = 64, features: int = 4, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, features, generator=generator)
        weight = torch.arange(1.0, features + 1)
        self.y = self.x @ weight + 0.1 * torch.randn(size, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"inputs": self.x[index], "targets": self.y[index], "index": torch.tensor(index)}


class ToyModel(BaseModel):
    def __init__(self, features: int = 4, hidden: int = 16, dropout: float = 0.2):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Dropout(dropout),
                                 nn.Linear(hidden, 1))

    def forward(self, batch, mode="loss"):
        prediction = self.net(batch["inputs"]).squeeze(-1)
        error = (prediction - batch["targets"]) ** 2
        return {"loss": error.mean()} if mode == "loss" else error


class StackToy(BaseModel):
    """``ToyModel``'s task through a stack of blocks that pipeline parallelism can cut
    (``strategy.pp``; the protocol is trainrun/wrappers/pipeline.py's)."""

    pp_blocks = "blocks"

    def __init__(self, features: int = 4, hidden: int = 16, depth: int = 2, dropout: float = 0.0):
        super().__init__()
        self.inp = nn.Linear(features, hidden)
        self.blocks = nn.Sequential(*(nn.Sequential(nn.ReLU(), nn.Dropout(dropout),
                                                    nn.Linear(hidden, hidden))
                                      for _ in range(depth)))
        self.out = nn.Linear(hidden, 1)

    def pp_inputs(self, batch):
        return batch["inputs"]

    def pp_forward(self, x):
        if self.inp is not None:
            x = self.inp(x)
        x = self.blocks(x)
        return self.out(x).squeeze(-1) if self.out is not None else x

    def pp_outputs(self, prediction, batch, mode):
        error = (prediction - batch["targets"]) ** 2
        return {"loss": error.mean()} if mode == "loss" else error

    def forward(self, batch, mode="loss"):
        return self.pp_outputs(self.pp_forward(self.pp_inputs(batch)), batch, mode)


class NormToy(BaseModel):
    """``ToyModel``'s shape with a LayerNorm between its layers (the paramwise
    tests' model: in process and on 2 ranks)."""

    def __init__(self, features: int = 4, hidden: int = 8):
        super().__init__()
        self.embed = nn.Linear(features, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Sequential(nn.Dropout(0.2), nn.Linear(hidden, 1))

    def forward(self, batch, mode="loss"):
        prediction = self.head(torch.relu(self.norm(self.embed(batch["inputs"])))).squeeze(-1)
        error = (prediction - batch["targets"]) ** 2
        return {"loss": error.mean()} if mode == "loss" else error


class UnusedParamModel(ToyModel):
    """`ToyModel` with a layer its loss never touches (what detect_anomalous_params names)."""

    def __init__(self, features: int = 4, hidden: int = 8):
        super().__init__(features, hidden, dropout=0.0)
        self.unused = nn.Linear(features, 2)


class TwoNets(BaseModel):
    """Two trainable submodules with an optimiser each (the shape separate_ddp serves), a
    frozen one and a buffer. Its own ``train_step`` steps ``a`` then ``b``, counting calls."""

    def __init__(self, features: int = 4):
        super().__init__()
        self.a = nn.Linear(features, 1)
        self.b = nn.Linear(features, 1)
        self.frozen = nn.Linear(features, 1)
        self.frozen.requires_grad_(False)
        self.register_buffer("scale", torch.ones(1))
        self.train_steps = 0

    def forward(self, batch, mode="loss"):
        x, y = batch["inputs"], batch["targets"]
        prediction = (self.a(x) + self.b(x) + self.frozen(x)).squeeze(-1) * self.scale
        return {"loss": ((prediction - y) ** 2).mean()} if mode == "loss" else prediction

    def loss_a(self, batch):
        return ((self.a(batch["inputs"]).squeeze(-1) - batch["targets"]) ** 2).mean()

    def loss_b(self, batch):
        return ((self.b(batch["inputs"]).squeeze(-1) + batch["targets"]) ** 2).mean()

    def train_step(self, data, optim_wrapper):
        self.train_steps += 1
        logged = {}
        for name, loss_of in (("a", self.loss_a), ("b", self.loss_b)):
            wrapper = optim_wrapper[name]
            with wrapper.optim_context(getattr(self, name)):
                loss = loss_of(data)
            wrapper.update_params(loss)
            logged[f"loss_{name}"] = loss.detach()
        logged["loss"] = logged["loss_a"] + logged["loss_b"]
        return logged


class Killed(Exception):
    """Stands for the process dying at that point."""


class CrashAfter:
    """A hook that kills the run after iteration ``step``."""

    priority = 99

    def __init__(self, step):
        self.step = step

    def __getattr__(self, name):
        return lambda *args: None

    def after_train_iter(self, runner, batch_idx, batch, outputs):
        if runner.iter == self.step:
            if runner.run_lock is not None:  # a dead process holds no run directory
                runner.run_lock.release()
            raise Killed(f"killed after step {self.step}")


def straight_crash_resume(runner: Callable[..., Any], crash_after: int = 6) -> None:
    """Train a run ``straight`` through, and one (``crashed``) that dies after step
    ``crash_after`` and is resumed; ``runner(name, resume=...)`` builds each `Runner`."""
    with runner("straight") as run:
        run.train()
    with runner("crashed") as run, pytest.raises(Killed):
        run.hooks.append(CrashAfter(crash_after))
        run.train()
    with runner("crashed", resume=True) as run:
        run.train()


def batch_of(rank: int, size: int = 4, features: int = 4) -> dict[str, torch.Tensor]:
    """A batch that differs by ``rank`` (so unsynchronised gradients differ)."""
    generator = torch.Generator().manual_seed(1000 + rank)
    return {"inputs": torch.randn(size, features, generator=generator),
            "targets": torch.randn(size, generator=generator)}


def flat_params(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


def flat_grads(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().reshape(-1).clone() for p in module.parameters()
                      if p.grad is not None])


class Payload:
    """A pickled object that runs ``os.system`` when unpickled: what a crafted checkpoint
    carries. A loader that is safe refuses it, and ``marker`` is never created."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def newest(manager: Any) -> Path | None:
    """The checkpoint a ``CheckpointManager``'s ``last`` names, if it is there."""
    found = newest_first(manager.directory)
    return found[0] if found else None


def flip_byte(file: Path) -> None:
    """Invert one byte in the middle of ``file``."""
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def rehash(checkpoint: Path) -> None:
    """Rewrite the manifest of a checkpoint (a file or a directory) to match its files as they
    are now: what someone who crafts a checkpoint can do too."""
    from trainrun.checkpoint.manifest import MANIFEST, hash_files, write_manifest

    files = [checkpoint] if checkpoint.is_file() else [
        p for p in checkpoint.rglob("*") if p.is_file() and p.name != MANIFEST]
    write_manifest(checkpoint, checkpoint, hash_files(files, checkpoint, checkpoint))


def write_crafted_checkpoint(path, marker, raw_pickle: bool = False) -> None:
    """A checkpoint-looking file (a real model state plus the payload) at ``path``."""
    import pickle

    state = {"model": ToyModel().state_dict(), "meta": Payload(str(marker))}
    if raw_pickle:
        with open(path, "wb") as f:
            pickle.dump(state, f, protocol=2)
    else:
        torch.save(state, path)


class PoisonedRegression(ToyRegression):
    """``ToyRegression`` whose samples at ``bad`` hold a target of ``target`` (nan: the loss
    of the step that trains one is nan; a large number: that step's loss spikes), as a user's
    damaged data does at a known step (without shuffling, index // global batch + 1)."""

    def __init__(self, bad: list[int] = (), target: float = float("nan"), **kwargs):
        super().__init__(**kwargs)
        for index in bad:
            self.y[index] = target


def nonfinite_in(checkpoint: Path) -> list[str]:
    """Where a checkpoint (a torch file, or a directory of them: DCP's converted to one
    first, DeepSpeed's read file by file) holds a floating-point tensor that is not all
    finite: each such tensor's file and place; none for a good checkpoint."""
    import math
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    def walk(value: Any, where: str) -> list[str]:
        if isinstance(value, torch.Tensor):
            bad = value.is_floating_point() and not bool(torch.isfinite(value).all())
            return [where] if bad else []
        if isinstance(value, float):
            return [] if math.isfinite(value) else [where]
        if isinstance(value, dict):
            return [found for key, item in value.items() for found in walk(item, f"{where}.{key}")]
        if isinstance(value, (list, tuple)):
            return [found for i, item in enumerate(value) for found in walk(item, f"{where}[{i}]")]
        return []

    def tensors_of(path: Path) -> Any:
        return torch.load(path, map_location="cpu", weights_only=False)

    found: list[str] = []
    if checkpoint.is_file():
        return walk(tensors_of(checkpoint), checkpoint.name)
    if any(checkpoint.glob("*.distcp")):
        with tempfile.TemporaryDirectory() as tmp:
            whole = Path(tmp) / "whole.pt"
            dcp_to_torch_save(checkpoint, whole)
            found += walk(tensors_of(whole), checkpoint.name)
    for file in sorted(checkpoint.rglob("*.pt")):
        found += walk(tensors_of(file), str(file.relative_to(checkpoint)))
    return found
