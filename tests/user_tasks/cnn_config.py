"""The TaskConfig of cnn_task.py as a project of before 1.0 held it, in config.py:
tests/test_user_tasks.py moves it into task.py by the CHANGELOG's steps.

The imports are for linting this file alone; the test takes the text from `@dataclass` on.
"""

from dataclasses import dataclass

from .config import ConfigError


@dataclass
class TaskConfig:
    """Classification of small synthetic images with a CNN (see task.py).

    Each class has a pattern of `image_size` x `image_size` pixels, symmetric under flips, drawn
    from run.seed; a sample is its class's pattern plus Gaussian noise of `noise` standard
    deviations. Training samples are flipped at random (`flip_prob`), which keeps their class.
    """

    #: Images in the generated training set.
    num_train_samples: int = 4096
    #: Images in the generated evaluation set.
    num_eval_samples: int = 512
    #: Classes (patterns) to tell apart.
    num_classes: int = 4
    #: Height and width of the images, in pixels.
    image_size: int = 8
    #: Standard deviation of the noise added to each pixel.
    noise: float = 1.0
    #: Channels of the first convolution; the second has twice as many.
    channels: int = 8
    #: Probability of each random flip (left-right, up-down) of a training image.
    flip_prob: float = 0.5

    def validate(self) -> None:
        """The task's own range checks; config.validate() calls them after its own."""
        for key in ("num_train_samples", "num_eval_samples", "channels"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"task.{key} must be positive, got {getattr(self, key)}")
        if self.num_classes < 2:
            raise ConfigError(f"task.num_classes must be at least 2, got {self.num_classes}")
        if self.image_size < 4 or self.image_size % 2:
            raise ConfigError(f"task.image_size must be even and >= 4, got {self.image_size}")
        if self.noise < 0:
            raise ConfigError(f"task.noise must be >= 0, got {self.noise}")
        if not 0 <= self.flip_prob <= 1:
            raise ConfigError(f"task.flip_prob must be in [0, 1], got {self.flip_prob}")
