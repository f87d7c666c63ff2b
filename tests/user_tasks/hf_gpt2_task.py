"""A user's task: a Hugging Face `transformers` GPT-2, built from a tiny GPT2Config.

Nothing is downloaded: the model is `GPT2LMHeadModel(GPT2Config(...))`, with random weights
(GPT-2 ties its output head to the token embedding). To fine-tune released weights, build it
with `GPT2LMHeadModel.from_pretrained(name)` in `build_model` instead (a download on first
use), or point `init.weights` at a .safetensors file of the same architecture.

Batches are dicts padded by `collate` (attention_mask, labels -100 on padding); the loss is
computed from the logits as (sum over the real tokens, their number), not the model's own mean
loss, so that micro-batches with more real tokens weigh more; throughput counts real tokens.
"""

from __future__ import annotations

from typing import Any

import numpy
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel

from .config import TaskConfig
from .contract import TaskBase

PAD_ID = 0
IGNORE = -100


class TokenSequences(Dataset):
    """Sequences that count up from a random token with a random stride (modulo the
    vocabulary, skipping the padding token): deterministic from the seed and the split."""

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


def gpt2_config(config: TaskConfig) -> GPT2Config:
    return GPT2Config(
        vocab_size=config.vocab_size,
        n_positions=config.n_positions,
        n_layer=config.n_layer,
        n_head=config.n_head,
        n_embd=config.n_embd,
        resid_pdrop=config.dropout,
        embd_pdrop=config.dropout,
        attn_pdrop=config.dropout,
        bos_token_id=config.vocab_size - 1,
        eos_token_id=config.vocab_size - 1,
        pad_token_id=PAD_ID,
        use_cache=False,  # training: no key/value cache returned
    )


class Task(TaskBase):
    """Next-token prediction with GPT2LMHeadModel on padded token sequences."""

    throughput_unit = "tokens"
    #: Small and quick: what the generated tests train with.
    test_settings = (
        "task.num_train_samples=512",
        "task.num_eval_samples=128",
        "task.max_length=16",
        "task.n_layer=1",
    )

    def __init__(self, config: TaskConfig, seed: int) -> None:
        self.config = config
        self.seed = seed

    def build_model(self) -> nn.Module:
        # GPT2LMHeadModel.from_pretrained("gpt2") here would load released weights instead.
        return GPT2LMHeadModel(gpt2_config(self.config))

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        train = TokenSequences(self.config, self.config.num_train_samples, self.seed, split=0)
        evaluation = TokenSequences(self.config, self.config.num_eval_samples, self.seed, split=1)
        return train, evaluation

    def collate(self, samples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Pad on the right to the longest sequence of the batch: causal attention keeps the
        real tokens from seeing the padding, and the loss ignores the padded targets."""
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
        """Weight decay on the attention and MLP matrices only: not on biases, LayerNorms and
        the embeddings (the token embedding is also the head: one tensor, listed once)."""
        skipped = {
            id(param)
            for module in model.modules()
            if isinstance(module, (nn.Embedding, nn.LayerNorm))
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

    def _logits(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # The labels are already the next tokens, so they are not passed: the model's own loss
        # would shift them again, and average over the micro-batch.
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits

    def training_loss(
        self, model: nn.Module, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of the real tokens' losses, number of real tokens)."""
        logits = self._logits(model, batch)
        labels = batch["labels"]
        loss_sum = F.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum"
        )
        return loss_sum, (labels != IGNORE).sum()

    def evaluation_sums(
        self, model: nn.Module, batch: dict[str, torch.Tensor]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        logits = self._logits(model, batch).double()
        labels = batch["labels"]
        real = labels != IGNORE
        tokens = real.sum()
        loss = F.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum"
        )
        correct = ((logits.argmax(dim=-1) == labels) & real).sum()
        return {"loss": (loss, tokens), "accuracy": (correct, tokens)}
