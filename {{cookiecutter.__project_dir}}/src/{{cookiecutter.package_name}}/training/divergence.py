"""Non-finite losses, gradients and weights: found without waiting for the device, never saved.

A NaN or an inf in one micro-batch's loss on one rank reaches every rank's gradients through
DDP's all-reduce, then every rank's weights. Left alone, the run trains on to its end, writes
checkpoints that hold only non-finite tensors and prunes the good ones, and a relaunch resumes
the broken weights.

The guard records, on the device, the first step whose loss (on this rank) or gradient norm (the
same on every rank: it is taken after the all-reduce) was not finite. The trainer reads that
record where it waits for the device anyway: in the gather of the log line, and before every
checkpoint, where the parameters and buffers themselves are checked too. Every rank reads the
same gathered record, so all of them stop at the same step, and the newest checkpoint is always
one whose every value is finite. Non-finite parameters or buffers are named, with their module
and rank; a buffer is not trained (the forward writes BatchNorm's statistics from its inputs),
so its advice is about the data, not the learning rate.

A step only keeps its values aside (no device work: a handful of tiny operations per step
would cost more than the rest of the trainer's bookkeeping together); they are checked all at
once, in a few operations whatever their number, when the record is read, or once
`PENDING_STEPS` steps are waiting. A step's loss is finite when each of its micro-batches'
losses is.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import torch
from torch import nn

from ..cluster.distributed import gather_objects

log = logging.getLogger(__name__)

#: The exit status of a run that stopped on non-finite values: not resumable as it is.
EXIT_DIVERGED = 3


class DivergenceError(RuntimeError):
    """The training produced non-finite values; no checkpoint holds them."""


class DivergenceGuard:
    """Records the first non-finite loss and gradient norm of this rank, on its device."""

    #: Entries of `record()`, in order.
    FIELDS = ("loss", "grad_norm", "parameters", "buffers")
    #: The most steps whose values wait to be checked: a bound on the tensors kept alive.
    PENDING_STEPS = 1000

    def __init__(self, device: torch.device, watch_gradients: bool = True) -> None:
        self.device = device
        # fp16's loss scaler expects gradients that overflow and skips those steps itself.
        self.watch_gradients = watch_gradients
        # The first step seen non-finite, per field; inf: none so far.
        self._first = torch.full((len(self.FIELDS),), math.inf, dtype=torch.float64, device=device)
        # The values of consecutive steps from `_pending_from` on, not checked yet: every
        # step's micro-batch losses (as many in every step: `_per_step`) and its gradient norm
        # (or `_finite`).
        self._losses: list[torch.Tensor] = []
        self._norms: list[torch.Tensor] = []
        self._pending_from = 0
        self._per_step = 0
        self._finite = torch.zeros((), dtype=torch.float64, device=device)
        #: The models the last `check_weights` looked at, by what the messages call them.
        self._checked: dict[str, nn.Module] = {}

    def end_step(
        self,
        step: int,
        losses: list[torch.Tensor],
        grad_norm: torch.Tensor | None,
        skipped: bool = False,
    ) -> None:
        """Keep `step`'s values aside: its micro-batches' `losses` (detached; the step's loss is
        finite when each of them is) and gradient norm, when computed (without a graph, as
        clip_grad_norm_ computes it); a step skipped for its non-finite gradients
        (train.on_nonfinite=skip) is not recorded."""
        if skipped or not losses:
            return
        pending = len(self._norms)
        if pending and (
            step != self._pending_from + pending
            or len(losses) != self._per_step
            or pending >= self.PENDING_STEPS
        ):
            self._check_pending()
            pending = 0
        if not pending:
            self._pending_from, self._per_step = step, len(losses)
        self._losses += losses
        watched = grad_norm is not None and self.watch_gradients
        self._norms.append(grad_norm if watched else self._finite)

    def check_weights(self, step: int, models: dict[str, nn.Module]) -> None:
        """Record `step` if any parameter or floating-point buffer of `models` is not finite
        (before a save: finite losses and gradients can still step the weights out of range,
        and a forward can write a non-finite buffer while its loss stays finite). `models`:
        each model by what the messages call it ("" for the one trained)."""
        self._checked = models
        for field, kind in enumerate(self.FIELDS[2:], start=2):
            tensors = [tensor.detach() for *_, tensor in _floating(models, kind)]
            if tensors:
                finite = torch.stack([tensor.isfinite().all() for tensor in tensors]).all()
                values = torch.where(finite, 0.0, math.inf).reshape(1)
                self._mark(slice(field, field + 1), values, step)

    def _mark(self, fields: slice, values: torch.Tensor, step: int) -> None:
        marks = torch.where(values.isfinite(), math.inf, float(step))
        torch.minimum(self._first[fields], marks, out=self._first[fields])

    def _check_pending(self) -> None:
        """Record the first non-finite loss and gradient norm of the steps kept aside, on the
        device, in a few operations however many steps wait."""
        steps = len(self._norms)
        if not steps:
            return
        losses = torch.stack(self._losses).isfinite().view(steps, -1).all(dim=1)
        finite = torch.stack([losses, torch.stack(self._norms).isfinite()], dim=1)
        first = self._pending_from
        numbers = torch.arange(first, first + steps, dtype=torch.float64, device=self.device)
        marks = torch.where(finite, math.inf, numbers[:, None])
        torch.minimum(self._first[:2], marks.amin(dim=0), out=self._first[:2])
        self._losses, self._norms = [], []

    def record(self) -> torch.Tensor:
        """This rank's first non-finite steps (0: none), for the trainer's gather."""
        self._check_pending()
        return torch.nan_to_num(self._first, posinf=0.0)

    def raise_if_diverged(self, rows: torch.Tensor, saved: str) -> None:
        """Raise DivergenceError, on every rank alike, if any rank's gathered record (one row
        per rank, `record()`'s fields) shows a non-finite value; `saved` names the newest
        checkpoint, which holds none of them. Non-finite parameters or buffers are named from
        every rank's, in a collective."""
        seen = rows[rows > 0]
        if seen.numel() == 0:
            return
        step = int(seen.min())
        loss_ranks = [rank for rank, row in enumerate(rows.tolist()) if row[0] == step]
        advice = (
            f"No checkpoint holds these values; the newest is {saved}. A relaunch resumes from "
            "there and meets the same values again unless something changes: a lower "
            "optim.lr, optim.grad_clip, the data at that step, or train.on_nonfinite=skip to "
            "skip such steps."
        )
        if loss_ranks:
            what = (
                f"the loss was not finite at step {step} on rank(s) "
                f"{', '.join(map(str, loss_ranks))} (first seen there; the all-reduce of the "
                "gradients spreads it to every rank)"
            )
        elif bool((rows[:, 1] == step).any()):
            what = (
                f"the gradient norm was not finite at step {step} (after the all-reduce, on "
                "every rank), while every loss was finite"
            )
        elif bool((rows[:, 2] == step).any()):
            what = f"parameters held non-finite values at step {step}: {self._named('parameters')}"
        else:
            what = (
                f"buffers held non-finite values at step {step}, while every loss and gradient "
                f"norm was finite: {self._named('buffers')}"
            )
            advice = (
                "A buffer is not trained: the forward writes it from its inputs (BatchNorm's "
                "running statistics) or the task's code sets it, so neither optim.lr nor "
                "optim.grad_clip changes it. Look for a non-finite value in the input samples "
                "of the steps since the newest checkpoint, or in what the task's code writes "
                f"into that buffer. No checkpoint holds these values; the newest is {saved}, "
                "where a relaunch resumes."
            )
        raise DivergenceError(f"training diverged: {what}. {advice}")

    def _named(self, kind: str) -> str:
        """The non-finite `kind` ("parameters" or "buffers") of every rank's checked models,
        each with its module and the ranks that hold it (a collective)."""
        tensors = _floating(self._checked, kind)
        mine = [name for name, tensor in tensors if not bool(tensor.isfinite().all())]
        ranks: dict[str, list[str]] = {}
        for rank, names in enumerate(gather_objects(mine)):
            for name in names:
                ranks.setdefault(name, []).append(str(rank))
        found = [f"{name} on rank(s) {', '.join(held)}" for name, held in ranks.items()]
        return "; ".join(found[:5]) + ("; ..." if len(found) > 5 else "")


def _floating(models: dict[str, nn.Module], kind: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The floating-point parameters or buffers (`kind`) of `models`, each with a name that
    says where it is: "running_mean of net.3 (BatchNorm1d)", and "in <model>" for a model
    with a name (the moving average)."""
    for label, model in models.items():
        where = f" in {label}" if label else ""
        for path, module in model.named_modules():
            owned = (
                module.named_parameters(recurse=False)
                if kind == "parameters"
                else module.named_buffers(recurse=False)
            )
            for name, tensor in owned:
                if tensor.is_floating_point():
                    owner = f"{path} ({type(module).__name__})" if path else type(module).__name__
                    yield f"{name} of {owner}{where}", tensor


class SkipPolicy:
    """train.on_nonfinite=skip: a step whose gradient norm is not finite leaves the model as it
    was (its weights and buffers), the optimizer's moments and the moving average, on every
    rank alike (the norm is taken after the all-reduce); the run stops once more than `limit`
    steps were skipped.

    The forward changes buffers before the step is judged (BatchNorm's running statistics and
    its count of batches; a NaN sample makes them NaN for the rest of the run): every buffer
    is copied before the forwards, and put back if the step is skipped, by this policy or by
    fp16's loss scaler (an overflowing gradient on any rank: every rank skips alike).
    """

    def __init__(self, enabled: bool, limit: int, is_main: bool) -> None:
        self.enabled = enabled
        self.limit = limit
        self.is_main = is_main
        #: Steps skipped in the run (in every checkpoint).
        self.skipped = 0
        #: The model's buffers before this update's forwards: (module, name, the tensor, a
        #: copy of its values).
        self._kept: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]] = []
        #: fp16: the loss scaler's scale before this update's step, where buffers are kept.
        self._scale: float | None = None

    def keep_buffers(self, model: nn.Module, scaler: torch.amp.GradScaler) -> None:
        """Before an update's forwards, when a step may be skipped (this policy, or fp16's loss
        `scaler`): copy every buffer of `model` (one copy each, per update and step), to put
        back if the step is skipped."""
        if not (self.enabled or scaler.is_enabled()):
            return
        self._kept = [  # `_buffers`: the public named_buffers costs twice as much, per step
            (module, name, buffer, buffer.clone())
            for module in model.modules()
            for name, buffer in module._buffers.items()
            if buffer is not None
        ]
        # The scale is read only for a model with buffers: a wait for the device (fp16's step
        # waits for it anyway, to see whether a gradient overflowed).
        self._scale = scaler.get_scale() if self._kept and scaler.is_enabled() else None

    def after_scaler_step(self, scaler: torch.amp.GradScaler) -> None:
        """After fp16's `scaler` stepped and updated: it lowers its scale when it skipped the
        step, whose buffers are then put back too."""
        if self._scale is not None and scaler.get_scale() < self._scale:
            self._put_back_buffers()

    def skips(self, step: int, grad_norm: torch.Tensor | None, update: str | None = None) -> bool:
        """Whether `step` (of `update`, in a task with `Task.updates`: each is skipped on its
        own, and counts) is skipped; a skipped step's buffers are put back as `keep_buffers`
        found them. Reads the norm, which waits for the device: the price of this policy, once
        per step."""
        if not self.enabled or grad_norm is None or bool(torch.isfinite(grad_norm)):
            return False
        self.skipped += 1
        of = "" if update is None else f" of {update}"
        message = (
            f"step {step}: the gradient norm{of} is {grad_norm.item()}; the step{of} is skipped "
            f"on every rank ({self.skipped} skipped, at most {self.limit})"
        )
        if self.skipped > self.limit:
            raise DivergenceError(
                f"{message}: too many. The newest checkpoint holds only finite values. Lower "
                "optim.lr, set optim.grad_clip, or check the data around that step."
            )
        if self.is_main:
            log.warning("%s", message)
        self._put_back_buffers()
        return True

    @torch.no_grad()
    def _put_back_buffers(self) -> None:
        """The kept values, in the tensors that were the buffers: those DDP broadcasts (a
        forward that gave a buffer's name a new tensor, as `self.mean = ...` does, gets the
        old one back)."""
        for module, name, buffer, kept in self._kept:
            setattr(module, name, buffer)
            buffer.copy_(kept)
