"""The problem being solved: data, model, loss and metrics. This is the file you edit.

The trainer only calls the methods of `Task`; it never looks inside a batch or a model. To train
your own model, replace the data set, the model and the loss and metric methods below, and the
settings in `TaskConfig`. contract.py lists what a task must define (four methods)
and what it may (parameter groups, a collate function, per-token losses, metrics of its own,
state in checkpoints...), each with its default. Nothing here knows about ranks, devices or DDP:
the trainer moves batches to the device, wraps the model, and reduces the metrics across ranks.
"""
{%- if cookiecutter.example == "classifier" %}

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, TensorDataset

from .contract import TaskBase
from .errors import ConfigError


@dataclass
class TaskConfig:
    """The example task's settings; replace them with your own task's.

    Its fields become the `task.*` settings (YAML, overrides, `--help`, checkpoints). An
    optional `validate()` method checks them (raise ConfigError); it runs after the checks of
    the shared sections.
    """

    #: Samples in the generated training set.
    num_train_samples: int = 8192
    #: Samples in the generated evaluation set.
    num_eval_samples: int = 1000
    #: Features per sample.
    input_dim: int = 32
    #: Width of the MLP's hidden layers.
    hidden_dim: int = 128
    #: Classes (Gaussian blobs) to tell apart.
    num_classes: int = 8
    #: Dropout probability after each hidden layer.
    dropout: float = 0.1

    def validate(self) -> None:
        """The task's own range checks; config.validate() calls them after its own."""
        for key in ("num_train_samples", "num_eval_samples", "input_dim", "hidden_dim"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"task.{key} must be positive, got {getattr(self, key)}")
        if self.num_classes < 2:
            raise ConfigError(f"task.num_classes must be at least 2, got {self.num_classes}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"task.dropout must be in [0, 1), got {self.dropout}")


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


class Task(TaskBase):
    """Classification of synthetic Gaussian blobs."""

    #: Small and quick: what the generated tests train with.
    test_settings = (
        "task.num_train_samples=512",
        "task.num_eval_samples=101",
        "task.hidden_dim=32",
    )

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
{%- else %}

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from .contract import TaskBase
from .errors import ConfigError
from .gpt import GPT
from .loading.shards import TOKENIZER_FILE, TokenWindows, read_manifest


@dataclass
class TaskConfig:
    """The text and the size of the example language model (see task.py and gpt.py).

    `text_path`: the file to learn, read as bytes; empty: a text of `generated_bytes` bytes
    generated from run.seed, so nothing is downloaded. Its first 90% trains, the rest evaluates,
    in windows of `block_size` + 1 bytes. `data_dir`: instead of a text, a directory of token
    shards written by the prepare command (prepare.py), of any size, read window by window:
    their train and eval splits are the two parts, their manifest gives the vocabulary size.
    `num_train_samples` / `num_eval_samples` > 0 take only that many windows of each part (quick
    runs); 0 takes them all. The defaults are a tiny model that trains on a laptop CPU;
    configs/gpt-small.yaml and configs/gpt2-124m.yaml are bigger.

    Its fields become the `task.*` settings, and `validate()` checks them (after the checks of
    the shared sections).
    """

    #: The text file to learn; empty: a generated text.
    text_path: str = ""
    #: A directory of token shards made by the prepare command; empty: text_path's text.
    data_dir: str = ""
    #: Bytes of generated text, when text_path is empty.
    generated_bytes: int = 1_000_000
    #: Training windows to take (quick runs); 0 takes them all.
    num_train_samples: int = 0
    #: Evaluation windows to take; 0 takes them all.
    num_eval_samples: int = 0
    #: Bytes of context.
    block_size: int = 64
    #: Transformer blocks.
    n_layer: int = 2
    #: Attention heads per block; they share n_embd equally.
    n_head: int = 4
    #: Embedding width.
    n_embd: int = 128
    #: Dropout probability in attention and MLP.
    dropout: float = 0.0

    def validate(self) -> None:
        """The task's own range checks; config.validate() calls them after its own."""
        for key in ("generated_bytes", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"task.{key} must be positive, got {getattr(self, key)}")
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"task.n_embd={self.n_embd} must be a multiple of task.n_head={self.n_head}: "
                "each attention head takes an equal share of the embedding"
            )
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"task.dropout must be in [0, 1), got {self.dropout}")
        for key in ("num_train_samples", "num_eval_samples"):
            if getattr(self, key) < 0:
                raise ConfigError(f"task.{key} must be >= 0 (0 takes every window of the text)")
        if self.text_path and not Path(self.text_path).is_file():
            raise ConfigError(
                f"task.text_path={self.text_path} is not a file. Give the path of a text file to "
                "train on, or leave task.text_path empty to train on a generated text."
            )
        if self.data_dir and self.text_path:
            raise ConfigError(
                f"task.data_dir={self.data_dir} and task.text_path={self.text_path} both name "
                "the data: set one of them (prepare the text file into shards to use data_dir)"
            )
        if self.data_dir and not (Path(self.data_dir) / "manifest.json").is_file():
            raise ConfigError(
                f"task.data_dir={self.data_dir} holds no manifest.json: prepare the corpus into "
                f"it first (python -m {__package__}.prepare SOURCE... --output {self.data_dir}), "
                "or leave task.data_dir empty."
            )


#: Byte-level modelling: any file is a sequence of bytes 0-255, so no tokenizer is needed.
VOCAB_SIZE = 256

SUBJECTS = ("the cat", "a dog", "my sister", "the old man", "our teacher", "a small bird")
VERBS = ("sees", "finds", "likes", "paints", "follows", "carries", "remembers")
OBJECTS = ("a red ball", "the river", "an apple", "the green door", "a long letter", "the boat")
PLACES = ("in the garden", "near the station", "at night", "after school", "by the sea")


def generate_text(num_bytes: int, seed: int) -> bytes:
    """Sentences from a small grammar, deterministic from the seed: nothing to download.

    Spelling, spaces and word order are regular enough that a tiny model's loss falls far below
    that of guessing bytes (ln 256 = 5.5) within a few hundred steps.
    """
    rng = random.Random(seed)
    sentences = []
    size = 0
    while size < num_bytes:
        words = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)]
        if rng.random() < 0.5:
            words.append(rng.choice(PLACES))
        sentence = " ".join(words).capitalize() + ".\n"
        sentences.append(sentence)
        size += len(sentence)
    return "".join(sentences).encode()[:num_bytes]


def read_text(config: TaskConfig, seed: int) -> torch.Tensor:
    """The text as a tensor of bytes: the file at `task.text_path`, else a generated one."""
    if config.text_path:
        data = Path(config.text_path).read_bytes()
    else:
        data = generate_text(config.generated_bytes, seed)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class ByteWindows(Dataset):
    """Sample i is bytes i * block_size to (i + 1) * block_size of the text, both included.

    It is returned as (inputs, targets), the targets being the inputs shifted by one: position t
    learns to predict byte t + 1. Consecutive windows share one byte, so each byte of the text is
    a target once per epoch.
    """

    def __init__(self, data: torch.Tensor, block_size: int, num_samples: int) -> None:
        self.data = data
        self.block_size = block_size
        self.num_samples = num_samples

    @property
    def fingerprint(self) -> str:
        """The text's digest: the ranks compare it before training, so that a node with
        another file at task.text_path is refused."""
        return hashlib.sha256(self.data.numpy().tobytes()).hexdigest()

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        window = self.data[start : start + self.block_size + 1].long()
        return window[:-1], window[1:]


def byte_windows(data: torch.Tensor, config: TaskConfig, wanted: int, part: str) -> ByteWindows:
    """The windows of one part of the text: `wanted` of them, or all when `wanted` is 0."""
    available = (len(data) - 1) // config.block_size
    if available == 0 or wanted > available:
        needed = f"task.num_{part}_samples={wanted}" if wanted else "at least one is needed"
        raise ConfigError(
            f"the {part} part of the text ({len(data)} bytes) holds {available} windows of "
            f"task.block_size + 1 = {config.block_size + 1} bytes, but {needed}. Use a longer "
            f"text (task.text_path or task.generated_bytes), a smaller task.block_size, or a "
            f"smaller task.num_{part}_samples."
        )
    return ByteWindows(data, config.block_size, wanted or available)


class Task(TaskBase):
    """Next-token prediction with a small GPT (gpt.py): on the bytes of a text, or on the
    tokens of a shard directory made by the prepare command (`task.data_dir`)."""

    #: Throughput is reported in these units per second; one sample holds `units_per_sample`.
    throughput_unit = "tokens"
    #: Small and quick: what the generated tests train with.
    test_settings = (
        "task.num_train_samples=512",
        "task.num_eval_samples=101",
        "task.generated_bytes=20000",
        "task.block_size=16",
        "task.n_head=2",
        "task.n_embd=32",
        "task.dropout=0.1",
    )

    def __init__(self, config: TaskConfig, seed: int) -> None:
        self.config = config
        self.seed = seed
        self.units_per_sample = config.block_size
        # Read from the shards when first needed, or given by an export: a task built to load
        # a model reads no data.
        self._vocab_size: int | None = None

    @property
    def vocab_size(self) -> int:
        """Tokens the model knows: the 256 bytes, or the shards' tokenizer's vocabulary."""
        if self._vocab_size is None:
            data_dir = self.config.data_dir
            self._vocab_size = read_manifest(data_dir).vocab_size if data_dir else VOCAB_SIZE
        return self._vocab_size

    def build_model(self) -> nn.Module:
        return GPT(self.config, self.vocab_size)

    def model_settings(self) -> dict[str, Any]:
        """The vocabulary size, which the shards' manifest gives: the export records it, so
        that `load_model` rebuilds the model without the shards."""
        return {"vocab_size": self.vocab_size}

    def load_model_settings(self, settings: dict[str, Any]) -> None:
        self._vocab_size = int(settings["vocab_size"])

    def export_files(self) -> dict[str, Path]:
        """The shards' tokenizer.json, which encodes text for the model and decodes what it
        writes; bytes need none."""
        data_dir = self.config.data_dir
        if data_dir and read_manifest(data_dir).tokenizer["kind"] == "hf":
            return {TOKENIZER_FILE: Path(data_dir) / TOKENIZER_FILE}
        return {}

    def param_groups(self, model: nn.Module) -> list[dict]:
        """Weight decay on the matrices of the linear layers only, not on biases, LayerNorms
        and embeddings (the token embedding is also the output head: one tensor, no decay)."""
        embeddings_and_norms = {
            id(param)
            for module in model.modules()
            if isinstance(module, (nn.Embedding, nn.LayerNorm))
            for param in module.parameters(recurse=False)
        }
        decay, no_decay = [], []
        for param in model.parameters():
            skip = param.dim() < 2 or id(param) in embeddings_and_norms
            (no_decay if skip else decay).append(param)
        return [
            {"name": "decay", "params": decay},
            {"name": "no_decay", "params": no_decay, "weight_decay": 0.0},
        ]

    def flops_per_sample(self, model: nn.Module) -> float:
        """Training FLOPs (forward and backward) for one sample: what MFU is computed from.

        The estimate of nanoGPT and the PaLM paper (appendix B), per token: 6 FLOPs per parameter
        (2 forward, 4 backward) plus 12 * n_layer * n_embd * block_size for the attention scores
        and their weighted sum. As in nanoGPT, the parameters are all but the position embedding:
        the token embedding counts, since it is also the output head, a matrix product per token.
        """
        config = self.config
        params = sum(param.numel() for param in model.parameters())
        params -= config.block_size * config.n_embd  # the position embedding: a lookup
        attention = 12 * config.n_layer * config.n_embd * config.block_size
        return float((6 * params + attention) * config.block_size)

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        """(train, eval) data sets: the shards' two splits, read window by window; else the first
        90% of the text, and the rest."""
        config = self.config
        if config.data_dir:
            block, directory = config.block_size, config.data_dir
            train = TokenWindows(directory, "train", block, config.num_train_samples)
            evaluation = TokenWindows(directory, "eval", block, config.num_eval_samples)
            return train, evaluation
        text = read_text(self.config, self.seed)
        split = len(text) * 9 // 10
        train = byte_windows(text[:split], self.config, self.config.num_train_samples, "train")
        evaluation = byte_windows(text[split:], self.config, self.config.num_eval_samples, "eval")
        return train, evaluation

    def training_loss(
        self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """Mean loss over the tokens of the micro-batch; the trainer handles accumulation."""
        inputs, targets = batch
        return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())

    def evaluation_sums(
        self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Per-batch sums over tokens of each metric plus the token count: exact across ranks."""
        inputs, targets = batch
        logits = model(inputs).double()  # float64 sums stay exact when added up across ranks
        return {
            "loss": F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum"),
            "accuracy": (logits.argmax(dim=-1) == targets).sum(),
            "count": torch.tensor(targets.numel(), device=targets.device),
        }
{%- endif %}
