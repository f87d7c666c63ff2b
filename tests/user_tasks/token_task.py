"""A user's task: next-token prediction on variable-length token sequences.

Batches are dicts padded by the task's own `collate`; the loss is a sum over the real tokens
with their count, so that micro-batches holding different numbers of tokens weigh by their
tokens; throughput is counted in real tokens; the optimizer has two named parameter groups;
the input and output embeddings are one tensor; and the task keeps a counter of the batches it
trained on in every checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from .config import ConfigError
from .contract import TaskBase


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


PAD_ID = 0
IGNORE = -100


class TokenSequences(Dataset):
    """Sequences of `min_length` to `max_length` tokens that count up from a random token with a
    random stride (modulo the vocabulary, skipping the padding token): deterministic from the
    seed and the split."""

    def __init__(self, config: TaskConfig, num_samples: int, seed: int, split: int) -> None:
        rng = numpy.random.default_rng([seed, split])
        lengths = rng.integers(config.min_length, config.max_length + 1, size=num_samples)
        starts = rng.integers(0, config.vocab_size - 1, size=num_samples)
        strides = rng.integers(1, 4, size=num_samples)
        self.sequences = [
            torch.from_numpy(1 + (start + stride * numpy.arange(length)) % (config.vocab_size - 1))
            for length, start, stride in zip(lengths, starts, strides, strict=True)
        ]

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.sequences[index]


class TokenModel(nn.Module):
    """Embedding, GRU and a head that shares its matrix with the embedding."""

    def __init__(self, config: TaskConfig) -> None:
        super().__init__()
        self.embedding = nn.Embedding(config.vocab_size, config.embed_dim)
        self.dropout = nn.Dropout(config.dropout)
        self.rnn = nn.GRU(config.embed_dim, config.embed_dim, config.num_layers, batch_first=True)
        self.norm = nn.LayerNorm(config.embed_dim)
        self.head = nn.Linear(config.embed_dim, config.vocab_size, bias=False)
        self.head.weight = self.embedding.weight  # tied: one tensor under two names
        # Small, as in GPT-2: the embedding is also the head, whose logits start near zero.
        nn.init.normal_(self.embedding.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # The GRU reads left to right and the padding comes last, so a real token's output never
        # depends on the padding, and the padded labels (-100) leave it out of the loss: this
        # model needs no attention mask (a bidirectional one would).
        # The embedding's small values are scaled up to unit size on the way in.
        embedded = self.embedding(input_ids) * self.embedding.embedding_dim**0.5
        hidden, _ = self.rnn(self.dropout(embedded))
        return self.head(self.norm(hidden))


class Task(TaskBase):
    """Next-token prediction on padded token sequences."""

    throughput_unit = "tokens"
    #: Small and quick: what the generated tests train with.
    test_settings = (
        "task.num_train_samples=512",
        "task.num_eval_samples=128",
        "task.max_length=16",
        "task.embed_dim=32",
    )

    def __init__(self, config: TaskConfig, seed: int) -> None:
        self.config = config
        self.seed = seed
        #: Micro-batches trained on (by this rank): the task's own state, in every checkpoint.
        self.batches_seen = 0

    def build_model(self) -> nn.Module:
        return TokenModel(self.config)

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        train = TokenSequences(self.config, self.config.num_train_samples, self.seed, split=0)
        evaluation = TokenSequences(self.config, self.config.num_eval_samples, self.seed, split=1)
        return train, evaluation

    def collate(self, samples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Pad to the longest sequence of the batch; padded targets are ignored by the loss."""
        width = max(len(tokens) for tokens in samples) - 1
        input_ids = torch.full((len(samples), width), PAD_ID, dtype=torch.long)
        labels = torch.full((len(samples), width), IGNORE, dtype=torch.long)
        attention_mask = torch.zeros((len(samples), width), dtype=torch.long)
        for row, tokens in enumerate(samples):
            length = len(tokens) - 1
            input_ids[row, :length] = tokens[:-1]
            labels[row, :length] = tokens[1:]
            attention_mask[row, :length] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}

    def param_groups(self, model: nn.Module) -> list[dict[str, Any]]:
        """Weight decay on the GRU's matrices only: not on biases, the norm or the embedding
        (which is also the head)."""
        no_decay_modules = (nn.Embedding, nn.LayerNorm)
        skipped = {
            id(param)
            for module in model.modules()
            if isinstance(module, no_decay_modules)
            for param in module.parameters(recurse=False)
        }
        decay, no_decay = [], []
        for param in model.parameters():
            (no_decay if param.dim() < 2 or id(param) in skipped else decay).append(param)
        return [
            {"name": "decay", "params": decay},
            {"name": "no_decay", "params": no_decay, "weight_decay": 0.0},
        ]

    def units(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Real tokens, not padding."""
        return (batch["labels"] != IGNORE).sum()

    def training_loss(
        self, model: nn.Module, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of the real tokens' losses, number of real tokens)."""
        self.batches_seen += 1
        logits = model(batch["input_ids"], batch["attention_mask"])
        labels = batch["labels"]
        loss_sum = F.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum"
        )
        return loss_sum, (labels != IGNORE).sum()

    def evaluation_sums(
        self, model: nn.Module, batch: dict[str, torch.Tensor]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Each metric with its own count: the real tokens."""
        logits = model(batch["input_ids"], batch["attention_mask"]).double()
        labels = batch["labels"]
        real = labels != IGNORE
        tokens = real.sum()
        loss = F.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum"
        )
        correct = ((logits.argmax(dim=-1) == labels) & real).sum()
        return {"loss": (loss, tokens), "accuracy": (correct, tokens)}

    def evaluation_metrics(self, totals: dict[str, Any]) -> dict[str, float]:
        """Loss and accuracy per real token, the perplexity, and the batches trained on so far
        (the task's state: equal to an unbroken run's only if resuming restored it)."""
        metrics = super().evaluation_metrics(totals)
        metrics["perplexity"] = math.exp(min(metrics["loss"], 50.0))
        metrics["batches_seen"] = float(self.batches_seen)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {"batches_seen": self.batches_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches_seen = state["batches_seen"]
