"""A user's task: torchvision's ResNet-18 with random crops and flips (torchvision.transforms).

On CIFAR-10 from `task.data_dir` (downloaded beforehand), or on synthetic images, one pattern
per class plus noise, when it is empty (the tests). The transforms draw from torch's global
generator, which the trainer seeds per rank and restores on resume. ResNet's BatchNorm layers
normalize with each rank's micro-batch: see the trainer's warning and docs/bring-your-own-model.md.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torchvision
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, TensorDataset
from torchvision.transforms import v2

from .config import ConfigError, TaskConfig
from .contract import TaskBase

#: CIFAR-10's per-channel mean and standard deviation.
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def synthetic_images(config: TaskConfig, num_samples: int, seed: int, split: int) -> TensorDataset:
    """3-channel images: one random pattern per class plus noise, deterministic from the seed."""
    size = config.image_size
    patterns = torch.randn(
        config.num_classes, 3, size, size, generator=torch.Generator().manual_seed(seed)
    )
    generator = torch.Generator().manual_seed(seed * 1000 + split + 1)
    labels = torch.randint(config.num_classes, (num_samples,), generator=generator)
    noise = torch.randn(num_samples, 3, size, size, generator=generator)
    return TensorDataset(patterns[labels] + noise, labels)


class Transformed(Dataset):
    """Applies `transform` to the image of each (image, label) item."""

    def __init__(self, dataset: Dataset, transform: v2.Transform) -> None:
        self.dataset, self.transform = dataset, transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, label = self.dataset[index]
        return self.transform(image), int(label)


class Task(TaskBase):
    """Image classification with torchvision's ResNet-18."""

    throughput_unit = "images"
    #: Small and quick: what the generated tests train with.
    test_settings = (
        "task.num_train_samples=512",
        "task.num_eval_samples=128",
        "task.image_size=16",
        "task.num_classes=4",
        "task.crop_padding=2",
    )

    def __init__(self, config: TaskConfig, seed: int) -> None:
        self.config = config
        self.seed = seed

    def build_model(self) -> nn.Module:
        model = torchvision.models.resnet18(weights=None, num_classes=self.config.num_classes)
        if self.config.cifar_stem:
            model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
            model.maxpool = nn.Identity()
        return model

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        config = self.config
        augment: list[v2.Transform] = [v2.RandomHorizontalFlip()]
        if config.crop_padding:
            augment.insert(0, v2.RandomCrop(config.image_size, padding=config.crop_padding))
        if not config.data_dir:
            train = synthetic_images(config, config.num_train_samples, self.seed, split=0)
            evaluation = synthetic_images(config, config.num_eval_samples, self.seed, split=1)
            return Transformed(train, v2.Compose(augment)), evaluation
        if not (Path(config.data_dir) / "cifar-10-batches-py").is_dir():
            raise ConfigError(
                f"task.data_dir={config.data_dir} holds no CIFAR-10: download it once with "
                f"torchvision.datasets.CIFAR10({config.data_dir!r}, download=True)"
            )
        to_tensor = [v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]
        normalize = [v2.Normalize(CIFAR_MEAN, CIFAR_STD)]
        train = torchvision.datasets.CIFAR10(
            config.data_dir, train=True, transform=v2.Compose(to_tensor + augment + normalize)
        )
        evaluation = torchvision.datasets.CIFAR10(
            config.data_dir, train=False, transform=v2.Compose(to_tensor + normalize)
        )
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
