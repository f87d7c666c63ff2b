"""A task written against the first release's interface, and kept unchanged since.

A plain class (no TaskBase), with the first release's members only: the four methods, a mean
loss, `evaluation_sums` with a "count" entry, and `metric_names`. No throughput_unit,
units_per_sample, flops_per_sample or test_settings: the trainer takes their defaults from
contract.py. It uses the classifier example's TaskConfig, so config.py stays as rendered.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, TensorDataset

from .config import TaskConfig


def make_blobs(config: TaskConfig, num_samples: int, seed: int, split: int) -> TensorDataset:
    """Gaussian clusters, one per class, deterministic from the seed."""
    centres = torch.randn(
        config.num_classes, config.input_dim, generator=torch.Generator().manual_seed(seed)
    )
    generator = torch.Generator().manual_seed(seed * 1000 + split + 1)
    labels = torch.randint(config.num_classes, (num_samples,), generator=generator)
    noise = torch.randn(num_samples, config.input_dim, generator=generator)
    return TensorDataset(centres[labels] * 0.5 + noise, labels)


class Task:
    """Classification of synthetic Gaussian blobs with an MLP."""

    metric_names = ("loss", "accuracy")

    def __init__(self, config: TaskConfig, seed: int) -> None:
        self.config = config
        self.seed = seed

    def build_model(self) -> nn.Module:
        config = self.config
        return nn.Sequential(
            nn.Linear(config.input_dim, config.hidden_dim),
            nn.ReLU(),
            nn.Dropout(config.dropout),
            nn.Linear(config.hidden_dim, config.num_classes),
        )

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        train = make_blobs(self.config, self.config.num_train_samples, self.seed, split=0)
        evaluation = make_blobs(self.config, self.config.num_eval_samples, self.seed, split=1)
        return train, evaluation

    def training_loss(
        self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        inputs, labels = batch
        return F.cross_entropy(model(inputs), labels)

    def evaluation_sums(
        self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        inputs, labels = batch
        logits = model(inputs).double()
        return {
            "loss": F.cross_entropy(logits, labels, reduction="sum"),
            "accuracy": (logits.argmax(dim=-1) == labels).sum(),
            "count": torch.tensor(labels.numel(), device=labels.device),
        }
