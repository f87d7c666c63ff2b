"""The Task contract: what the trainer asks of task.py, and the default of every optional part.

A task is constructed as `Task(config.task, seed=config.run.seed)` and must provide four
methods: `build_model`, `build_datasets`, `training_loss` and `evaluation_sums`. Everything else
below is optional: `TaskBase` holds the default of each. Deriving from `TaskBase` documents the
task and lets an editor complete it; a task that does not derive from it works the same, since
the trainer takes every member the task lacks from these defaults (`adopt`).

Contract versions (`CONTRACT_VERSION`); a task written for an earlier one keeps working:

1. Releases up to 0.4: the four required methods, `metric_names`, and later `throughput_unit`,
   `units_per_sample` and `flops_per_sample`, which were required in practice.
2. Release 1.0: every member but the four methods optional; `training_loss` may return a sum
   and a count or named components; per-metric counts and derived metrics; `param_groups`,
   `collate`, `units`, `state_dict`/`load_state_dict`, `test_settings`, `whole_batch_loss`,
   what the task gives the export (`model_settings`/`load_model_settings` and
   `export_files`), `build_optimizer` and `build_scheduler`: any torch optimizer and
   schedule (the defaults: AdamW and warmup-cosine, as before), and `updates`: parts of the
   model trained apart, each by its own optimizer on its own loss (a GAN).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler
from torch.utils.data import Dataset, IterableDataset, default_collate

if TYPE_CHECKING:
    from .config import OptimConfig

CONTRACT_VERSION = 2

#: What `training_loss` returns: the mean loss of the micro-batch; or (sum, count) over the
#: micro-batch's items (tokens, pixels...); or a dict with "loss", optionally "count", and
#: other named components that are logged beside the loss.
LossResult = torch.Tensor | tuple[torch.Tensor, Any] | dict[str, Any]
#: One entry of `evaluation_sums`: a sum divided by "count" when reported, or (sum, count).
EvaluationSum = torch.Tensor | tuple[torch.Tensor, Any]

#: The methods every task must have.
REQUIRED = ("build_model", "build_datasets", "training_loss", "evaluation_sums")


class ContractError(TypeError):
    """The task does not meet the contract: its code must change (exit status 2)."""


class TaskBase:
    """Optional members with their defaults; the four required methods raise until defined."""

    #: The entries of `evaluation_sums` reported as metrics; None: all but "count".
    metric_names: Sequence[str] | None = None
    #: Throughput is reported in these units per second (samples, tokens, images...).
    throughput_unit: str = "samples"
    #: Units in one sample, for the default `units`; a task that pads counts its own.
    units_per_sample: int = 1
    #: `section.key=value` settings that make the task small and quick: the generated tests
    #: train with them (a few hundred samples, a tiny model, seconds per run on a CPU).
    test_settings: Sequence[str] = ()
    #: True when a micro-batch's loss reads the step's samples together (negatives gathered
    #: across ranks, as contrastive losses do): gradient accumulation would split them into
    #: other losses, so a batch split that needs it is refused, naming the micro-batch size
    #: that avoids it.
    whole_batch_loss: bool = False
    #: The updates of one step, in order, for a model whose parts train apart: each names a
    #: submodule of the model (an attribute of it), trained by an optimizer of its own on the
    #: loss `training_loss` returns for it, over the step's same micro-batches. A GAN:
    #: ("discriminator", "generator"). Each part is wrapped in DDP on its own. `training_loss`,
    #: `param_groups`, `build_optimizer` and `build_scheduler` then get the update's name as
    #: the keyword `update`. Empty: one update of the whole model.
    updates: Sequence[str] = ()

    # --- required ---------------------------------------------------------------------------

    def build_model(self) -> nn.Module:
        """The model, on the CPU; the trainer moves it to the device and wraps it in DDP."""
        raise NotImplementedError

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        """(train, eval) map-style data sets; their items go through `collate`."""
        raise NotImplementedError

    def training_loss(self, model: nn.Module, batch: Any) -> LossResult:
        """The loss of one micro-batch, in one of three forms.

        - A scalar: the mean over the micro-batch. Every micro-batch weighs the same.
        - `(loss_sum, count)`: the sum over the micro-batch's items and how many there are
          (real tokens, not padding). The step's gradient is then exactly that of the sum over
          the whole global batch divided by its total count, on any world size and
          accumulation: use it whenever micro-batches hold different numbers of items.
          (With fp16, the sum's larger gradients may make GradScaler skip a few first steps
          while its scale backs off.)
        - A dict with "loss" (a mean, or a sum when "count" is given), optionally "count", and
          any other scalar components (they are logged as train/<name>, not trained on).

        DDP all-reduces the gradients of a backward through its own forward only: call `model`
        (`model(batch)`), never a method of what it wraps (`model.module.f(...)`). In a task
        with `updates`, it is called as `training_loss(model, batch, update=name)` once per
        update and micro-batch, and `model` holds each part as DDP wraps it, by name
        (`model.generator(noise)`; other attributes are the model's own): the loss of `name`
        trains only that part's parameters, and the gradients it leaves in the others are
        dropped.
        """
        raise NotImplementedError

    def evaluation_sums(self, model: nn.Module, batch: Any) -> dict[str, EvaluationSum]:
        """Sums over one evaluation batch: exact across ranks, since only sums are reduced.

        Each entry is a tensor, reported as its total over the evaluation set divided by the
        total of the "count" entry, or a pair (sum, count) that carries its own count. Entries
        may also be ingredients of `evaluation_metrics` (true and false positives for an F1).

        No collectives here (an all_gather of embeddings, an all_reduce of the sums): every
        sample is evaluated once, so the ranks' shares differ by up to a sample, and their
        batches can differ in size or in number. A call is refused on every rank, at its
        first, with CollectiveInEvaluationError (exit status 2). The trainer adds the sums up
        over the ranks after the last batch; a metric that needs every sample at once
        (retrieval over all embeddings) is no sum of batches: compute it after training, from
        `load_model`.
        """
        raise NotImplementedError

    # --- optional ---------------------------------------------------------------------------

    def evaluation_metrics(self, totals: dict[str, Any]) -> dict[str, float]:
        """The metrics from `evaluation_sums` totalled over the whole evaluation set.

        `totals` holds each entry as a float, or a (sum, count) pair of floats. The default
        reports `metric_names` (else every entry but "count"), each as sum / count.
        """
        names = self.metric_names or [name for name in totals if name != "count"]
        metrics = {}
        for name in names:
            value = totals[name]
            if isinstance(value, tuple):
                total, count = value
            elif "count" in totals:
                total, count = value, totals["count"]
            else:
                raise KeyError(
                    f"evaluation_sums returned {name!r} without a count: add a 'count' entry, "
                    f"or return {name!r} as a (sum, count) pair"
                )
            metrics[name] = total / count if count else math.nan
        return metrics

    def param_groups(self, model: nn.Module, update: str | None = None) -> list[dict[str, Any]]:
        """The optimizer's parameter groups: {"params": [...], and any option of the optimizer}.

        A group's own options (weight_decay=0.0 for biases and norms, a lower lr) win over the
        optim.* settings, also when those change on resume. A "name" key names the group in
        the log. Every parameter that requires a gradient must be in exactly one group. In a
        task with `updates`, `model` is the update's part and `update=` its name.
        """
        return [{"params": list(model.parameters())}]

    def build_optimizer(
        self, param_groups: list[dict[str, Any]], optim: OptimConfig, update: str | None = None
    ) -> torch.optim.Optimizer:
        """The optimizer over `param_groups` (this task's, in order); the default is AdamW with
        optim.lr, optim.betas and optim.weight_decay.

        Return any `torch.optim.Optimizer` (SGD with momentum, or one from another library) over
        these groups, in this order. Its state is saved in every checkpoint and resumes bitwise;
        a group option it does not take is refused by name. On resume, each group follows the
        options this method gives it now, where they differ from the checkpoint's. In a task
        with `updates`, it is called once per update, with `update=` its name.
        """
        on_cuda = all(param.is_cuda for group in param_groups for param in group["params"])
        return torch.optim.AdamW(
            param_groups,
            lr=optim.lr,
            betas=optim.betas,
            weight_decay=optim.weight_decay,
            fused=on_cuda,
        )

    def build_scheduler(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        optim: OptimConfig,
        update: str | None = None,
    ) -> LRScheduler:
        """The learning-rate schedule, stepped once per optimizer step; the default is a linear
        warmup over optim.warmup_steps, then a cosine decay to optim.min_lr_ratio at the last
        step.

        A factor per step is `FactorLR(optimizer, lambda step: ...)` (torch's LambdaLR, stepped
        for less; a LambdaLR works too), which a resume re-shapes from the current settings as
        it does the default. Any other torch LRScheduler resumes from its saved state; a change
        of its shape at resume is refused by name. In a task with `updates`, it is called once
        per update, with `update=` its name.
        """
        return FactorLR(
            optimizer,
            partial(
                warmup_cosine,
                warmup_steps=optim.warmup_steps,
                total_steps=total_steps,
                min_lr_ratio=optim.min_lr_ratio,
            ),
        )

    def collate(self, samples: list[Any]) -> Any:
        """A batch from a list of data set items (pad variable-length items here)."""
        return default_collate(samples)

    def units(self, batch: Any) -> int | torch.Tensor | None:
        """Throughput units in one micro-batch; None: `units_per_sample` per sample.

        Return a tensor (real tokens: `(labels != -100).sum()`) to count what the batch holds;
        it stays on the device until the next log line, so counting costs no wait.
        """
        return None

    def flops_per_sample(self, model: nn.Module) -> float | None:
        """Training FLOPs (forward and backward) of one sample, for MFU; None: no MFU."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """The task's own state (a curriculum's position...), saved in every checkpoint."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned, on resume (after `build_datasets`)."""

    def model_settings(self) -> dict[str, Any]:
        """What `build_model` takes from the data rather than from the `task.*` settings (a
        vocabulary size read from token shards), as JSON values; {}: nothing.

        The export records it; `load_model` builds the task from the exported config, hands
        it this record (`load_model_settings`) and calls `build_model`, on a machine that may
        hold none of the data.
        """
        return {}

    def load_model_settings(self, settings: dict[str, Any]) -> None:
        """Take what `model_settings` returned, from an export, for `build_model` to use
        instead of reading the data.

        A task built to load a model gets this call and `build_model`, never `build_datasets`:
        read the data when first needed, not in `__init__`.
        """

    def export_files(self) -> dict[str, Path]:
        """Files the model is used with, copied into the export beside its weights (a
        tokenizer.json): the name of each there, and its path now; {}: none."""
        return {}


class FactorLR(LambdaLR):
    """torch's LambdaLR (each group's learning rate: its initial one times a factor of the
    step), stepped as nanoGPT sets its learning rate: directly.

    LambdaLR's `step` takes a generic path (checks, a context, the rates listed twice) that
    costs about 1% of a small model's optimizer step on a CPU. This one sets the same rates,
    bitwise, and keeps the same state; a resume re-shapes it as it does any LambdaLR. The first
    step (in the constructor) and the deprecated `step(epoch)` take torch's own path.
    """

    def step(self, epoch: int | None = None) -> None:
        if epoch is not None or not self._step_count:
            super().step(epoch)
            return
        self._step_count += 1
        self.last_epoch = step = self.last_epoch + 1
        self._last_lr = []
        groups = self.optimizer.param_groups
        for group, initial_lr, factor in zip(groups, self.base_lrs, self.lr_lambdas, strict=True):
            rate = initial_lr * factor(step)
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(rate)  # in place, as torch does: a CUDA graph may hold it
            else:
                group["lr"] = rate
            self._last_lr.append(rate)


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup to 1, then cosine decay to `min_lr_ratio` at `total_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class _Adopted(TaskBase):
    """A task that does not derive from TaskBase: its own members first, then the defaults."""

    def __init__(self, task: object) -> None:
        object.__setattr__(self, "_task", task)

    def __getattribute__(self, name: str) -> Any:
        if not name.startswith("_"):
            try:
                return getattr(object.__getattribute__(self, "_task"), name)
            except AttributeError:
                pass
        return object.__getattribute__(self, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_task"), name, value)


def adopt(task: object) -> TaskBase:
    """The task as the trainer uses it, with a default for every optional member it lacks.

    Raises ContractError naming the required methods the task does not define. A task adopted
    already is returned as it is.
    """
    if isinstance(task, _Adopted):
        return task
    missing = [name for name in REQUIRED if not defines(task, name)]
    if missing:
        raise ContractError(
            f"{type(task).__name__} does not define {', '.join(missing)}: every task needs "
            f"{', '.join(REQUIRED)} (see contract.py)"
        )
    return task if isinstance(task, TaskBase) else _Adopted(task)


def defines(task: object, name: str) -> bool:
    """Whether the task defines member `name` itself rather than taking TaskBase's default."""
    if isinstance(task, _Adopted):
        task = object.__getattribute__(task, "_task")
    default = getattr(TaskBase, name)
    return getattr(type(task), name, default) is not default


def member_of(task_class: type, name: str) -> Any:
    """The class attribute `name` of a task class (`whole_batch_loss`, `updates`,
    `test_settings`), or TaskBase's default where the class lacks it: for what is read before
    any task is built (the launch's batch check, the generated tests' settings)."""
    return getattr(task_class, name, getattr(TaskBase, name))


def check_datasets(train: object, evaluation: object) -> None:
    """Refuse, naming it, a data set the trainer cannot index (ContractError): it gives each
    rank disjoint indices, evaluates every sample once and resumes at the exact sample, all by
    index, so a stream (an IterableDataset: Hugging Face streaming, webdataset) would fail
    later in torch's own words, inside the loader."""
    for part, dataset in (("training", train), ("evaluation", evaluation)):
        if isinstance(dataset, IterableDataset) or not (
            hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")
        ):
            raise ContractError(
                f"build_datasets returned a {part} set that cannot be indexed "
                f"({type(dataset).__name__}: an IterableDataset, or without __len__ and "
                "__getitem__). The trainer needs map-style data sets: it shares them over the "
                "ranks, evaluates every sample once and resumes at the exact sample by index. "
                "Load the data whole (Hugging Face: load_dataset without streaming=True), or "
                "write it once into files read by index, as the gpt example's token shards do "
                "(docs: bring your own model, what DDP asks of a task)."
            )
