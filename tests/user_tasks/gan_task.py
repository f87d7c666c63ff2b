"""A user's GAN with alternating updates: each step trains the discriminator on real and
generated points, then the generator against the updated discriminator, each with an optimizer
of its own (Adam with GAN betas, a higher learning rate for the discriminator).

The data are points of a ring of Gaussians, each sample with its own latent noise, drawn from
the seed: what a sample generates does not depend on which rank reads it, so the same global
batch trains the same on any world size and accumulation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, TensorDataset

from .config import ConfigError, OptimConfig
from .contract import TaskBase


@dataclass
class TaskConfig:
    num_train_samples: int = 4096
    num_eval_samples: int = 512
    latent_dim: int = 8
    hidden_dim: int = 64
    modes: int = 8
    #: The discriminator's learning rate, as a multiple of optim.lr.
    discriminator_lr_ratio: float = 2.0

    def validate(self) -> None:
        if self.modes < 1:
            raise ConfigError(f"task.modes must be at least 1, got {self.modes}")
        if self.discriminator_lr_ratio <= 0:
            raise ConfigError(
                f"task.discriminator_lr_ratio must be positive, got {self.discriminator_lr_ratio}"
            )


def ring(config: TaskConfig, num_samples: int, seed: int) -> TensorDataset:
    """(point, noise) pairs: points around a ring of `modes` Gaussians, noise for the generator."""
    generator = torch.Generator().manual_seed(seed)
    mode = torch.randint(config.modes, (num_samples,), generator=generator)
    angle = 2 * math.pi * mode / config.modes
    centers = torch.stack([angle.cos(), angle.sin()], dim=1) * 2
    points = centers + 0.05 * torch.randn(num_samples, 2, generator=generator)
    noise = torch.randn(num_samples, config.latent_dim, generator=generator)
    return TensorDataset(points, noise)


class Gan(nn.Module):
    def __init__(self, latent_dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.generator = nn.Sequential(
            nn.Linear(latent_dim, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 2)
        )
        self.discriminator = nn.Sequential(
            nn.Linear(2, hidden_dim), nn.LeakyReLU(0.2), nn.Linear(hidden_dim, 1)
        )


def real_or_fake(logits: torch.Tensor, real: bool) -> torch.Tensor:
    """The mean binary cross-entropy of the discriminator's `logits` against one label."""
    labels = torch.full_like(logits, 1.0 if real else 0.0)
    return F.binary_cross_entropy_with_logits(logits, labels)


class Task(TaskBase):
    updates = ("discriminator", "generator")
    test_settings = (
        "task.num_train_samples=512",
        "task.num_eval_samples=101",
        "task.hidden_dim=8",
    )

    def __init__(self, config: TaskConfig, seed: int) -> None:
        self.config = config
        self.seed = seed

    def build_model(self) -> nn.Module:
        return Gan(self.config.latent_dim, self.config.hidden_dim)

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        return (
            ring(self.config, self.config.num_train_samples, self.seed),
            ring(self.config, self.config.num_eval_samples, self.seed + 1),
        )

    def build_optimizer(
        self, param_groups: list[dict[str, Any]], optim: OptimConfig, update: str | None = None
    ) -> torch.optim.Optimizer:
        ratio = self.config.discriminator_lr_ratio if update == "discriminator" else 1.0
        return torch.optim.Adam(param_groups, lr=optim.lr * ratio, betas=(0.5, 0.999))

    def training_loss(self, model: Any, batch: Any, update: str | None = None) -> torch.Tensor:
        points, noise = batch
        if update == "discriminator":
            with torch.no_grad():
                fake = model.generator(noise)
            real_loss = real_or_fake(model.discriminator(points), real=True)
            return real_loss + real_or_fake(model.discriminator(fake), real=False)
        return real_or_fake(model.discriminator(model.generator(noise)), real=True)

    def evaluation_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        points, noise = batch
        real = model.discriminator(points)
        fake = model.discriminator(model.generator(noise))
        count = torch.tensor(float(len(points)))
        discriminator = real_or_fake(real, real=True) + real_or_fake(fake, real=False)
        return {
            "loss": discriminator * count,
            "generator_loss": real_or_fake(fake, real=True) * count,
            "count": count,
        }
