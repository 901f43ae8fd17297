"""A tiny model and data set for runner tests: fast, and random enough (dropout, shuffling)
that a resume restoring the wrong RNG state or data position shows in the losses."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

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
