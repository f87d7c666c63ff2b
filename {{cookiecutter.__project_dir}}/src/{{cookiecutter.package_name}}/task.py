"""The problem being solved: data, model, loss and metrics. This is the file you edit.

The trainer only calls the methods of `Task`; it never looks inside a batch or a model. To train
your own model, replace the data set, the model and the two loss/metric methods below, and the
settings in `TaskConfig` (config.py). Nothing here knows about ranks, devices or DDP: the trainer
moves batches to the device, wraps the model, and reduces the metrics across ranks.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, TensorDataset

from .config import TaskConfig


def make_blobs(config: TaskConfig, num_samples: int, seed: int, split: int) -> TensorDataset:
    """Gaussian clusters, one per class: deterministic from the seed, nothing to download.

    The class centres depend only on `seed`, so the train and eval splits share them; the samples
    depend on `split` too, so the two splits hold different points.
    """
    centres = torch.randn(
        config.num_classes, config.input_dim, generator=torch.Generator().manual_seed(seed)
    )
    generator = torch.Generator().manual_seed(seed * 1000 + split + 1)
    labels = torch.randint(config.num_classes, (num_samples,), generator=generator)
    noise = torch.randn(num_samples, config.input_dim, generator=generator)
    return TensorDataset(centres[labels] * 0.5 + noise, labels)


class Classifier(nn.Module):
    """A small MLP; swap in your own architecture."""

    def __init__(self, config: TaskConfig) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(config.input_dim, config.hidden_dim),
            nn.GELU(),
            nn.Dropout(config.dropout),
            nn.Linear(config.hidden_dim, config.hidden_dim),
            nn.GELU(),
            nn.Linear(config.hidden_dim, config.num_classes),
        )

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs)


class Task:
    """Classification of synthetic Gaussian blobs."""

    #: What `evaluation_sums` returns besides "count"; each is reported as sum / count.
    metric_names: tuple[str, ...] = ("loss", "accuracy")
    #: Throughput is reported in these units per second; one sample holds `units_per_sample`.
    throughput_unit: str = "samples"
    units_per_sample: int = 1

    def __init__(self, config: TaskConfig, seed: int) -> None:
        self.config = config
        self.seed = seed

    def build_model(self) -> nn.Module:
        return Classifier(self.config)

    def flops_per_sample(self, model: nn.Module) -> float:
        """Training FLOPs (forward and backward) for one sample: what MFU is computed from.

        An MLP is all matrix products: 2 FLOPs per weight and sample forward, 4 backward.
        """
        return 6.0 * sum(param.numel() for param in model.parameters() if param.dim() > 1)

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        """(train, eval) data sets."""
        train = make_blobs(self.config, self.config.num_train_samples, self.seed, split=0)
        evaluation = make_blobs(self.config, self.config.num_eval_samples, self.seed, split=1)
        return train, evaluation

    def training_loss(
        self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """Mean loss over the micro-batch; the trainer handles accumulation and scaling."""
        inputs, labels = batch
        return F.cross_entropy(model(inputs), labels)

    def evaluation_sums(
        self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Per-batch sums of each metric plus the sample count: sums stay exact across ranks."""
        inputs, labels = batch
        logits = model(inputs).double()  # float64 sums stay exact when added up across ranks
        return {
            "loss": F.cross_entropy(logits, labels, reduction="sum"),
            "accuracy": (logits.argmax(dim=-1) == labels).sum(),
            "count": torch.tensor(labels.numel(), device=labels.device),
        }
