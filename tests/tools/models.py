"""Models and data sets the command-line tests name by import path
(``model.type=tests.tools.models.X``, ``data.train.type=tests.tools.models.Y``)."""

from __future__ import annotations

import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as torch_dist

from trainrun.examples.digits import DigitsDataset, DigitsMLP
from trainrun.runner.hooks import Hook


class SlowDigitsMLP(DigitsMLP):
    """The digits model, slowed down in training so a test can kill the job between steps."""

    def __init__(self, step_seconds: float = 0.05, **kwargs):
        super().__init__(**kwargs)
        self.step_seconds = step_seconds

    def forward(self, batch, mode="loss"):
        if mode == "loss":
            time.sleep(self.step_seconds)
        return super().forward(batch, mode)


class FailingDigitsMLP(DigitsMLP):
    """Raises in the forward pass of training step ``fail_at`` on rank ``fail_rank``."""

    def __init__(self, fail_at: int = 3, fail_rank: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.fail_at, self.fail_rank, self.steps = fail_at, fail_rank, 0

    def forward(self, batch, mode="loss"):
        if mode == "loss":
            self.steps += 1
            rank = torch_dist.get_rank() if torch_dist.is_initialized() else 0
            if self.steps == self.fail_at and rank == self.fail_rank:
                raise RuntimeError(f"injected failure (pid {os.getpid()})")
        return super().forward(batch, mode)


class UnsavedNoiseDigitsMLP(DigitsMLP):
    """Scales its training loss by noise from a ``random.Random`` of its own, seeded with
    ``noise_seed`` when built (None: from the OS) and saved in no checkpoint: a resumed run
    draws that stream again from its start, so its losses part from an unbroken run's."""

    def __init__(self, noise: float = 0.1, noise_seed: int | None = 0, **kwargs):
        super().__init__(**kwargs)
        self.noise = noise
        self.rng = random.Random(noise_seed)

    def forward(self, batch, mode="loss"):
        out = super().forward(batch, mode)
        if mode == "loss":
            out["loss"] = out["loss"] * (1 + self.noise * self.rng.random())
        return out


class NoisyDigits(DigitsDataset):
    """The digits, each image read with noise drawn from torch's, numpy's and python's global
    generators: random augmentation as a data set usually does it."""

    def __init__(self, noise: float = 0.05, **kwargs):
        super().__init__(**kwargs)
        self.noise = noise

    def __getitem__(self, index):
        item = super().__getitem__(index)
        noise = (torch.randn(item["inputs"].shape) + float(np.random.uniform(-1, 1))
                 + random.gauss(0, 1))
        return {**item, "inputs": item["inputs"] + self.noise * noise}


class CountingHook(Hook):
    """A user's hook with state of each rank's own: it counts the training steps it saw,
    ``weight`` times (rank + 1) each, and at the end writes ``hook_rank<r>.json`` (the step
    training ended at, and the count) into the run directory. Restored from a checkpoint, the
    count of a resumed run ends where an unbroken run's does."""

    state_per_rank = True

    def __init__(self, weight: int = 1):
        if weight < 1:
            raise ValueError(f"weight: got {weight}, expected an int >= 1")
        self.weight = weight
        self.count = 0

    def after_train_iter(self, runner, batch_idx, batch, outputs):
        self.count += self.weight * (runner.rank + 1)

    def after_run(self, runner):
        path = runner.work_dir / f"hook_rank{runner.rank}.json"
        path.write_text(json.dumps({"step": runner.iter, "count": self.count}))

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


class ItemDigitsMLP(DigitsMLP):
    """Reads a tensor's value in its forward (``.item()``): a graph break, which
    ``compile.fullgraph`` refuses."""

    def forward(self, batch, mode="loss"):
        if batch["inputs"].sum().item() < 0:  # never: the pixels are in [0, 1]
            raise ValueError("negative pixels")
        return super().forward(batch, mode)
