"""A user's task with an optimizer and a schedule of its own: a small MLP regressor trained by
SGD with Nesterov momentum (no momentum dampening; a lower momentum and no weight decay for the
biases) and a step-decay learning rate, a factor per step (LambdaLR).

The data are made from the seed; batches are (inputs, targets) tuples and the loss is the
micro-batch's mean squared error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.optim.lr_scheduler import LambdaLR, LRScheduler
from torch.utils.data import Dataset, TensorDataset

from .config import ConfigError, OptimConfig
from .contract import TaskBase


@dataclass
class TaskConfig:
    num_train_samples: int = 2048
    num_eval_samples: int = 256
    input_dim: int = 16
    hidden_dim: int = 64
    #: The learning rate is multiplied by `decay` every `decay_every` optimizer steps.
    decay: float = 0.5
    decay_every: int = 50

    def validate(self) -> None:
        if not 0 < self.decay <= 1:
            raise ConfigError(f"task.decay must be in (0, 1], got {self.decay}")
        if self.decay_every < 1:
            raise ConfigError(f"task.decay_every must be at least 1, got {self.decay_every}")


def regression(config: TaskConfig, num_samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(num_samples, config.input_dim, generator=generator)
    weights = torch.randn(config.input_dim, 1, generator=torch.Generator().manual_seed(0))
    targets = torch.sin(inputs @ weights) + 0.1 * torch.randn(num_samples, 1, generator=generator)
    return TensorDataset(inputs, targets)


class Task(TaskBase):
    test_settings = (
        "task.num_train_samples=512",
        "task.num_eval_samples=101",
        "task.decay_every=3",
    )

    def __init__(self, config: TaskConfig, seed: int) -> None:
        self.config = config
        self.seed = seed

    def build_model(self) -> nn.Module:
        width = self.config.hidden_dim
        return nn.Sequential(
            nn.Linear(self.config.input_dim, width), nn.Tanh(), nn.Linear(width, 1)
        )

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        return (
            regression(self.config, self.config.num_train_samples, self.seed),
            regression(self.config, self.config.num_eval_samples, self.seed + 1),
        )

    def training_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        return F.mse_loss(model(inputs), targets)

    def evaluation_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        inputs, targets = batch
        squared = (model(inputs) - targets).pow(2).sum()
        return {"loss": squared, "count": torch.tensor(float(len(targets)))}

    def param_groups(self, model: nn.Module) -> list[dict[str, Any]]:
        matrices = [param for param in model.parameters() if param.dim() > 1]
        biases = [param for param in model.parameters() if param.dim() == 1]
        return [
            {"name": "weights", "params": matrices},
            {"name": "biases", "params": biases, "momentum": 0.5, "weight_decay": 0.0},
        ]

    def build_optimizer(
        self, param_groups: list[dict[str, Any]], optim: OptimConfig
    ) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            param_groups,
            lr=optim.lr,
            momentum=0.9,
            nesterov=True,
            weight_decay=optim.weight_decay,
        )

    def build_scheduler(
        self, optimizer: torch.optim.Optimizer, total_steps: int, optim: OptimConfig
    ) -> LRScheduler:
        decay, every = self.config.decay, self.config.decay_every
        return LambdaLR(optimizer, lambda step: decay ** (step // every))
