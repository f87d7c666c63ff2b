"""Checkpoints written in the background while training goes on (`checkpoint.async`).

At a save, the state is copied into host memory: every tensor (into page-locked memory when
training runs on a GPU: the fastest copy from the device) and every other value, so that
training may change the live objects at once. That copy is the only pause. A thread then
writes it with `checkpoint.save_checkpoint`, whose waits for the other ranks and exchanges of
errors run on a gloo group of their own: they never interleave with the collectives of
training. The checkpoint counts once its COMPLETE marker is
written, as a synchronous one does; a crash before that leaves the previous checkpoints as the
newest complete ones.

At most one save is in flight: the next one waits for it first, and then reuses its host
buffers (a second copy of the state lives in host memory from the first save on). What follows
a complete save (the caller's `done`: the metrics flush, best.json, the log line) runs on the
training thread, in `poll` between steps or in `wait`, so that nothing else of the run is
touched from two threads. A failed save is raised by `wait` (at the next save, a stop, the end
of training) as CheckpointSaveError: `save_checkpoint` fails on every rank together, and every
rank reaches the same wait at the same step, so all of them raise it alike.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..cluster.distributed import is_distributed
from .checkpoint import CheckpointSaveError


class HostCopy:
    """Deep copies of a state in host memory, reusing the buffers of the previous copy.

    Tensors that share memory (tied weights) share it in the copy too, as torch.save keeps it.
    A buffer is reused when the tensor memory found at the same position of the state has the
    same size; the previous copy must no longer be read (its save is complete).
    """

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self._buffers: list[torch.UntypedStorage] = []

    def take(self, state: Any) -> Any:
        """`state` (dicts, lists and tuples of tensors and other values) copied to host memory.

        With pinned memory, the copies from a GPU are only queued on the current stream: wait
        for it before reading the copy.
        """
        previous, self._buffers = self._buffers, []
        copies: dict[tuple[torch.device, int], torch.UntypedStorage] = {}

        def tensor(value: torch.Tensor) -> torch.Tensor:
            source = value.untyped_storage()
            key = (source.device, source.data_ptr())
            if key not in copies:
                copies[key] = self._copy(source, previous)
            return torch.empty(0, dtype=value.dtype).set_(
                copies[key], value.storage_offset(), value.size(), value.stride()
            )

        return _copy_tree(state, tensor)

    def _copy(
        self, source: torch.UntypedStorage, previous: list[torch.UntypedStorage]
    ) -> torch.UntypedStorage:
        index = len(self._buffers)
        size = source.nbytes()
        if index < len(previous) and previous[index].nbytes() == size:
            buffer = previous[index]
        else:
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)
            buffer = buffer.untyped_storage()
        _as_bytes(buffer).copy_(_as_bytes(source), non_blocking=self.pin_memory)
        self._buffers.append(buffer)
        return buffer


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _copy_tree(value: Any, tensor: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`value` with every tensor in its dicts, lists and tuples replaced by `tensor(it)`, and
    every other value deep-copied: nothing of the copy is shared with the live objects."""
    if isinstance(value, torch.Tensor):
        return tensor(value)
    if isinstance(value, dict):
        copied = copy.copy(value)  # keeps the type and attributes (a state dict's _metadata)
        for key, item in value.items():
            copied[key] = _copy_tree(item, tensor)
        return copied
    if type(value) in (list, tuple):
        return type(value)(_copy_tree(item, tensor) for item in value)
    return copy.deepcopy(value)


@dataclass
class CompletedSave:
    """A save written in the background, as its `done` callback receives it."""

    step: int
    path: Path
    #: Seconds training paused to copy the state.
    stall_s: float
    #: Seconds the write took, from the end of the copy.
    write_s: float


@dataclass
class _InFlight:
    step: int
    done: Callable[[CompletedSave], None]
    thread: threading.Thread
    completed: CompletedSave | None = None
    error: BaseException | None = None


class BackgroundSaver:
    """Writes one checkpoint at a time in a thread, from a copy of the state in host memory.

    A collective at construction (every rank creates its saver at the same point): the gloo
    group of the saves, whose collectives wait up to `timeout_s` (dist.barrier_timeout_s).
    """

    def __init__(self, pin_memory: bool, timeout_s: float) -> None:
        self.host = HostCopy(pin_memory)
        self.group: dist.ProcessGroup | None = None
        if is_distributed():
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self._flight: _InFlight | None = None

    def start(
        self,
        step: int,
        state: Any,
        write: Callable[[Any], Path],
        done: Callable[[CompletedSave], None],
    ) -> float:
        """Wait for the save in flight (raising its failure), copy `state` to host memory and
        call `write(copy)` in a thread; `done` follows once it returns. Returns the seconds
        training paused for the copy."""
        self.wait()
        started = time.perf_counter()
        snapshot = self.host.take(state)
        if self.host.pin_memory:
            torch.cuda.current_stream().synchronize()  # the copies from the GPU have landed
        stall_s = time.perf_counter() - started

        def run() -> None:
            try:
                began = time.perf_counter()
                path = write(snapshot)
                flight.completed = CompletedSave(step, path, stall_s, time.perf_counter() - began)
            except BaseException as error:  # handed to the training thread by wait()
                flight.error = error

        thread = threading.Thread(target=run, name="checkpoint-writer", daemon=True)
        flight = _InFlight(step, done, thread)
        self._flight = flight
        thread.start()
        return stall_s

    def poll(self) -> None:
        """Between steps: when the save in flight has completed, run its `done`. A failure is
        left for `wait`, which every rank reaches at the same step."""
        flight = self._flight
        if flight is not None and flight.completed is not None:
            self._finish(flight, flight.completed)

    def wait(self) -> None:
        """Wait for the save in flight, if any: run its `done`, or raise its failure as
        CheckpointSaveError."""
        flight = self._flight
        if flight is None:
            return
        flight.thread.join()
        if flight.completed is not None:
            self._finish(flight, flight.completed)
            return
        self._flight = None
        if isinstance(flight.error, CheckpointSaveError):
            raise flight.error
        raise CheckpointSaveError(
            f"the checkpoint of step {flight.step}, written in the background, failed: "
            f"{type(flight.error).__name__}: {flight.error}. Earlier checkpoints are intact, "
            "and a relaunch resumes the newest of them."
        ) from flight.error

    def _finish(self, flight: _InFlight, completed: CompletedSave) -> None:
        self._flight = None
        flight.done(completed)
