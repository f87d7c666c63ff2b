"""Replicas that drift apart: compared at every log line and before every checkpoint.

DDP keeps the ranks' replicas identical only while every change of a parameter goes through
it: the gradients of a backward through its forward are all-reduced, every rank holds the same
bits, and the optimizer steps them alike. Whatever rounds differently from rank to rank in a
forward (other samples, a non-deterministic kernel) changes only the local gradients, which
the all-reduce averages: the replicas stay bitwise equal, on CPUs and GPUs alike. Three things
break that without failing: a forward that bypasses the DDP wrapper (`model.module(x)`), whose
gradients are never all-reduced; a parameter changed outside the optimizer step (in place in
`training_loss`, in a hook); an update on some ranks only. Each rank then trains a model of
its own, rank 0's is saved, and the run ends with exit status 0.

So each rank adds up the bit patterns of its parameters as integers: a sum in any order
gives the same integer, so any kernel on any device gives the same checksum for the same
bits, and a single changed bit changes it. The checksum rides in the all-gather that the log
line and the checkpoint make anyway, and the ranks compare it exactly. Buffers are left out:
BatchNorm's running statistics differ between ranks by design (rank 0's are saved). On a
mismatch a second all-gather compares the parameters one by one, and every rank stops alike,
naming them, the ranks and the steps since the last comparison that matched.
"""

from __future__ import annotations

import torch
from torch import nn

from ..cluster.distributed import ReplicaMismatchError, gather_rows, is_distributed
from .updates import Update

#: The signed integer type of each element size, as which the parameters' bits are summed
#: (a float64 as two int32, whose sum in int64 cannot overflow).
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int32}
#: The checksum's bits that a float64 holds exactly: the gathers carry float64. Two ranks'
#: sums that differ by less than 2**52 differ in them.
_KEPT_BITS = (1 << 52) - 1


class ReplicaCheck:
    """This rank's checksum of the model's parameters, and the comparison of every rank's."""

    def __init__(self, model: nn.Module, updates: list[Update], device: torch.device) -> None:
        # Parameters DDP was told to leave alone may differ by design.
        ignored = {
            id(param)
            for update in updates
            if update.ddp is not None
            for name, param in update.module.named_parameters()
            if name in getattr(update.ddp, "parameters_to_ignore", ())
        }
        self._named = [(n, p) for n, p in model.named_parameters() if id(p) not in ignored]
        self.device = device
        #: The step of the last comparison that matched; a launch starts with equal replicas
        #: (DDP broadcasts rank 0's; a resume loads the same checkpoint on every rank).
        self.matched_at = 0
        self._sums: torch.Tensor | None = None

    @torch.no_grad()
    def checksum(self) -> torch.Tensor:
        """This rank's share of a gather: one float64 entry, none for a single process. One
        reduction per parameter, without waiting for the device; the per-parameter sums are
        kept for a closer look at a mismatch."""
        if not is_distributed() or not self._named:
            return torch.zeros(0, dtype=torch.float64, device=self.device)
        self._sums = torch.stack([_bit_sum(param) for _, param in self._named])
        return (self._sums.sum() & _KEPT_BITS).double().reshape(1)

    def raise_if_differ(self, rows: torch.Tensor, step: int) -> None:
        """Raise ReplicaMismatchError on every rank alike if the gathered checksums (a row per
        rank) differ; else note `step` as the last that matched. A collective on a mismatch."""
        if rows.numel() == 0 or bool((rows == rows[0]).all()):
            self.matched_at = step
            return
        sums = gather_rows(self._sums).cpu()
        ranks = [str(rank) for rank in range(1, len(sums)) if not torch.equal(sums[rank], sums[0])]
        differ = (sums != sums[0]).any(dim=0).tolist()
        names = [name for (name, _), differs in zip(self._named, differ, strict=True) if differs]
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        since = self.matched_at + 1
        steps = f"step {step}" if since == step else f"steps {since} to {step}"
        raise ReplicaMismatchError(
            f"step {step}: the model's replicas differ between ranks: rank(s) {', '.join(ranks)} "
            f"hold other values than rank 0 in {len(names)} of {len(self._named)} parameter(s) "
            f"({shown}), which every rank held alike at step {self.matched_at}. DDP keeps the "
            "replicas identical only when every change of a parameter goes through it, and "
            f"something in {steps} did not: a forward that "
            "bypasses the DDP wrapper (`model.module(...)`, `getattr(model, 'module', "
            "model)(...)`), whose gradients are never all-reduced; a parameter changed outside "
            "the optimizer step (in place in training_loss, in a hook); or an update on some "
            "ranks only. Call the model training_loss is given, and change parameters through "
            "the optimizer only (Task.build_optimizer for an update rule of your own). "
            "dist.check_replicas_every=1 compares them after every step, to find the step."
        )


def _bit_sum(param: torch.Tensor) -> torch.Tensor:
    """The sum of `param`'s elements read as signed integers, in int64 (without a graph: the
    caller runs under no_grad). Only a float64 is flattened first (a copy if not contiguous),
    to be read as twice as many int32; one op less for the others."""
    size = param.element_size()
    return (param.reshape(-1) if size == 8 else param).view(_BITS[size]).sum(dtype=torch.int64)
