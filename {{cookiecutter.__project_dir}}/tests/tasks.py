"""Tasks unlike the shipped example, for the tests of the Task contract (contract.py).

They ignore the project's TaskConfig, so these tests hold whatever task.py the project has:
- `TokenTask`: variable-length token sequences in dict batches, padded by its own `collate`,
  a (sum, count) loss over the real tokens with a logged component, throughput in real tokens,
  two named parameter groups, tied input and output weights, metrics with their own counts and
  an F1 derived from the totals, and state of its own in checkpoints.
- `SgdTokenTask`: the same with an optimizer and a schedule of its own: SGD with Nesterov
  momentum (a group option of SGD's) and a cosine schedule over the run's steps.
- `FirstReleaseTask`: written against the first release's interface: no base class, a mean
  loss, `metric_names`, and none of the members added since.
- `VocabularyTask`: a model sized by a file of its data, which it gives the export.
- `TwoPlayerTask`: a GAN's alternating updates (`updates`): the critic's step, then the
  generator's, each with an optimizer of its own.
- `LazyTask`, `CheckpointedTwiceTask`, `CompiledTask`: the first release's task with a model
  DDP does not take as it is: lazy modules, a block checkpointed twice, torch.compile's wrapper.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import Dataset, TensorDataset

from {{ cookiecutter.package_name }}.contract import TaskBase

VOCAB = 16
PAD = -100


class Sequences(Dataset):
    """Token sequences of 3 to 12 tokens, deterministic from the seed; item i is a dict."""

    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(3, 13, (size,), generator=generator)
        self.items = [torch.randint(VOCAB, (int(n),), generator=generator) for n in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"tokens": self.items[index]}


class TiedTokenModel(nn.Module):
    """Per-token next-token logits through an embedding whose matrix is also the output head."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 8)
        self.hidden = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, VOCAB, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.tanh(self.hidden(self.embedding(input_ids)))))


class TokenTask(TaskBase):
    """Next-token prediction on padded sequences; `mean_loss=True` averages each micro-batch
    instead (what the (sum, count) form exists to avoid)."""

    throughput_unit = "tokens"

    def __init__(
        self, config: Any, seed: int, dtype: torch.dtype = torch.float32, mean_loss: bool = False
    ) -> None:
        self.seed = seed
        self.dtype = dtype
        self.mean_loss = mean_loss
        self.batches_seen = 0

    def build_model(self) -> nn.Module:
        return TiedTokenModel().to(self.dtype)

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        return Sequences(256, self.seed), Sequences(37, self.seed + 1)

    def collate(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Inputs and next-token labels padded to the longest sequence; padding is labelled -100."""
        width = max(len(sample["tokens"]) for sample in samples) - 1
        input_ids = torch.zeros(len(samples), width, dtype=torch.long)
        labels = torch.full((len(samples), width), PAD, dtype=torch.long)
        for row, sample in enumerate(samples):
            tokens = sample["tokens"]
            input_ids[row, : len(tokens) - 1] = tokens[:-1]
            labels[row, : len(tokens) - 1] = tokens[1:]
        return {"input_ids": input_ids, "labels": labels}

    def training_loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict:
        self.batches_seen += 1
        logits = model(batch["input_ids"]).flatten(0, 1)
        labels = batch["labels"].flatten()
        real = labels != PAD
        loss_sum = F.cross_entropy(logits, labels, ignore_index=PAD, reduction="sum")
        z_sum = (torch.logsumexp(logits, dim=-1) ** 2 * real).sum()
        if self.mean_loss:
            return loss_sum / real.sum()
        return {"loss": loss_sum, "count": real.sum(), "z_loss": z_sum}

    def units(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return (batch["labels"] != PAD).sum()

    def evaluation_sums(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict:
        logits = model(batch["input_ids"]).double().flatten(0, 1)
        labels = batch["labels"].flatten()
        real = labels != PAD
        predicted = logits.argmax(dim=-1)
        # Token 0 as the positive class of a binary F1: its counts add up across ranks.
        positive, predicted_positive = (labels == 0) & real, (predicted == 0) & real
        return {
            "loss": (
                F.cross_entropy(logits, labels, ignore_index=PAD, reduction="sum"),
                real.sum(),
            ),
            "accuracy": (((predicted == labels) & real).sum(), real.sum()),
            "true_positives": (positive & predicted_positive).sum(),
            "false_positives": (~positive & predicted_positive).sum(),
            "false_negatives": (positive & ~predicted_positive).sum(),
        }

    def evaluation_metrics(self, totals: dict[str, Any]) -> dict[str, float]:
        tp, fp, fn = (
            totals[f"{kind}s"] for kind in ("true_positive", "false_positive", "false_negative")
        )
        loss, tokens = totals["loss"]
        correct, _ = totals["accuracy"]
        f1 = 2 * tp / max(2 * tp + fp + fn, 1)
        return {"loss": loss / tokens, "accuracy": correct / tokens, "f1": f1}

    def param_groups(self, model: nn.Module) -> list[dict[str, Any]]:
        matrices = [model.hidden.weight]
        rest = [param for param in model.parameters() if param is not model.hidden.weight]
        return [
            {"name": "matrices", "params": matrices},
            {"name": "embeddings_biases_norms", "params": rest, "weight_decay": 0.0},
        ]

    def state_dict(self) -> dict[str, Any]:
        return {"batches_seen": self.batches_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches_seen = state["batches_seen"]


class VocabularyTask(TokenTask):
    """An embedding with a row per line of a vocabulary file of the data (`path`), read when
    first needed, as the gpt example reads its shards' manifest. The export gets the size
    (`model_settings`) and the file (`export_files`)."""

    #: The data's vocabulary file, one token a line; each test sets its own.
    path = Path("vocabulary.txt")

    def __init__(self, config: Any, seed: int) -> None:
        super().__init__(config, seed)
        self.size: int | None = None

    def build_model(self) -> nn.Module:
        if self.size is None:
            self.size = len(self.path.read_text().splitlines())
        return nn.Embedding(self.size, 4)

    def model_settings(self) -> dict[str, Any]:
        return {"size": self.size}

    def load_model_settings(self, settings: dict[str, Any]) -> None:
        self.size = settings["size"]

    def export_files(self) -> dict[str, Path]:
        return {"vocabulary.txt": self.path}


class SgdTokenTask(TokenTask):
    """TokenTask trained by SGD with Nesterov momentum (a lower momentum for the embeddings,
    biases and norms) under a cosine schedule that keeps its shape in its own state."""

    def param_groups(self, model: nn.Module) -> list[dict[str, Any]]:
        groups = super().param_groups(model)
        groups[1]["momentum"] = 0.5
        return groups

    def build_optimizer(
        self, param_groups: list[dict[str, Any]], optim: Any
    ) -> torch.optim.Optimizer:
        return torch.optim.SGD(param_groups, lr=optim.lr, momentum=0.9, nesterov=True)

    def build_scheduler(
        self, optimizer: torch.optim.Optimizer, total_steps: int, optim: Any
    ) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)


class FirstReleaseTask:
    """A task of release 0.1's interface: an MLP on random features, with NumPy augmentation."""

    metric_names = ("loss", "accuracy")

    def __init__(self, config: Any, seed: int) -> None:
        self.seed = seed

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 3))

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        generator = torch.Generator().manual_seed(self.seed)
        inputs, labels = torch.randn(300, 4, generator=generator), torch.randint(3, (300,))
        return NumpyJitter(TensorDataset(inputs[:256], labels[:256])), TensorDataset(
            inputs[256:], labels[256:]
        )

    def training_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        inputs, labels = batch
        return F.cross_entropy(model(inputs), labels)

    def evaluation_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        inputs, labels = batch
        logits = model(inputs).double()
        return {
            "loss": F.cross_entropy(logits, labels, reduction="sum"),
            "accuracy": (logits.argmax(dim=-1) == labels).sum(),
            "count": torch.tensor(labels.numel()),
        }


class NumpyJitter(Dataset):
    """Adds noise drawn from NumPy's global generator, as augmentation code often does."""

    def __init__(self, dataset: TensorDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, label = self.dataset[index]
        noise = torch.from_numpy(numpy.random.normal(0.0, 0.1, size=inputs.shape))
        return inputs + noise.to(inputs.dtype), label


class TwoPlayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.critic = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))


class TwoPlayerTask(TaskBase):
    """A GAN in miniature: each sample is a point and the generator's noise for it; the critic
    learns to tell points from generated ones, then the generator learns to fool it. SGD for
    the critic, Adam for the generator."""

    updates = ("critic", "generator")

    def __init__(self, config: Any, seed: int) -> None:
        self.seed = seed

    def build_model(self) -> nn.Module:
        return TwoPlayers()

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        generator = torch.Generator().manual_seed(self.seed)
        points = torch.randn(300, 2, generator=generator) * 0.5 + 1.0
        noise = torch.randn(300, 4, generator=generator)
        return TensorDataset(points[:256], noise[:256]), TensorDataset(points[256:], noise[256:])

    def build_optimizer(
        self, param_groups: list[dict[str, Any]], optim: Any, update: str | None = None
    ) -> torch.optim.Optimizer:
        if update == "critic":
            return torch.optim.SGD(param_groups, lr=optim.lr, momentum=0.9)
        return torch.optim.Adam(param_groups, lr=optim.lr, betas=(0.5, 0.999))

    def training_loss(self, model: Any, batch: Any, update: str | None = None) -> torch.Tensor:
        points, noise = batch
        if update == "critic":
            with torch.no_grad():
                fake = model.generator(noise)
            return F.softplus(-model.critic(points)).mean() + F.softplus(model.critic(fake)).mean()
        return F.softplus(-model.critic(model.generator(noise))).mean()

    def evaluation_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        points, noise = batch
        fooled = model.critic(model.generator(noise)) > 0
        return {"fooled": fooled.sum(), "count": torch.tensor(len(points))}


class LazyTask(FirstReleaseTask):
    """Lazy modules: a linear layer and a BatchNorm whose sizes come from the first batch."""

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.LazyLinear(16), nn.LazyBatchNorm1d(), nn.ReLU(), nn.Linear(16, 3))


class TwiceThroughOneBlock(nn.Module):
    """One block applied twice, each time under activation checkpointing."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.embed = nn.Linear(4, 16)
        self.block = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(inputs)
        for _ in range(2):
            hidden = checkpoint(self.block, hidden, use_reentrant=self.reentrant).relu()
        return self.head(hidden)


class CheckpointedTwiceTask(FirstReleaseTask):
    """Reentrant activation checkpointing of a block called twice (`reentrant = False`: torch's
    other implementation)."""

    reentrant = True

    def build_model(self) -> nn.Module:
        return TwiceThroughOneBlock(self.reentrant)


class CompiledTask(FirstReleaseTask):
    """`build_model` returns the model compiled: torch.compile's wrapper adds `_orig_mod.` to
    its names. The eager backend wraps it alike and compiles in no time."""

    def build_model(self) -> nn.Module:
        return torch.compile(super().build_model(), backend="eager")
