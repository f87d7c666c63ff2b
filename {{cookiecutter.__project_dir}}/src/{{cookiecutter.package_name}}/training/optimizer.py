"""The task's optimizer and schedule, checked, and each group's settings kept through a resume.

A task may split its parameters into groups (`param_groups` in contract.py), each with options
of its own (no weight decay on biases and norms, a lower lr for a pretrained backbone), and may
build its own optimizer and schedule (`build_optimizer`, `build_scheduler`; the defaults are
AdamW, whose unset options come from optim.*, and warmup-cosine). A checkpoint holds every
group's options as they were saved, and loading it brings them all back: `follow_settings`
then makes each group follow the options the task's optimizer gives it now and the current
schedule, and says in one log line per group what changed. Only the options the optimizer has
are compared, so a resume never writes AdamW's settings into an SGD group.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from ..checkpointing.resume import ResumeError
from ..config import ConfigError, OptimConfig
from ..contract import TaskBase, defines

log = logging.getLogger(__name__)

#: Keys of a parameter group that are not optimizer options.
NOT_OPTIONS = ("params", "name")
#: Group options that the default optimizer takes from optim.*.
FROM_OPTIM = ("lr", "betas", "weight_decay")
#: Entries of a scheduler's state that move as it steps, not its shape.
SCHEDULE_PROGRESS = (
    "last_epoch",
    "_step_count",
    "_last_lr",
    "base_lrs",
    "_get_lr_called_within_step",
    "_is_initial",
    "verbose",
)


@dataclass
class AsBuilt:
    """The optimizer's groups and the schedule as the task built them for this launch, before
    any checkpoint was loaded: what a resume makes them follow."""

    options: list[dict[str, Any]]
    schedule: dict[str, Any]
    #: Whether the optimizer and the schedule are the contract's defaults.
    default_optimizer: bool
    default_schedule: bool


def build_optimizer(
    task: TaskBase,
    model: nn.Module,
    groups: list[dict[str, Any]],
    optim: OptimConfig,
    **update: str,
) -> torch.optim.Optimizer:
    """The task's optimizer over `groups` (its `param_groups` of `model`: the whole model, or
    the part of the `update=` it is given, in a task with `Task.updates`), checked.

    Raises ConfigError when a parameter that requires a gradient is in no group (it would
    silently never train) or in more than one, when the optimizer is not one over these groups
    in this order, or when a group sets an option the optimizer does not take (it would be
    silently ignored), naming each.
    """
    check_groups(model, groups)
    optimizer = task.build_optimizer(
        [{**group, "params": list(group["params"])} for group in groups], optim, **update
    )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"build_optimizer returned {type(optimizer).__name__}: return a "
            "torch.optim.Optimizer over the param_groups it is given"
        )
    built = [[id(param) for param in group["params"]] for group in optimizer.param_groups]
    if built != [[id(param) for param in group["params"]] for group in groups]:
        raise ConfigError(
            f"build_optimizer returned a {type(optimizer).__name__} over other parameter groups "
            f"than param_groups made ({len(built)} groups against {len(groups)}): build it over "
            "the groups it is given, in their order (put group options in param_groups)"
        )
    check_options(optimizer, groups)
    return optimizer


def clear_gradients(optimizer: torch.optim.Optimizer) -> None:
    """`optimizer.zero_grad(set_to_none=True)`, as nanoGPT calls it after every step, without
    torch's generic path around it (a dynamo guard, a profiler range, its foreach set-up),
    which costs about 1% of a small model's step on a CPU. An optimizer with a `zero_grad` of
    its own gets it called."""
    if getattr(optimizer.zero_grad, "__func__", None) is not torch.optim.Optimizer.zero_grad:
        optimizer.zero_grad(set_to_none=True)
        return
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            parameter.grad = None


def build_scheduler(
    task: TaskBase,
    optimizer: torch.optim.Optimizer,
    total_steps: int,
    optim: OptimConfig,
    **update: str,
) -> LRScheduler:
    """The task's schedule (of `update=`, in a task with `Task.updates`), checked: one the
    trainer can step once per optimizer step."""
    scheduler = task.build_scheduler(optimizer, total_steps, optim, **update)
    if isinstance(scheduler, ReduceLROnPlateau) or not isinstance(scheduler, LRScheduler):
        raise ConfigError(
            f"build_scheduler returned {type(scheduler).__name__}: return a torch LRScheduler "
            "that steps once per optimizer step without arguments (LambdaLR with a factor per "
            "step, StepLR, OneCycleLR...); ReduceLROnPlateau needs the metric at each step"
        )
    if scheduler.optimizer is not optimizer:
        raise ConfigError("build_scheduler returned a schedule of another optimizer")
    return scheduler


def as_built(task: TaskBase, optimizer: torch.optim.Optimizer, scheduler: LRScheduler) -> AsBuilt:
    return AsBuilt(
        options=[
            {key: value for key, value in group.items() if key != "params"}
            for group in optimizer.param_groups
        ],
        schedule=_shape(scheduler.state_dict()),
        default_optimizer=not defines(task, "build_optimizer"),
        default_schedule=not defines(task, "build_scheduler"),
    )


def check_options(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    """Refuse a group option the optimizer does not take: torch keeps it in the group unread."""
    known = set(optimizer.defaults)
    for index, group in enumerate(groups):
        unknown = sorted(set(group) - known - set(NOT_OPTIONS))
        if unknown:
            raise ConfigError(
                f"param_groups sets {', '.join(unknown)} in {group_name(group, index)}, which "
                f"{type(optimizer).__name__} does not take (its options: "
                f"{', '.join(sorted(known))}). Remove it, or build the optimizer that takes it "
                "in the task's build_optimizer."
            )


def check_groups(model: nn.Module, groups: list[dict[str, Any]]) -> None:
    names = {id(param): name for name, param in model.named_parameters()}
    seen: dict[int, int] = {}
    for index, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise ConfigError(
                f"param_groups returned {group!r} as group {index}: each group is a dict with "
                "'params' (a list of parameters) and optionally options of the optimizer"
            )
        for param in group["params"]:
            if id(param) in seen:
                raise ConfigError(
                    f"param_groups puts {names.get(id(param), 'a parameter')} in groups "
                    f"{seen[id(param)]} and {index}: each parameter belongs to one group"
                )
            seen[id(param)] = index
    left_out = [
        name
        for name, param in model.named_parameters()
        if param.requires_grad and id(param) not in seen
    ]
    if left_out:
        raise ConfigError(
            f"param_groups leaves out {len(left_out)} trainable parameter(s), which would never "
            f"train: {', '.join(left_out[:10])}{' ...' if len(left_out) > 10 else ''}. Put them "
            "in a group, or set requires_grad=False on them to freeze them."
        )


def own_options(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The options each group sets itself, which win over optim.* also after a resume."""
    return [
        {key: value for key, value in group.items() if key not in NOT_OPTIONS} for group in groups
    ]


def group_name(group: dict[str, Any], index: int) -> str:
    return str(group.get("name", f"group {index}"))


def follow_settings(
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler,
    built: AsBuilt,
    own: list[dict[str, Any]],
    announce: bool,
) -> None:
    """After loading a checkpoint: each group's options as the task's optimizer gives them now
    (optim.* for the default one, the task's own values winning), and the learning rate from
    the current schedule at the loaded step.

    Nothing changes where nothing differs, so an unchanged resume stays bitwise exact. Raises
    ResumeError when a schedule of the task's own (not a LambdaLR) would have to change shape.
    """
    lambdas: list[Callable[[int], float]] | None = getattr(scheduler, "lr_lambdas", None)
    if lambdas is None:
        _require_same_schedule(scheduler, built)
    for index, (group, wanted, options) in enumerate(
        zip(optimizer.param_groups, built.options, own, strict=True)
    ):
        changes = []
        for key in sorted(wanted.keys() - {"lr", "name"}):  # initial_lr: the schedule's peak
            saved = group.get(key)
            if key in group and _differs(saved, wanted[key]):
                changes.append(
                    f"{_option(key)} {saved!r} -> {wanted[key]!r} (from "
                    f"{_source(key, options, built)})"
                )
            group[key] = wanted[key]  # an option the checkpoint's torch lacked: its default
        if lambdas is not None:
            lr = group["initial_lr"] * lambdas[index](scheduler.last_epoch)
            if lr != group["lr"]:
                group["lr"] = lr
        if changes and announce:
            log.info(
                "optimizer group %s (%d tensors): %s: applied",
                group_name(group, index),
                len(group["params"]),
                "; ".join(changes),
            )
    scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]


def _require_same_schedule(scheduler: LRScheduler, built: AsBuilt) -> None:
    """A schedule that keeps its shape in its own state (StepLR's step_size, OneCycleLR's total
    steps) would continue the checkpoint's shape silently: a changed one is refused."""
    saved = _shape(scheduler.state_dict())
    changed = sorted(
        key
        for key in saved.keys() | built.schedule.keys()
        if _differs(saved.get(key), built.schedule.get(key))
    )
    peaks = [
        (group.get("initial_lr"), wanted.get("initial_lr"))
        for group, wanted in zip(scheduler.optimizer.param_groups, built.options, strict=True)
    ]
    if any(_differs(saved_peak, peak) for saved_peak, peak in peaks):
        changed.append("initial_lr")
    if changed:
        details = "; ".join(
            f"{key} {saved.get(key)!r} -> {built.schedule.get(key)!r}"
            for key in changed
            if key != "initial_lr"
        )
        if "initial_lr" in changed:
            details += (
                ("; " if details else "")
                + "the peak learning rate "
                + ", ".join(f"{saved_peak!r} -> {peak!r}" for saved_peak, peak in peaks)
            )
        raise ResumeError(
            f"the task's {type(scheduler).__name__} was saved with another shape than it has "
            f"now ({details}), and it continues from its saved state: set the settings back to "
            "the checkpoint's, or start a new run with another run.dir (a LambdaLR schedule "
            "takes a new shape at resume)"
        )


def _shape(state: Any) -> Any:
    """A scheduler's state without its progress, also inside the schedules that a SequentialLR
    or ChainedScheduler holds."""
    if isinstance(state, dict):
        return {
            key: _shape(value)
            for key, value in state.items()
            if key not in SCHEDULE_PROGRESS and not callable(value) and key != "lr_lambdas"
        }
    if isinstance(state, (list, tuple)):
        return [_shape(value) for value in state]
    return state


def _option(key: str) -> str:
    return "lr" if key == "initial_lr" else key


def _source(key: str, own: dict[str, Any], built: AsBuilt) -> str:
    if _option(key) in own:
        return "the task's param_groups"
    if not built.default_optimizer:
        return "the task's build_optimizer"
    return f"optim.{_option(key)}" if _option(key) in FROM_OPTIM else "the default optimizer"


def _differs(saved: Any, wanted: Any) -> bool:
    if isinstance(saved, (list, tuple)) and isinstance(wanted, (list, tuple)):
        return tuple(saved) != tuple(wanted)
    return saved != wanted
