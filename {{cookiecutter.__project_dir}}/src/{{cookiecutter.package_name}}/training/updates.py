"""The updates of a step: which parameters each optimizer trains, on which loss, through which
DDP wrapper.

Most tasks train the whole model with one optimizer: one update, the model wrapped in DDP once.
A task whose model has parts trained apart, each by an optimizer of its own on a loss of its
own (a GAN: the discriminator's step, then the generator's), names them in `Task.updates`.
Each part is then wrapped in DDP on its own, so that an update all-reduces the gradients of its
own part only, once per step, while every other part runs under `no_sync` (DDP would otherwise
wait for gradients that part never gets, or all-reduce gradients that are dropped).
`training_loss` reaches the parts through `ModelParts`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LRScheduler

from ..config import ConfigError
from ..contract import TaskBase
from .losses import StepLoss
from .optimizer import AsBuilt

#: The context of a micro-batch whose backward all-reduces as DDP does by default.
_REDUCES = nullcontext()


@dataclass
class Update:
    """One optimizer's share of a step, and everything it trains with."""

    #: The part's name in `Task.updates`; None for the one update of the whole model.
    name: str | None
    #: The parameters it trains: the model, or one of its parts.
    module: nn.Module
    #: Its parameters, listed once: the step clips and rescales their gradients every step,
    #: and `module.parameters()` walks every submodule each time.
    parameters: list[nn.Parameter]
    #: The DDP wrapper of `module` (None on one rank).
    ddp: DistributedDataParallel | None
    #: What the loss calls: the wrapper (or the bare module), compiled with train.compile.
    call: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    #: fp16's loss scaling, per update: each loss has a scale of its own.
    scaler: torch.amp.GradScaler
    #: The options each of its parameter groups sets itself (optimizer.py).
    own_group_options: list[dict[str, Any]]
    as_built: AsBuilt
    #: The scaling of its micro-batch losses (losses.py).
    loss: StepLoss
    #: What its log names start with ("" for the whole model, else "<name>/"), and the name
    #: of its gradient norm: made once, read every step.
    prefix: str = field(init=False)
    norm_name: str = field(init=False)

    def __post_init__(self) -> None:
        self.prefix = log_prefix(self.name)
        self.norm_name = f"{self.prefix}grad_norm"

    def keyword(self) -> dict[str, str]:
        """The task hooks' `update=` argument: none for the whole model."""
        return {} if self.name is None else {"update": self.name}


def log_prefix(name: str | None) -> str:
    """What the log names of update `name` start with: "" for the whole model, else
    "<name>/"."""
    return "" if name is None else f"{name}/"


def model_parts(task: TaskBase, model: nn.Module) -> list[tuple[str | None, nn.Module]]:
    """(name, module) of each update of `task.updates`, in order; [(None, model)] without.

    Raises ConfigError naming a part that is not a submodule of the model, a name given twice,
    and the trainable parameters that no part or more than one part holds (they would never
    train, or train twice).
    """
    names = list(task.updates)
    if not names:
        return [(None, model)]
    if len(set(names)) != len(names):
        raise ConfigError(f"Task.updates names a part twice: {names}")
    parts = []
    for name in names:
        part = getattr(model, name, None)
        if not isinstance(part, nn.Module):
            raise ConfigError(
                f"Task.updates names {name!r}, which is not a submodule of "
                f"{type(model).__name__} (got {type(part).__name__}): each update names an "
                "attribute of the model that holds the part it trains"
            )
        parts.append((name, part))
    owners: dict[int, list[str]] = {}
    for name, part in parts:
        for param in part.parameters():
            owners.setdefault(id(param), []).append(name)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    shared = [n for n, p in trainable if len(owners.get(id(p), ())) > 1]
    orphans = [n for n, p in trainable if id(p) not in owners]
    if shared or orphans:
        raise ConfigError(
            "each trainable parameter must belong to exactly one part of Task.updates "
            f"({', '.join(names)}): "
            + "; ".join(
                f"{what}: {', '.join(found[:5])}{' ...' if len(found) > 5 else ''}"
                for what, found in (("in several parts", shared), ("in none", orphans))
                if found
            )
            + ". Move them into one part, or set requires_grad=False on them to freeze them."
        )
    return parts


class ModelParts:
    """What `training_loss` gets in a task with updates: each part as DDP wraps it, by name
    (`model.generator(noise)`); other attributes are the model's own."""

    def __init__(self, model: nn.Module, calls: dict[str, nn.Module]) -> None:
        self._model = model
        self._calls = calls

    def __getattr__(self, name: str) -> Any:
        calls = self.__dict__["_calls"]
        return calls[name] if name in calls else getattr(self.__dict__["_model"], name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"in a task with updates, training_loss calls a part of the model "
            f"({', '.join(f'model.{name}(...)' for name in self._calls)}), not the whole model: "
            "each part is wrapped in DDP on its own"
        )


def sync_context(update: Update, updates: list[Update], last: bool) -> AbstractContextManager:
    """The gradient reduction of one micro-batch of `update` (one of the step's `updates`): its
    own part is all-reduced on the step's last micro-batch only; the other parts never (their
    gradients are dropped). no_sync must cover forward AND backward: DDP prepares its gradient
    reduction in forward."""
    if len(updates) == 1:  # the whole model: no ExitStack, which costs more than no_sync itself
        return _REDUCES if last or update.ddp is None else update.ddp.no_sync()
    stack = ExitStack()
    for other in updates:
        if other is not update and other.ddp is not None:
            stack.enter_context(other.ddp.no_sync())
    if not last and update.ddp is not None:
        stack.enter_context(update.ddp.no_sync())
    return stack
