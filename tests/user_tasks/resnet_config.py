"""The TaskConfig of resnet_task.py: replaces the `class TaskConfig` block of config.py.

The imports are for linting this file alone; the test takes the text from `@dataclass` on.
"""

from dataclasses import dataclass

from .config import ConfigError


@dataclass
class TaskConfig:
    """torchvision's ResNet-18 on CIFAR-10, or on synthetic images (see task.py).

    `data_dir`: where CIFAR-10 lies (download it once beforehand, e.g. with
    `torchvision.datasets.CIFAR10(data_dir, download=True)`: every rank reads it, none
    downloads); empty: synthetic images generated from run.seed, nothing to download.
    """

    #: The CIFAR-10 directory; empty: synthetic images.
    data_dir: str = ""
    #: Synthetic training images (ignored with data_dir).
    num_train_samples: int = 8192
    #: Synthetic evaluation images (ignored with data_dir).
    num_eval_samples: int = 1000
    #: Height and width of the synthetic images (CIFAR-10: 32).
    image_size: int = 32
    #: Classes to tell apart (CIFAR-10: 10).
    num_classes: int = 10
    #: Padding of the random crop, in pixels; 0: no crop.
    crop_padding: int = 4
    #: Replace the ImageNet stem (7x7 stride-2 convolution, max pooling) by a 3x3 convolution
    #: that keeps the resolution, as is usual for 32x32 images.
    cifar_stem: bool = True

    def validate(self) -> None:
        """The task's own range checks; config.validate() calls them after its own."""
        for key in ("num_train_samples", "num_eval_samples", "image_size"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"task.{key} must be positive, got {getattr(self, key)}")
        if self.num_classes < 2:
            raise ConfigError(f"task.num_classes must be at least 2, got {self.num_classes}")
        if self.crop_padding < 0:
            raise ConfigError(f"task.crop_padding must be >= 0, got {self.crop_padding}")
