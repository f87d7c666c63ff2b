"""Lazy modules (nn.LazyLinear, nn.LazyConv2d, nn.LazyBatchNorm1d...): layers whose parameters
take their shapes from their first input.

DDP cannot wrap a model while any of its parameters has no shape yet ("Modules with
uninitialized parameters can't be used with DistributedDataParallel"), and no optimizer can
hold one. The trainer therefore runs the task's loss once, on the first micro-batch of the
training set, before it wraps the model: what a user would do by hand with a dummy batch. Every
rank does it alike: the same samples, and the random streams as they were right after
`build_model` (the same on every rank), so that the new parameters draw the numbers a dummy
forward at the end of `build_model` would have drawn. The pass runs in eval mode and without
gradients: it changes no statistics (BatchNorm's) and leaves the ranks' own streams as they
were. A resume materialises the same shapes before loading the checkpoint; `load_model`
takes them from the exported weights (loading a state dict materialises a lazy module).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from ..contract import ContractError
from . import rng


def lazy_names(model: nn.Module) -> list[str]:
    """The parameters and buffers of `model` that have no shape yet."""
    tensors = chain(model.named_parameters(), model.named_buffers())
    return [name for name, tensor in tensors if is_lazy(tensor)]


def materialise(
    model: nn.Module,
    first_losses: Callable[[], Any],
    streams: dict[str, Any],
    device: torch.device,
) -> None:
    """Give the lazy modules of `model` their shapes: `first_losses()` runs the task's loss on
    the first micro-batch (of each update), in eval mode and without gradients, with the random
    streams set to `streams` (as they were after `build_model`); the streams are put back after.

    Raises ContractError naming what a loss left without a shape (a layer only `forward` in
    training mode, or no loss, reaches).
    """
    kept = rng.capture(device)
    rng.restore(streams, device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            first_losses()
    finally:
        model.train(was_training)
        rng.restore(kept, device)
    left = lazy_names(model)
    if left:
        shown = ", ".join(left[:5]) + (", ..." if len(left) > 5 else "")
        raise ContractError(
            f"build_model's lazy modules kept {len(left)} parameter(s) or buffer(s) without a "
            f"shape ({shown}) after training_loss ran on the first micro-batch in eval mode: "
            "DDP and the optimizer need every parameter's shape before training starts, and a "
            "lazy module takes its shape from its first input. Give those layers their input "
            "sizes (nn.Linear(in_features, out_features) for nn.LazyLinear), or reach them from "
            "training_loss in eval mode too."
        )
