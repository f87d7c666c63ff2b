"""A user's task with a contrastive loss: an encoder trained with InfoNCE, whose negatives are
the embeddings of every rank's samples of the step, gathered with autograd.

Each sample is a pair of views of one point (two noisy copies of it, made from the seed). The
loss of a view is the cross-entropy of its similarities to the other view of every sample of
the step, its own sample's being the target, in both directions (as CLIP's). The gather
carries gradients back to the rank that made each embedding, and DDP averages the ranks'
gradients: the mean of the ranks' losses is the loss of the whole global batch, with no
scaling by the world size. A micro-batch's loss thus reads the step's samples together
(`whole_batch_loss`). Evaluation reports sums over samples alone, with no collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, TensorDataset

from .config import ConfigError
from .contract import TaskBase


@dataclass
class TaskConfig:
    """Contrastive learning of embeddings of noisy points (see task.py)."""

    #: Points in the generated training set.
    num_train_samples: int = 8192
    #: Points in the generated evaluation set.
    num_eval_samples: int = 512
    #: Width of a point.
    input_dim: int = 32
    #: Width of the encoder's hidden layer.
    hidden_dim: int = 128
    #: Width of an embedding.
    embed_dim: int = 32
    #: Scale of the Gaussian noise that makes a point's two views.
    noise: float = 0.3
    #: Temperature of the similarities (cosines) in the loss.
    temperature: float = 0.1

    def validate(self) -> None:
        for key in ("num_train_samples", "num_eval_samples", "input_dim", "hidden_dim"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"task.{key} must be positive, got {getattr(self, key)}")
        if self.embed_dim <= 0:
            raise ConfigError(f"task.embed_dim must be positive, got {self.embed_dim}")
        if self.noise < 0:
            raise ConfigError(f"task.noise must not be negative, got {self.noise}")
        if self.temperature <= 0:
            raise ConfigError(f"task.temperature must be positive, got {self.temperature}")


def views(config: TaskConfig, num_samples: int, seed: int) -> TensorDataset:
    """(first view, second view) of `num_samples` points: the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    points = torch.randn(num_samples, config.input_dim, generator=generator)
    first = points + config.noise * torch.randn(points.shape, generator=generator)
    second = points + config.noise * torch.randn(points.shape, generator=generator)
    return TensorDataset(first, second)


class GatherRows(torch.autograd.Function):
    """Every rank's rows, in rank order, with autograd: the backward adds up every rank's
    gradient of the gathered rows and gives each rank those of its own rows. Written with
    torch.distributed's all_gather into a list and all_reduce, which every backend and torch
    release has and which wait for their result: all_gather_into_tensor is deprecated since
    torch 2.13 for dist.all_gather_single, which earlier releases lack, and torch's functional
    collectives (`_functional_collectives.all_gather_single`) corrupt memory now and then on
    gloo in their backward."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor) -> torch.Tensor:
        rows = rows.contiguous()
        pieces = [torch.empty_like(rows) for _ in range(dist.get_world_size())]
        dist.all_gather(pieces, rows)
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        total = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total)
        rows = len(total) // dist.get_world_size()
        return total[dist.get_rank() * rows : (dist.get_rank() + 1) * rows]


def gathered(embeddings: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Every rank's embeddings of the step, in rank order, and the row where this rank's
    begin. The gather carries autograd: the gradients of the rows of other ranks' losses go
    back to the rank that made them. On one rank, this rank's own."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return embeddings, 0
    return GatherRows.apply(embeddings), dist.get_rank() * len(embeddings)


class Task(TaskBase):
    #: The loss reads the step's samples together: gradient accumulation would give each
    #: micro-batch only its own negatives, so a batch split that needs it is refused.
    whole_batch_loss = True
    test_settings = (
        "task.num_train_samples=512",
        "task.num_eval_samples=101",
        "task.input_dim=16",
        "task.hidden_dim=32",
        "task.embed_dim=16",
    )

    def __init__(self, config: TaskConfig, seed: int) -> None:
        self.config = config
        self.seed = seed

    def build_model(self) -> nn.Module:
        c = self.config
        return nn.Sequential(
            nn.Linear(c.input_dim, c.hidden_dim), nn.GELU(), nn.Linear(c.hidden_dim, c.embed_dim)
        )

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        return (
            views(self.config, self.config.num_train_samples, self.seed),
            views(self.config, self.config.num_eval_samples, self.seed + 1),
        )

    def embed(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Unit embeddings of both views, from one forward over both."""
        first, second = batch
        embeddings = F.normalize(model(torch.cat([first, second])), dim=-1)
        return embeddings[: len(first)], embeddings[len(first) :]

    def training_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The mean over this rank's samples of InfoNCE against every rank's, both ways."""
        first, second = self.embed(model, batch)
        every_first, offset = gathered(first)
        every_second, _ = gathered(second)
        targets = offset + torch.arange(len(first), device=first.device)
        scale = 1 / self.config.temperature
        return (
            F.cross_entropy(scale * first @ every_second.T, targets)
            + F.cross_entropy(scale * second @ every_first.T, targets)
        ) / 2

    def evaluation_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """Per-sample sums, whichever batch and rank a sample is in: the squared distance
        between a sample's two embeddings (alignment, lower is better) and their cosine."""
        first, second = self.embed(model, batch)
        first, second = first.double(), second.double()
        return {
            "alignment": (first - second).pow(2).sum(),
            "positive_cosine": (first * second).sum(),
            "count": torch.tensor(float(len(first)), device=first.device),
        }
