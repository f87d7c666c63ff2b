"""Atomic, complete checkpoints and finding the one to resume from.

Layout: `<run.dir>/checkpoints/step_00000100/` holds `state.pt` (the replicated state, written by
rank 0 only), `rank_00000.pt`, `rank_00001.pt`, ... (each rank's own RNG state) and `COMPLETE`.
A checkpoint is assembled in a hidden temporary directory, `COMPLETE` is written last, and the
directory is renamed into place in one `os.replace`: a crash at any moment leaves either the
previous checkpoints untouched or a hidden directory that is never loaded.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from .distributed import DistEnv, barrier

COMPLETE_MARKER = "COMPLETE"
STATE_FILE = "state.pt"
_CHECKPOINT_NAME = re.compile(r"^step_(\d{8})$")


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def save_checkpoint(
    run_dir: Path,
    step: int,
    state: dict[str, Any],
    rank_state: dict[str, Any],
    env: DistEnv,
    keep_last: int,
) -> Path:
    """Write a checkpoint collectively: every rank must call this at the same step.

    Rank 0 creates the temporary directory, every rank writes its own file, rank 0 writes the
    replicated state and the completion marker, renames the directory into place and prunes old
    checkpoints. Barriers separate the phases; no collective runs inside a rank-0-only branch.
    """
    root = checkpoint_root(run_dir)
    final = root / f"step_{step:08d}"
    staging = root / f".step_{step:08d}.tmp"
    if env.is_main:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    barrier()
    _atomic_save(rank_state, staging / rank_file(env.rank))
    barrier()
    if env.is_main:
        _atomic_save(state, staging / STATE_FILE)
        marker = {
            "step": step,
            "world_size": env.world_size,
            "files": sorted(p.name for p in staging.iterdir()),
        }
        _atomic_write_text(staging / COMPLETE_MARKER, json.dumps(marker, indent=2) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        _fsync_dir(root)
        prune_checkpoints(run_dir, keep_last)
    barrier()
    return final


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first. Directories without the marker are ignored."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [
        path
        for path in root.iterdir()
        if _CHECKPOINT_NAME.match(path.name) and (path / COMPLETE_MARKER).is_file()
    ]
    return sorted(found, key=lambda path: path.name)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None for a fresh run."""
    checkpoints = complete_checkpoints(run_dir)
    return checkpoints[-1] if checkpoints else None


def load_checkpoint(path: Path, rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load (replicated state, this rank's state) on the CPU, with the safe unpickler."""
    if not (path / COMPLETE_MARKER).is_file():
        raise FileNotFoundError(
            f"{path} has no {COMPLETE_MARKER} marker: it is incomplete and cannot be loaded"
        )
    own = path / rank_file(rank)
    if not own.is_file():
        raise FileNotFoundError(f"{path} has no state for rank {rank} ({own.name})")
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    rank_state = torch.load(own, map_location="cpu", weights_only=True)
    return state, rank_state


def prune_checkpoints(run_dir: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` complete checkpoints; drop older ones and abandoned staging."""
    root = checkpoint_root(run_dir)
    for old in complete_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old)
    for leftover in root.glob(".step_*.tmp"):
        shutil.rmtree(leftover, ignore_errors=True)


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
