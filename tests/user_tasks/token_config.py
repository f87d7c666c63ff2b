"""The TaskConfig of token_task.py: replaces the `class TaskConfig` block of config.py.

The imports are for linting this file alone; the test takes the text from `@dataclass` on.
"""

from dataclasses import dataclass

from .config import ConfigError


@dataclass
class TaskConfig:
    """Next-token prediction on variable-length token sequences (see task.py).

    The sequences are generated from run.seed: each counts up from a random token with a
    random stride, so a small recurrent model learns them within a few hundred steps.
    """

    #: Sequences in the generated training set.
    num_train_samples: int = 8192
    #: Sequences in the generated evaluation set.
    num_eval_samples: int = 512
    #: Tokens in the vocabulary, the padding token 0 included.
    vocab_size: int = 32
    #: Fewest tokens in a sequence.
    min_length: int = 3
    #: Most tokens in a sequence; batches are padded to their longest.
    max_length: int = 24
    #: Width of the embedding and of the recurrent state.
    embed_dim: int = 64
    #: Stacked GRU layers.
    num_layers: int = 1
    #: Dropout probability on the embeddings.
    dropout: float = 0.1

    def validate(self) -> None:
        """The task's own range checks; config.validate() calls them after its own."""
        for key in ("num_train_samples", "num_eval_samples", "embed_dim", "num_layers"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"task.{key} must be positive, got {getattr(self, key)}")
        if self.vocab_size < 3:
            raise ConfigError(f"task.vocab_size must be at least 3, got {self.vocab_size}")
        if not 2 <= self.min_length <= self.max_length:
            raise ConfigError(
                f"task.min_length={self.min_length} and task.max_length={self.max_length} must "
                "satisfy 2 <= min_length <= max_length: a sequence of n tokens has n - 1 targets"
            )
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"task.dropout must be in [0, 1), got {self.dropout}")
