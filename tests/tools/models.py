"""Models and data sets the command-line tests name by import path
(``model.type=tests.tools.models.X``, ``data.train.type=tests.tools.models.Y``)."""

from __future__ import annotations

import json
import os
import random
import signal
import time

import numpy as np
import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from trainrun.examples.digits import DigitsDataset, DigitsMLP
from trainrun.runner.hooks import Hook
from trainrun.wrappers.base_model import BaseModel


class SlowDigitsMLP(DigitsMLP):
    """The digits model, slowed down in training so a test can kill the job between steps."""

    def __init__(self, step_seconds: float = 0.05, **kwargs):
        super().__init__(**kwargs)
        self.step_seconds = step_seconds

    def forward(self, batch, mode="loss"):
        if mode == "loss":
            time.sleep(self.step_seconds)
        return super().forward(batch, mode)


class RankZeroLateDigitsMLP(DigitsMLP):
    """The digits model, built ``late_seconds`` later on rank 0 than on the others: the other
    ranks reach whatever the built model makes the run refuse first."""

    def __init__(self, late_seconds: float = 1.0, **kwargs):
        if os.environ.get("RANK") == "0":
            time.sleep(late_seconds)
        super().__init__(**kwargs)


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


class DamagedDigits(DigitsDataset):
    """The digits whose samples at ``bad`` (indices into the split) are damaged: their
    pixels are nan, as a user's broken images are, so the step that trains one has a nan
    loss (without shuffling, on one process, step index // batch size + 1)."""

    def __init__(self, bad: list[int] = (), **kwargs):
        super().__init__(**kwargs)
        self.inputs = self.inputs.clone()
        for index in bad:
            self.inputs[index] = float("nan")


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


class VariableLengthSequences(Dataset):
    """``size`` sequences of 1 to ``max_length`` token ids in [1, vocab) (drawn from ``seed``),
    each labelled 1 when its first token is above the vocabulary's middle: items
    ``{'tokens': int64[length], 'labels': int64}``, which torch's default collate cannot
    stack."""

    DEFAULT_METRICS = ["accuracy"]

    def __init__(self, size: int = 64, max_length: int = 9, vocab: int = 16, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(1, max_length + 1, (size,), generator=generator).tolist()
        self.items = []
        for length in lengths:
            tokens = torch.randint(1, vocab, (length,), generator=generator)
            self.items.append({"tokens": tokens, "labels": (tokens[0] > vocab // 2).long()})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return self.items[index]


class MaskedMeanClassifier(BaseModel):
    """Embeds a padded batch of tokens, averages the embeddings over the real positions
    (``tokens_mask``) and classifies. Refuses a batch whose padded positions do not hold
    ``pad_value``: the collate's options must reach it."""

    def __init__(self, vocab: int = 16, width: int = 16, pad_value: int = 0):
        super().__init__()
        self.embed = nn.Embedding(vocab + 1, width)
        self.head = nn.Linear(width, 2)
        self.pad_value = pad_value

    def forward(self, batch, mode="loss"):
        tokens, mask = batch["tokens"], batch["tokens_mask"]
        if not (tokens[~mask] == self.pad_value).all():
            raise ValueError(f"padded positions do not hold pad_value={self.pad_value}")
        embedded = self.embed(tokens.clamp(min=0)) * mask.unsqueeze(-1)
        logits = self.head(embedded.sum(1) / mask.sum(1, keepdim=True))
        if mode == "loss":
            return {"loss": F.cross_entropy(logits, batch["labels"])}
        return logits.argmax(-1)


class DigitsStream(IterableDataset):
    """The digits (``DigitsDataset(**kwargs)``) as a stream: their items in an order fixed by
    ``seed``, again and again without end (or ``passes`` times). No state: a resumed run
    reads it again from its start."""

    def __init__(self, seed: int = 0, passes: int | None = None, **kwargs):
        self.data = DigitsDataset(**kwargs)
        self.order = torch.randperm(len(self.data),
                                    generator=torch.Generator().manual_seed(seed)).tolist()
        self.passes = passes
        self.position = 0  # items the current pass has read
        self.resume_at = 0

    def __iter__(self):
        self.position, self.resume_at = self.resume_at, 0
        end = None if self.passes is None else self.passes * len(self.order)
        while end is None or self.position < end:
            index = self.order[self.position % len(self.order)]
            self.position += 1
            yield self.data[index]


class StatefulDigitsStream(DigitsStream):
    """`DigitsStream` that saves its place: ``state_dict()`` is the position it has read to,
    where the next pass starts after ``load_state_dict``."""

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.resume_at = state["position"]


class SizedDigitsStream(StatefulDigitsStream):
    """`StatefulDigitsStream` read ``passes`` times, with a length."""

    def __init__(self, passes: int = 1, **kwargs):
        super().__init__(passes=passes, **kwargs)

    def __len__(self) -> int:
        return self.passes * len(self.order)


class ItemDigitsMLP(DigitsMLP):
    """Reads a tensor's value in its forward (``.item()``): a graph break, which
    ``compile.fullgraph`` refuses."""

    def forward(self, batch, mode="loss"):
        if batch["inputs"].sum().item() < 0:  # never: the pixels are in [0, 1]
            raise ValueError("negative pixels")
        return super().forward(batch, mode)


class HangingHook(Hook):
    """Makes rank ``rank`` hang: ``at`` is ``'step_5'`` (after training step 5, while its
    heartbeat goes on), or once training is over ``'after_train'`` (in the hook point, after
    the last checkpoint: give it ``priority: after_checkpoint``), ``'after_run'``, ``'exit'``
    (an ``atexit`` handler that sleeps, so the process hangs as the interpreter shuts down) or
    ``'stop'`` (``after_run`` stops the process with SIGSTOP). Before it hangs it writes
    ``hang_rank<r>.json`` into the run directory: its pid and where it hangs, which a test
    reads to know the hang landed where it was meant to. Every rank also has an ``atexit``
    handler write ``exited_rank<r>`` there: the interpreter's shutdown ran."""

    def __init__(self, at: str = "after_run", rank: int = 1, seconds: float = 3600.0):
        if at not in ("step_5", "after_train", "after_run", "exit", "stop"):
            raise ValueError(f"at: got {at!r}, expected step_5, after_train, after_run, exit "
                             "or stop")
        self.at, self.rank, self.seconds = at, rank, seconds

    def before_run(self, runner):
        import atexit

        atexit.register((runner.work_dir / f"exited_rank{runner.rank}").touch)

    def after_train_iter(self, runner, batch_idx, batch, outputs):
        if runner.iter == 5:
            self._hang(runner, "step_5")

    def _hang(self, runner, point):
        if runner.rank != self.rank or point != ("after_run" if self.at in ("exit", "stop")
                                                 else self.at):
            return
        marker = runner.work_dir / f"hang_rank{runner.rank}.json"
        marker.write_text(json.dumps({"pid": os.getpid(), "at": self.at, "step": runner.iter}))
        if self.at == "exit":
            import atexit

            atexit.register(time.sleep, self.seconds)
        elif self.at == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            time.sleep(self.seconds)

    def after_train(self, runner):
        self._hang(runner, "after_train")

    def after_run(self, runner):
        self._hang(runner, "after_run")
