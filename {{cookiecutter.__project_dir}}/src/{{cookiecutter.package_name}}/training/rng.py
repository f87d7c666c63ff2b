"""Every random stream a task may draw from: Python's, NumPy's, torch's (CPU and CUDA).

The trainer seeds them per rank; the checkpointer saves them in each rank's checkpoint file
and restores them on resume, so that dropout and augmentation continue exactly where they
stopped; the data's random draws are seeded per sample (data.py). NumPy's is included whenever NumPy
is installed, since a task may import it at any time.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

try:
    import numpy
except ImportError:  # NumPy is optional: then there is no NumPy stream to seed
    numpy = None


def seed_all(seed: int) -> None:
    """Seed Python, NumPy (when installed) and torch (CPU and every CUDA device)."""
    random.seed(seed)
    if numpy is not None:
        numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def seed_sample(seed: int) -> None:
    """Seed Python, NumPy (when installed) and torch's CPU generator for one sample: what a
    data set draws from, at a twentieth of seed_all's cost (no device generators)."""
    random.seed(seed)
    if numpy is not None:
        numpy.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)


@contextmanager
def generators_kept() -> Iterator[None]:
    """Put back Python's, NumPy's and torch's CPU generators as they were before the block."""
    python, cpu = random.getstate(), torch.get_rng_state()
    state = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        random.setstate(python)
        torch.set_rng_state(cpu)
        if state is not None:
            numpy.random.set_state(state)


def seed_rank(seed: int, rank: int, step: int) -> None:
    """This rank's own streams (dropout, augmentation), from the run's seed, the rank and the
    step: at the start of a run, and on resuming on another number of ranks."""
    seed_all(seed + rank + step * 1_000_003)


def capture(device: torch.device) -> dict[str, Any]:
    """This process's generator states, as tensors and plain values (safe to unpickle)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if numpy is not None:
        kind, keys, position, has_gauss, gauss = numpy.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), position, has_gauss, gauss)
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore(state: dict[str, Any], device: torch.device) -> None:
    """Put back what `capture` returned; a checkpoint without a NumPy state leaves NumPy's."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if numpy is not None and "numpy" in state:
        kind, keys, position, has_gauss, gauss = state["numpy"]
        numpy.random.set_state((kind, keys.numpy().astype("uint32"), position, has_gauss, gauss))
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
