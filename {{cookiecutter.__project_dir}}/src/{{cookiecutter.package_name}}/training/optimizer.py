"""AdamW over the task's parameter groups, and each group's own settings kept through a resume.

A task may split its parameters into groups (`param_groups` in contract.py), each with options
of its own (no weight decay on biases and norms, a lower lr for a pretrained backbone); the
optim.* settings fill in what a group does not set. A checkpoint holds every group's options as
they were saved, and loading it brings them all back: `follow_settings` then makes each group
follow the current optim.* settings, the task's own values and the current schedule again, and
says in one log line per group what changed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..config import ConfigError, OptimConfig

log = logging.getLogger(__name__)

#: Keys of a parameter group that are not optimizer options.
NOT_OPTIONS = ("params", "name")


def build_optimizer(
    model: nn.Module, groups: list[dict[str, Any]], optim: OptimConfig, device: torch.device
) -> torch.optim.AdamW:
    """AdamW over `groups` (the task's `param_groups`), optim.* filling in unset options.

    Raises ConfigError when a parameter that requires a gradient is in no group (it would
    silently never train) or in more than one, naming it.
    """
    check_groups(model, groups)
    return torch.optim.AdamW(
        [{**group, "params": list(group["params"])} for group in groups],
        lr=optim.lr,
        betas=optim.betas,
        weight_decay=optim.weight_decay,
        fused=device.type == "cuda",
    )


def check_groups(model: nn.Module, groups: list[dict[str, Any]]) -> None:
    names = {id(param): name for name, param in model.named_parameters()}
    seen: dict[int, int] = {}
    for index, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise ConfigError(
                f"param_groups returned {group!r} as group {index}: each group is a dict with "
                "'params' (a list of parameters) and optionally AdamW options"
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
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    own: list[dict[str, Any]],
    optim: OptimConfig,
    announce: bool,
) -> None:
    """After loading a checkpoint: each group's options from optim.* and the task's own values
    (its own win), and the learning rate from the current schedule at the loaded step.

    Nothing changes where nothing differs, so an unchanged resume stays bitwise exact.
    """
    lambdas: list[Callable[[int], float]] = scheduler.lr_lambdas
    defaults = {"lr": optim.lr, "betas": tuple(optim.betas), "weight_decay": optim.weight_decay}
    for index, (group, options) in enumerate(zip(optimizer.param_groups, own, strict=True)):
        changes = []
        for key in sorted(defaults.keys() | options.keys()):
            wanted = options.get(key, defaults.get(key))
            slot = "initial_lr" if key == "lr" else key  # the schedule's peak; lr follows it
            saved = group.get(slot)
            if _differs(saved, wanted):
                group[slot] = wanted
                source = "the task's param_groups" if key in options else f"optim.{key}"
                changes.append(f"{key} {saved!r} -> {wanted!r} (from {source})")
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


def _differs(saved: Any, wanted: Any) -> bool:
    if isinstance(saved, (list, tuple)) and isinstance(wanted, (list, tuple)):
        return tuple(saved) != tuple(wanted)
    return saved != wanted
