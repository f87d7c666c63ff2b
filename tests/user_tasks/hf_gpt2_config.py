"""The TaskConfig of hf_gpt2_task.py as a project of before 1.0 held it, in config.py:
tests/test_user_tasks.py keeps it in config.py, as a project that has not moved it.

The imports are for linting this file alone; the test takes the text from `@dataclass` on.
"""

from dataclasses import dataclass

from .config import ConfigError


@dataclass
class TaskConfig:
    """A Hugging Face GPT-2 built from a tiny GPT2Config (no download) on token sequences.

    The sequences are generated from run.seed: each counts up from a random token with a
    random stride, `min_length` to `max_length` tokens long (at most `n_positions`).
    """

    #: Sequences in the generated training set.
    num_train_samples: int = 8192
    #: Sequences in the generated evaluation set.
    num_eval_samples: int = 512
    #: Fewest tokens in a sequence.
    min_length: int = 3
    #: Most tokens in a sequence; batches are padded to their longest.
    max_length: int = 24
    #: GPT2Config.vocab_size: tokens in the vocabulary, the padding token 0 included.
    vocab_size: int = 64
    #: GPT2Config.n_positions: the longest input the model takes.
    n_positions: int = 32
    #: GPT2Config.n_layer: transformer blocks.
    n_layer: int = 2
    #: GPT2Config.n_head: attention heads per block.
    n_head: int = 2
    #: GPT2Config.n_embd: embedding width.
    n_embd: int = 32
    #: GPT2Config's resid_pdrop, embd_pdrop and attn_pdrop.
    dropout: float = 0.1

    def validate(self) -> None:
        """The task's own range checks; config.validate() calls them after its own."""
        for key in ("num_train_samples", "num_eval_samples", "n_layer", "n_head", "n_embd"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"task.{key} must be positive, got {getattr(self, key)}")
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"task.n_embd={self.n_embd} must be a multiple of task.n_head={self.n_head}"
            )
        if self.vocab_size < 3:
            raise ConfigError(f"task.vocab_size must be at least 3, got {self.vocab_size}")
        if not 2 <= self.min_length <= self.max_length <= self.n_positions + 1:
            raise ConfigError(
                f"task.min_length={self.min_length} and task.max_length={self.max_length} must "
                f"satisfy 2 <= min_length <= max_length <= task.n_positions + 1 = "
                f"{self.n_positions + 1}: a sequence of n tokens is n - 1 inputs and targets"
            )
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"task.dropout must be in [0, 1), got {self.dropout}")
