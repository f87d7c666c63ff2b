"""Atomic, verified checkpoints, and finding the newest one that is intact.

Layout: `<run.dir>/checkpoints/step_00000100/` holds `state.pt` (the replicated state, written by
rank 0 only), `rank_00000.pt`, `rank_00001.pt`, ... (each rank's own RNG state) and `COMPLETE`.
A checkpoint is assembled in a hidden temporary directory, `COMPLETE` is written last, and the
directory is renamed into place in one `os.replace`: a crash at any moment leaves either the
previous checkpoints untouched or a hidden directory that is never loaded.

`COMPLETE` records the size and SHA-256 of every file. A file that was cut short or changed
after the save (a full disk, a failing file system, a copy that stopped half-way) is found
before loading: every rank then falls back to the newest checkpoint that all of them can load,
and the damaged one is moved aside as `step_NNNNNNNN.corrupt` for inspection, never deleted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from .distributed import DistEnv, all_ranks_agree, barrier

log = logging.getLogger(__name__)

COMPLETE_MARKER = "COMPLETE"
STATE_FILE = "state.pt"
CORRUPT_SUFFIX = ".corrupt"
_CHECKPOINT_NAME = re.compile(r"^step_(\d{8})$")
_CHUNK = 1 << 20


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file does not match what its COMPLETE marker recorded, or cannot be read."""


@dataclass
class LoadedCheckpoint:
    """A checkpoint every rank could load: the replicated state, and this rank's own state when
    the checkpoint was written by as many ranks as this run has."""

    path: Path
    state: dict[str, Any]
    rank_state: dict[str, Any] | None
    world_size: int


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
    replicated state and the completion marker (with each file's size and checksum), renames the
    directory into place and prunes old checkpoints. Barriers separate the phases; no collective
    runs inside a rank-0-only branch.
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
        files = {STATE_FILE: _atomic_save(state, staging / STATE_FILE)}
        for rank in range(env.world_size):
            files[rank_file(rank)] = _digest(staging / rank_file(rank))
        marker = {"step": step, "world_size": env.world_size, "files": files}
        atomic_write_text(staging / COMPLETE_MARKER, json.dumps(marker, indent=2) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        fsync_dir(root)
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
    """The newest complete checkpoint (not yet verified), or None for a fresh run."""
    checkpoints = complete_checkpoints(run_dir)
    return checkpoints[-1] if checkpoints else None


def load_checkpoint(path: Path, rank: int, world_size: int) -> LoadedCheckpoint:
    """Verify and load one checkpoint on the CPU, with the safe unpickler.

    The rank file is loaded only when the checkpoint was written by `world_size` ranks: per-rank
    state means nothing on another number of ranks. Raises CorruptCheckpointError naming the
    file that is missing, cut short, changed or unreadable.
    """
    marker_path = path / COMPLETE_MARKER
    if not marker_path.is_file():
        raise CorruptCheckpointError(
            f"{path} has no {COMPLETE_MARKER} marker: it is incomplete and cannot be loaded"
        )
    try:
        marker = json.loads(marker_path.read_text())
        saved_world_size = int(marker["world_size"])
    except (ValueError, KeyError, TypeError) as error:
        raise CorruptCheckpointError(f"{marker_path} is unreadable: {error}") from error
    names = [STATE_FILE]
    if saved_world_size == world_size:
        names.append(rank_file(rank))
    loaded = [_load_verified(path / name, marker.get("files")) for name in names]
    return LoadedCheckpoint(
        path=path,
        state=loaded[0],
        rank_state=loaded[1] if len(loaded) > 1 else None,
        world_size=saved_world_size,
    )


def load_newest_intact(run_dir: Path, env: DistEnv) -> LoadedCheckpoint | None:
    """The newest checkpoint that every rank can load, or None when there is none.

    A collective: every rank tries the same checkpoints, newest first, and they agree after each
    one, so all of them resume from the same step. Damaged checkpoints are reported, naming the
    file, and moved aside by rank 0.
    """
    for path in reversed(complete_checkpoints(run_dir)):
        try:
            loaded: LoadedCheckpoint | None = load_checkpoint(path, env.rank, env.world_size)
        except CorruptCheckpointError as error:
            log.warning("cannot resume from %s on rank %d: %s", path.name, env.rank, error)
            loaded = None
        if all_ranks_agree(loaded is not None):
            return loaded
        if env.is_main:
            aside = path.with_name(path.name + CORRUPT_SUFFIX)
            os.replace(path, aside)
            log.warning(
                "checkpoint %s cannot be loaded on every rank; moved it to %s and trying the "
                "previous one",
                path,
                aside.name,
            )
    return None


def prune_checkpoints(run_dir: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` complete checkpoints; drop older ones and abandoned staging."""
    root = checkpoint_root(run_dir)
    for old in complete_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old)
    for leftover in root.glob(".step_*.tmp"):
        shutil.rmtree(leftover, ignore_errors=True)


def _load_verified(path: Path, recorded: dict[str, Any] | list[str] | None) -> dict[str, Any]:
    if not path.is_file():
        raise CorruptCheckpointError(f"{path.name} is missing")
    # Checkpoints from before checksums were recorded hold a plain list of names.
    expected = recorded.get(path.name) if isinstance(recorded, dict) else None
    if expected is not None:
        found = _digest(path)
        if found["bytes"] != expected["bytes"]:
            raise CorruptCheckpointError(
                f"{path.name} has {found['bytes']} bytes, {expected['bytes']} were written"
            )
        if found["sha256"] != expected["sha256"]:
            raise CorruptCheckpointError(
                f"{path.name} does not match its SHA-256 checksum: it changed after it was saved"
            )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # any unpickling or zip error means the same: unusable
        raise CorruptCheckpointError(f"{path.name} cannot be loaded: {error}") from error


def _digest(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": digest.hexdigest()}


class _HashingWriter:
    """Passes writes through to a file while counting and hashing them: no second read."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle = handle
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.handle.write(data)

    def flush(self) -> None:
        self.handle.flush()


def _atomic_save(obj: Any, path: Path) -> dict[str, Any]:
    """torch.save to a temporary name, fsync, rename; returns the file's size and checksum."""
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as handle:
        writer = _HashingWriter(handle)
        torch.save(obj, writer)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return {"bytes": writer.size, "sha256": writer.digest.hexdigest()}


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to a temporary name, fsync, rename: a reader sees all of it or none."""
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    """Make the renames inside `path` durable (a crash could otherwise undo them)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
