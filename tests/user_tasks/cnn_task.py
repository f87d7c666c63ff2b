"""A user's task: a small CNN on synthetic images, with random flips as augmentation.

The images are NumPy arrays made from the seed; the training set flips them at random with
NumPy's global generator in `__getitem__`, as augmentation code often does (the trainer seeds,
saves and restores that generator on every rank). Batches are (images, labels) tuples and the
loss is the micro-batch's mean: nothing here but the four required methods, the throughput's
unit and the test settings, in a class of its own (the contract does not ask a task to derive
from TaskBase: its defaults fill in the rest).
"""

from __future__ import annotations

import numpy
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from .config import TaskConfig


def make_images(
    config: TaskConfig, num_samples: int, seed: int, split: int
) -> tuple[numpy.ndarray, numpy.ndarray]:
    """(images, labels): each class's pattern plus noise, deterministic from seed and split.

    The patterns depend only on `seed`, so both splits share them; each is made symmetric
    under left-right and up-down flips, which therefore keep an image's class.
    """
    size = config.image_size
    patterns = numpy.random.default_rng(seed).normal(size=(config.num_classes, size, size))
    patterns = patterns + patterns[:, ::-1, :] + patterns[:, :, ::-1] + patterns[:, ::-1, ::-1]
    patterns /= patterns.std(axis=(1, 2), keepdims=True)
    rng = numpy.random.default_rng([seed, split + 1])
    labels = rng.integers(config.num_classes, size=num_samples)
    noise = rng.normal(scale=config.noise, size=(num_samples, size, size))
    return (patterns[labels] + noise).astype(numpy.float32), labels


class Images(Dataset):
    """(image of shape 1 x H x W, label); flipped at random when `flip_prob` > 0."""

    def __init__(self, images: numpy.ndarray, labels: numpy.ndarray, flip_prob: float) -> None:
        self.images, self.labels, self.flip_prob = images, labels, flip_prob

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.images[index]
        if numpy.random.random() < self.flip_prob:
            image = image[:, ::-1]
        if numpy.random.random() < self.flip_prob:
            image = image[::-1, :]
        return torch.from_numpy(image.copy()).unsqueeze(0), int(self.labels[index])


class SmallCNN(nn.Module):
    def __init__(self, config: TaskConfig) -> None:
        super().__init__()
        channels = config.channels
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(channels, 2 * channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * channels),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.classifier = nn.Linear(2 * channels, config.num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images))


class Task:
    """Classification of noisy synthetic images."""

    throughput_unit = "images"
    #: Small and quick: what the generated tests train with.
    test_settings = (
        "task.num_train_samples=512",
        "task.num_eval_samples=128",
        "task.channels=4",
    )

    def __init__(self, config: TaskConfig, seed: int) -> None:
        self.config = config
        self.seed = seed

    def build_model(self) -> nn.Module:
        return SmallCNN(self.config)

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        config = self.config
        train = Images(
            *make_images(config, config.num_train_samples, self.seed, 0), config.flip_prob
        )
        evaluation = Images(*make_images(config, config.num_eval_samples, self.seed, 1), 0.0)
        return train, evaluation

    def training_loss(
        self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(model(images), labels)

    def evaluation_sums(
        self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        images, labels = batch
        logits = model(images).double()
        return {
            "loss": F.cross_entropy(logits, labels, reduction="sum"),
            "accuracy": (logits.argmax(dim=-1) == labels).sum(),
            "count": torch.tensor(labels.numel(), device=labels.device),
        }
