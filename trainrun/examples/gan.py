"""A tiny GAN on a ring of 2-D Gaussians: the example of a model with two optimisers.

The data are drawn from a seed (no download). `ToyGAN` has a ``generator`` and a
``discriminator`` and its own ``train_step``, which steps each with its own optimiser
wrapper; that is the shape the ``separate_ddp`` strategy serves, each submodule in its own
DDP. Validation scores how far generated points land from the nearest mode centre.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset

from trainrun.wrappers.base_model import BaseModel

SPLITS = ("train", "val", "test")
DEFAULT_SIZES = {"train": 8192, "val": 1024, "test": 1024}


def mode_centres(num_modes: int, radius: float) -> Tensor:
    """The centres of ``num_modes`` Gaussians evenly spaced on a circle (num_modes x 2)."""
    angles = torch.arange(num_modes, dtype=torch.float64) * (2 * math.pi / num_modes)
    return (radius * torch.stack([angles.cos(), angles.sin()], dim=1)).float()


class GaussianMixture(Dataset):
    """Points from a ring of ``num_modes`` Gaussians, each with a fixed latent vector.

    Items are ``{'inputs': float32[2] (the point), 'labels': int64 (its mode),
    'noise': float32[latent_dim]}``. The noise gives validation the same generator inputs at
    every evaluation; ``ToyGAN.train_step`` draws fresh noise instead. Each split is drawn
    from its own stream, fixed by ``seed`` and the split's name, so the splits never share
    points and changing one split's ``size`` leaves the others as they were.

    Args:
        split: which split: train, val or test.
        size: how many points (null: 8192 for train, 1024 for val and test).
        num_modes: how many Gaussians on the ring.
        radius: the ring's radius.
        std: each Gaussian's standard deviation.
        latent_dim: the width of each point's fixed noise vector.
        seed: the seed the splits' points are drawn from.
    """

    DEFAULT_METRICS: ClassVar[list[str]] = ["mode_distance"]

    def __init__(self, split: str = "train", size: int | None = None, num_modes: int = 8,
                 radius: float = 2.0, std: float = 0.05, latent_dim: int = 2, seed: int = 0):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}; got {split!r}")
        size = DEFAULT_SIZES[split] if size is None else size
        rng = torch.Generator().manual_seed(seed * len(SPLITS) + SPLITS.index(split))
        self.labels = torch.randint(num_modes, (size,), generator=rng)
        centres = mode_centres(num_modes, radius)
        self.inputs = centres[self.labels] + std * torch.randn(size, 2, generator=rng)
        self.noise = torch.randn(size, latent_dim, generator=rng)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"inputs": self.inputs[index], "labels": self.labels[index],
                "noise": self.noise[index]}


def mlp(width_in: int, hidden: int, width_out: int, depth: int) -> nn.Sequential:
    """``depth`` hidden layers of ``hidden`` units with leaky ReLUs."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width_in, hidden), nn.LeakyReLU(0.2)]
        width_in = hidden
    layers.append(nn.Linear(width_in, width_out))
    return nn.Sequential(*layers)


@contextmanager
def frozen(module: nn.Module) -> Iterator[None]:
    """Parameters of ``module`` need no gradient inside the block (restored after), so a loss
    that flows through it leaves its gradients untouched."""
    flags = [(p, p.requires_grad) for p in module.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


class ToyGAN(BaseModel):
    """A generator of 2-D points from ``latent_dim`` noise and a discriminator of points.

    Losses are the non-saturating ones: the discriminator learns real -> 1, generated -> 0;
    the generator learns to make the discriminator say 1. ``num_modes`` and ``radius`` name
    the data's mode centres, which validation measures against (match the data set's).

    Args:
        latent_dim: the width of the generator's noise input.
        hidden: the width of both networks' hidden layers.
        depth: the number of layers of each network.
        num_modes: the data's number of modes (as the data set's).
        radius: the data's ring radius (as the data set's).
    """

    def __init__(self, latent_dim: int = 2, hidden: int = 128, depth: int = 3,
                 num_modes: int = 8, radius: float = 2.0):
        super().__init__()
        self.latent_dim = latent_dim
        self.generator = mlp(latent_dim, hidden, 2, depth)
        self.discriminator = mlp(2, hidden, 1, depth)
        self.register_buffer("centres", mode_centres(num_modes, radius), persistent=False)

    def forward(self, batch: dict[str, Tensor], mode: str = "loss") -> Any:
        """``mode='loss'``: both losses on the batch, without stepping anything;
        ``mode='predict'``: the points generated from ``batch['noise']`` (batch x 2)."""
        if mode == "loss":
            fake = self.generator(self.sample_noise(batch["inputs"]))
            return {"loss_d": self.discriminator_loss(batch["inputs"], fake.detach()),
                    "loss_g": self.generator_loss(fake)}
        if mode == "predict":
            return self.generator(batch["noise"])
        raise ValueError(f"mode must be 'loss' or 'predict'; got {mode!r}")

    def sample_noise(self, real: Tensor) -> Tensor:
        """Fresh generator inputs, one per point of ``real``, from the global random state."""
        return torch.randn(real.size(0), self.latent_dim, device=real.device, dtype=real.dtype)

    def discriminator_loss(self, real: Tensor, fake: Tensor) -> Tensor:
        real_score, fake_score = self.discriminator(real), self.discriminator(fake)
        return (F.binary_cross_entropy_with_logits(real_score, torch.ones_like(real_score))
                + F.binary_cross_entropy_with_logits(fake_score, torch.zeros_like(fake_score)))

    def generator_loss(self, fake: Tensor) -> Tensor:
        score = self.discriminator(fake)
        return F.binary_cross_entropy_with_logits(score, torch.ones_like(score))

    def train_step(self, data: dict[str, Tensor], optim_wrapper: Any) -> dict[str, Tensor]:
        """One discriminator step, then one generator step, each with its own wrapper.

        The discriminator sees generated points made without a graph (so the generator's DDP
        expects no backward); during the generator step the discriminator is frozen, so its
        gradients stay as its own step left them.
        """
        real = data["inputs"]
        disc_wrapper, gen_wrapper = optim_wrapper["discriminator"], optim_wrapper["generator"]
        with torch.no_grad():
            fake = self.generator(self.sample_noise(real))
        with disc_wrapper.optim_context(self.discriminator):
            loss_d = self.discriminator_loss(real, fake)
        disc_wrapper.update_params(loss_d)

        with frozen(self.discriminator), gen_wrapper.optim_context(self.generator):
            loss_g = self.generator_loss(self.generator(self.sample_noise(real)))
        gen_wrapper.update_params(loss_g)
        loss_d, loss_g = loss_d.detach(), loss_g.detach()
        return {"loss": loss_d + loss_g, "loss_d": loss_d, "loss_g": loss_g}

    def val_step(self, data: dict[str, Tensor]) -> Tensor:
        """Each generated point's distance to the nearest mode centre (one per sample)."""
        with torch.no_grad():
            points = self(data, mode="predict")
        return torch.cdist(points.float(), self.centres).min(dim=1).values

    def test_step(self, data: dict[str, Tensor]) -> Tensor:
        return self.val_step(data)
