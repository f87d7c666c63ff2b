"""What a task's training loss is, and the sums that the log line reports.

`training_loss` (contract.py) returns a micro-batch mean, a (sum, count) pair, or a dict that
adds named components; `MicroLoss.of` reads any of them. The trainer sums everything it logs
in a `WindowSums` until the next log line, where the ranks' sums are gathered once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .contract import LossResult


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


class WindowSums:
    """Named sums over the micro-batches since the last log line.

    Tensors stay on the device and are only listed (adding them up would cost a kernel each,
    and reading one would wait for the device); plain numbers are added on the host. `totals`
    adds everything up in float64, once per log line.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._tensors: dict[str, list[torch.Tensor]] = {}
        self._numbers: dict[str, float] = {}
        self._carried: dict[str, torch.Tensor] = {}

    def add(self, name: str, value: torch.Tensor | float) -> None:
        if isinstance(value, torch.Tensor):
            self._tensors.setdefault(name, []).append(value.detach())
        else:
            self._numbers[name] = self._numbers.get(name, 0.0) + value

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
