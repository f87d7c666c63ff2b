"""What a task's training loss is, and the sums that the log line reports.

`training_loss` (contract.py) returns a micro-batch mean, a (sum, count) pair, or a dict that
adds named components; `MicroLoss.of` reads any of them, and `StepLoss` scales them so that a
step's gradient is the global batch's. The trainer sums everything it logs in a `WindowSums`
until the next log line, where the ranks' sums are gathered once.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..cluster.distributed import is_distributed
from ..contract import LossResult


@dataclass
class MicroLoss:
    """One micro-batch's loss: a mean when `count` is None, else a sum over `count` items."""

    value: torch.Tensor
    count: torch.Tensor | int | None = None
    parts: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, result: LossResult) -> MicroLoss:
        """Read what `training_loss` returned, or say which forms it may take."""
        if isinstance(result, torch.Tensor):
            return cls(result)
        if isinstance(result, tuple) and len(result) == 2:
            return cls(result[0], result[1])
        if isinstance(result, dict) and isinstance(result.get("loss"), torch.Tensor):
            parts = {name: value for name, value in result.items() if name not in ("loss", "count")}
            return cls(result["loss"], result.get("count"), parts)
        raise TypeError(
            "training_loss must return a scalar tensor (the micro-batch's mean loss), a pair "
            "(loss_sum, count), or a dict with 'loss', optionally 'count', and named scalar "
            f"components; got {type(result).__name__}"
        )


class StepLoss:
    """The losses of one optimizer step's micro-batches, scaled for backward so that the step's
    gradient is that of the global batch, on any world size and accumulation.

    A mean loss weighs every micro-batch alike: it is backpropagated over the accumulation
    steps. A (sum, count) loss is backpropagated as sum / (samples per rank per step), and once
    DDP has averaged the gradients, `rescale_gradients` multiplies them by global batch / global
    count: the gradient of the global batch's sum over its total count. The counts' all-reduce
    starts before the last backward and runs during it. Nothing here waits for the device.
    """

    def __init__(
        self,
        accumulation_steps: int,
        micro_batch_size: int,
        global_batch_size: int,
        device: torch.device,
        prefix: str = "",
    ) -> None:
        self.accumulation_steps = accumulation_steps
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.device = device
        #: The names of its sums in the log line's window: "<prefix>loss", "<prefix>count" and
        #: "<prefix>part/<component>" (`window_means`).
        self._loss, self._counted, self._part = f"{prefix}loss", f"{prefix}count", f"{prefix}part/"
        #: Whether the task's losses are (sum, count) pairs; fixed by its first micro-batch.
        self.is_sum: bool | None = None
        #: This step's micro-batch losses, detached: what the log line's window and the
        #: divergence guard keep past the step (the graph is freed with backward's locals).
        self.values: list[torch.Tensor] = []
        self._counts: list[torch.Tensor | int] = []
        self._parts: list[dict[str, torch.Tensor]] = []
        self._count: torch.Tensor | None = None
        self._reducing: dist.Work | None = None

    def start(self) -> None:
        """Forget the previous step's losses (new lists: the window and the guard keep them)."""
        self.values, self._counts, self._parts = [], [], []
        self._count = None
        self._reducing = None

    def add(self, result: LossResult, last: bool) -> torch.Tensor:
        """What to backpropagate for a micro-batch's `training_loss`; on the step's `last`
        micro-batch, the sum of the step's counts over the ranks starts."""
        loss = MicroLoss.of(result)
        if (loss.count is not None) is not self.is_sum:
            self._first_form(loss)
        self.values.append(loss.value.detach())
        if loss.parts:
            self._parts.append(loss.parts)
        if loss.count is None:
            return loss.value / self.accumulation_steps
        self._counts.append(loss.count)
        count = self._device_count(loss.count)
        self._count = count if self._count is None else self._count + count
        if last and is_distributed():
            self._reducing = dist.all_reduce(self._count, op=dist.ReduceOp.SUM, async_op=True)
        return loss.value / (self.micro_batch_size * self.accumulation_steps)

    def rescale_gradients(self, parameters: list[torch.nn.Parameter]) -> None:
        """(sum, count) losses: the averaged gradients times global batch / global count, a
        device scalar (no wait for the device). Nothing to do for mean losses."""
        if self._count is None:
            return
        if self._reducing is not None:
            self._reducing.wait()
        factor = self.global_batch_size / self._count.clamp(min=1)
        grads = [param.grad for param in parameters if param.grad is not None]
        for dtype in {grad.dtype for grad in grads}:
            same = [grad for grad in grads if grad.dtype == dtype]
            torch._foreach_mul_(same, factor.to(dtype))

    def add_to(self, window: WindowSums) -> None:
        """What the next log line reports: the step's losses and components with their counts
        (a skipped step's are left out; `window_means`)."""
        window.extend(self._loss, self.values)
        if self.is_sum:
            for count in self._counts:
                window.add(self._counted, count)
        else:
            window.add(self._counted, len(self.values))
        for parts in self._parts:
            for name, value in parts.items():
                window.add(self._part + name, value)

    def _first_form(self, loss: MicroLoss) -> None:
        """The first micro-batch's loss fixes its form (mean, or sum and count) for the whole
        run; another form later is refused."""
        if self.is_sum is not None:
            raise TypeError(
                "training_loss returned a count for some micro-batches and not for others: "
                "return (loss_sum, count) always, or a mean always"
            )
        self.is_sum = loss.count is not None

    def _device_count(self, count: torch.Tensor | float) -> torch.Tensor:
        """A count as a float64 device scalar; a number is filled in on the device, since
        copying it there would wait for the device."""
        if isinstance(count, torch.Tensor):
            return count.to(self.device, torch.float64)
        return torch.full((), float(count), dtype=torch.float64, device=self.device)


def window_means(totals: dict[str, float], prefixes: list[str]) -> dict[str, float]:
    """The log line's losses from the window's `totals`: each update's loss and components
    (`StepLoss.add_to`, one update per prefix) as means over its micro-batches, or over its
    counted items, named "train/<prefix>loss" and "train/<prefix><component>". An update whose
    steps in the window were all skipped has none."""
    means = {}
    for prefix in prefixes:
        if f"{prefix}loss" not in totals:
            continue
        count = totals[f"{prefix}count"]
        means[f"train/{prefix}loss"] = totals[f"{prefix}loss"] / count
        parts = f"{prefix}part/"
        for name in sorted(totals):
            if name.startswith(parts):
                means[f"train/{prefix}{name.removeprefix(parts)}"] = totals[name] / count
    return means


def detached(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` without its autograd graph, to keep past the step that made it. One that has
    none is returned as it is: a detach costs more than asking."""
    return tensor.detach() if tensor.requires_grad else tensor


class WindowSums:
    """Named sums over the micro-batches since the last log line.

    Tensors stay on the device and are only listed (adding them up would cost a kernel each,
    and reading one would wait for the device); plain numbers are added on the host. `totals`
    adds everything up in float64, once per log line.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._tensors: defaultdict[str, list[torch.Tensor]] = defaultdict(list)
        self._numbers: dict[str, float] = {}
        self._carried: dict[str, torch.Tensor] = {}

    def add(self, name: str, value: torch.Tensor | float) -> None:
        if isinstance(value, torch.Tensor):
            self._tensors[name].append(detached(value))
        else:
            self._numbers[name] = self._numbers.get(name, 0.0) + value

    def extend(self, name: str, tensors: list[torch.Tensor]) -> None:
        """Add `tensors`, detached already."""
        self._tensors[name].extend(tensors)

    def totals(self, names: list[str]) -> torch.Tensor:
        """The sums of `names`, in that order, as one float64 tensor on the device."""
        return torch.stack([self._total(name) for name in names])

    def names(self) -> list[str]:
        return sorted(self._tensors.keys() | self._numbers.keys() | self._carried.keys())

    def reset(self) -> None:
        self._tensors.clear()
        self._numbers.clear()
        self._carried.clear()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The sums so far (for a checkpoint: a resumed run's next log line then matches)."""
        return {name: self._total(name).cpu() for name in self.names()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.reset()
        self._carried = {name: value.to(self.device) for name, value in state.items()}

    def _total(self, name: str) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        if name in self._carried:
            total = total + self._carried[name]
        if self._tensors.get(name):
            total = total + torch.stack(self._tensors[name]).double().sum()
        return total + self._numbers.get(name, 0.0)
