"""Atomic, verified checkpoints, and the newest one that every rank can use.

Layout: `<run.dir>/checkpoints/step_00000100/` holds `state.pt` (the replicated state, written by
rank 0 only), `rank_00000.pt`, `rank_00001.pt`, ... (each rank's own RNG state) and `COMPLETE`.
A checkpoint is assembled in a hidden staging directory named for its step and for the job that
writes it (`.step_00000100.<job>.tmp`), `COMPLETE` is written last, and the directory is renamed
into place in one `os.replace`: a crash at any moment leaves either the previous checkpoints
untouched or a hidden directory that is never loaded. A job removes only its own staging; what
another job left is removed by `remove_foreign_staging`, once no other job can be writing.

A save that fails on any rank, in any phase (a full disk, a failing file system), removes its
staging directory and fails on every rank, saying the checkpoint's size and the free space;
every earlier checkpoint is left as it was. Rank 0 refuses to start a save when the previous
checkpoint would not fit in the free space.

`COMPLETE` records the checkpoint's format version and the size and SHA-256 of every file. On
resume, rank 0 chooses (its newest checkpoint) and every rank loads the same one, or all of them
go on to the previous one together; what each case does:

- a file missing, cut short, changed or in no readable format: the checkpoint is damaged, and
  moved aside as `step_NNNNNNNN.corrupt` (`.corrupt-2`, ... when that name is taken), never deleted;
- a newer format, or a state without what this version needs: not damaged, but of another
  version; moved aside as `step_NNNNNNNN.incompatible` only when the run goes on without it;
- out of memory, permission denied, an I/O error while the bytes are those written: the job ends
  on every rank naming the file and the error, and nothing is changed;
- a rank that does not see the chosen checkpoint within LISTING_WAIT_S: the job ends on every
  rank, naming the file system as not shared or not consistent.

Checkpoints that exist but of which none can be used never lead to a silent start at step 0:
NoUsableCheckpointError lists them, and the caller refuses or starts over as configured.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from .distributed import DistEnv, barrier, gather_objects

log = logging.getLogger(__name__)

COMPLETE_MARKER = "COMPLETE"
STATE_FILE = "state.pt"
CORRUPT_SUFFIX = ".corrupt"
INCOMPATIBLE_SUFFIX = ".incompatible"
#: The version of what a checkpoint holds, recorded in COMPLETE. Checkpoints from before it was
#: recorded are version 1: they load when they hold every key below.
FORMAT_VERSION = 2
#: What this version reads from state.pt and from a rank file without a default.
REQUIRED_STATE_KEYS = ("model", "optimizer", "scheduler", "scaler", "step", "config")
REQUIRED_RANK_KEYS = ("rng",)
#: How long a rank waits to see the checkpoint rank 0 chose: NFS caches directory listings for
#: up to a minute (acdirmax) by default.
LISTING_WAIT_S = 90.0
#: The bound on the waits around a save, from the previous save's write time: a rank that
#: takes longer has hung. Never shorter than the floor, never longer than dist.barrier_timeout_s.
SAVE_TIMEOUT_FACTOR = 4.0
SAVE_TIMEOUT_FLOOR_S = 300.0
_CHECKPOINT_NAME = re.compile(r"^step_(\d{8})$")
_SET_ASIDE_NAME = re.compile(r"^step_\d{8}\.(corrupt|incompatible)(-\d+)?$")
_CHUNK = 1 << 20
# Errors of torch.load that come from the machine, not from the file's bytes.
_RESOURCE_MESSAGES = ("allocate memory", "out of memory", "read failed")


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file does not match what its COMPLETE marker recorded, or cannot be read."""


class IncompatibleCheckpointError(RuntimeError):
    """An intact checkpoint of another format: newer, or without what this version needs."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read for a reason that ends the job on every rank."""


class CheckpointReadError(CheckpointError):
    """Loading failed for a reason other than damage (memory, permission, I/O, a file system
    that differs between ranks); nothing was changed."""


class CheckpointSaveError(CheckpointError):
    """A save failed; its staging directory is removed and earlier checkpoints are intact."""


class NoUsableCheckpointError(CheckpointError):
    """The run directory holds checkpoints, and none of them can continue the run."""

    def __init__(self, message: str, incompatible: list[Path]) -> None:
        super().__init__(message)
        #: Intact checkpoints of another format, left in place.
        self.incompatible = incompatible


@dataclass
class LoadedCheckpoint:
    """A checkpoint every rank could load: the replicated state, and this rank's own state when
    the checkpoint was written by as many ranks as this run has."""

    path: Path
    state: dict[str, Any]
    rank_state: dict[str, Any] | None
    world_size: int
    #: The checkpoint's format version (FORMAT_VERSION when it was written by this version).
    format: int = FORMAT_VERSION
    #: Newer checkpoints of another format that the run goes on without: the caller sets
    #: them aside before the run's own saves could replace or prune them.
    skipped: list[Path] = field(default_factory=list)


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def new_job_token() -> str:
    """A name for this job, unique among the jobs that could share a run directory: host,
    process id and start time (of rank 0, which every rank then uses)."""
    host = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())
    return f"{host}-{os.getpid()}-{time.strftime('%Y%m%dT%H%M%S')}"


def save_timeout_s(previous_write_s: float | None, ceiling_s: float) -> float:
    """How long the ranks wait for each other around a save: `ceiling_s`
    (dist.barrier_timeout_s) for the first save of a launch, then a bound from the previous
    save's write time, so that a rank hung in a save ends the job in bounded time."""
    if previous_write_s is None:
        return ceiling_s
    return min(ceiling_s, max(SAVE_TIMEOUT_FLOOR_S, SAVE_TIMEOUT_FACTOR * previous_write_s))


def save_checkpoint(
    run_dir: Path,
    step: int,
    state: dict[str, Any],
    rank_state: dict[str, Any],
    env: DistEnv,
    keep_last: int,
    job: str | None = None,
    timeout_s: float | None = None,
    keep: Collection[str] = (),
) -> Path:
    """Write a checkpoint collectively: every rank must call this at the same step.

    Rank 0 checks the free space and creates the staging directory, every rank writes its own
    file, rank 0 writes the replicated state and the completion marker (with each file's size
    and checksum), renames the directory into place and prunes old checkpoints (never those
    named in `keep`). After each phase the ranks wait for each other for up to `timeout_s`
    (naming a rank that does not arrive) and share their errors: no collective runs inside a
    rank-0-only branch, and a failure anywhere fails the save everywhere. Raises
    CheckpointSaveError. `job` names the staging directory (default: this process, which is
    right for a single process only: ranks must pass the same name).
    """
    job = job or new_job_token()
    root = checkpoint_root(run_dir)
    final = root / f"step_{step:08d}"
    staging = _staging(root, step, job)
    previous = latest_checkpoint(run_dir) if env.is_main else None
    phase = _SavePhase(env, final, staging, previous, timeout_s)

    def prepare() -> None:
        if previous is not None:
            _require_room(root, checkpoint_size(previous))
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)

    def publish() -> None:
        files = {STATE_FILE: _atomic_save(state, staging / STATE_FILE)}
        for rank in range(env.world_size):
            files[rank_file(rank)] = _digest(staging / rank_file(rank))
        marker = {
            "format": FORMAT_VERSION,
            "step": step,
            "world_size": env.world_size,
            "files": files,
        }
        atomic_write_text(staging / COMPLETE_MARKER, json.dumps(marker, indent=2) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        fsync_dir(root)
        prune_checkpoints(run_dir, keep_last, job, keep)

    phase.run(prepare if env.is_main else None)
    phase.run(lambda: _atomic_save(rank_state, staging / rank_file(env.rank)))
    phase.run(publish if env.is_main else None)
    return final


class _SavePhase:
    """One phase of a save on every rank: this rank's part, then the wait for every rank and
    the exchange of errors. On any rank's error, rank 0 removes the staging directory and every
    rank raises the same CheckpointSaveError."""

    def __init__(
        self,
        env: DistEnv,
        final: Path,
        staging: Path,
        previous: Path | None,
        timeout_s: float | None,
    ) -> None:
        self.env, self.final, self.staging = env, final, staging
        self.previous, self.timeout_s = previous, timeout_s

    def run(self, part: Callable[[], object] | None) -> None:
        error = None
        try:
            if part is not None:
                part()
        except OSError as caught:
            error = f"rank {self.env.rank}: {caught}"
        try:
            barrier(self.timeout_s)
        except RuntimeError as late:
            self._remove_staging()
            waited = (
                "dist.barrier_timeout_s" if self.timeout_s is None else f"{self.timeout_s:.0f} s"
            )
            raise CheckpointSaveError(
                f"checkpoint {self.final.name}: not every rank finished its part of the save "
                f"within {waited} ({late}). A rank that takes that long has hung "
                "(a file system that stopped answering, a stuck process); earlier checkpoints "
                "are intact, and a relaunch resumes the newest of them."
            ) from late
        errors = [message for message in gather_objects(error) if message]
        if not errors:
            return
        message = self._failure(errors) if self.env.is_main else None
        raise CheckpointSaveError(gather_objects(message)[0])

    def _failure(self, errors: list[str]) -> str:
        """Rank 0: remove the staging directory and say what was written and what is free."""
        written = _tree_size(self.staging)
        self._remove_staging()
        root = self.final.parent
        free = shutil.disk_usage(root).free
        needed = "there is no previous checkpoint to compare with"
        if self.previous is not None:
            size = _amount(checkpoint_size(self.previous))
            needed = f"the previous checkpoint, {self.previous.name}, takes {size}"
        wrote = f"{_amount(written)} of it had been written, " if written else ""
        return (
            f"cannot save checkpoint {self.final.name} ({'; '.join(errors)}): {wrote}{needed}, "
            f"and {_amount(free)} are free in {root}. The staging directory is removed and the "
            "earlier checkpoints are intact: free space (or lower checkpoint.keep_last, or move "
            "run.dir), then launch again to continue from the newest of them."
        )

    def _remove_staging(self) -> None:
        if self.env.is_main:
            shutil.rmtree(self.staging, ignore_errors=True)


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


def set_aside_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoints moved aside as damaged or of another format, by name."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    return sorted(path for path in root.iterdir() if _SET_ASIDE_NAME.match(path.name))


def checkpoint_size(path: Path) -> int:
    """Bytes of the files of one checkpoint directory."""
    return _tree_size(path)


def room_warning(run_dir: Path, keep_last: int) -> str | None:
    """A warning when the run directory's file system cannot hold `keep_last` + 1 checkpoints
    (the peak: a new one is complete before the oldest is pruned), estimated from the newest."""
    newest = latest_checkpoint(run_dir)
    if newest is None:
        return None
    size = checkpoint_size(newest)
    held = sum(checkpoint_size(path) for path in complete_checkpoints(run_dir))
    needed = (keep_last + 1) * size - held
    free = shutil.disk_usage(checkpoint_root(run_dir)).free
    if free >= needed:
        return None
    return (
        f"{checkpoint_root(run_dir)} has {_amount(free)} free, but checkpoint.keep_last="
        f"{keep_last} needs about {_amount(needed)} more: {keep_last + 1} checkpoints of "
        f"{_amount(size)} at the peak of a save. A save will fail for lack of space; free some, "
        "or lower checkpoint.keep_last."
    )


def load_checkpoint(path: Path, rank: int, world_size: int) -> LoadedCheckpoint:
    """Verify and load one checkpoint on the CPU, with the safe unpickler.

    The rank file is loaded only when the checkpoint was written by `world_size` ranks: per-rank
    state means nothing on another number of ranks. Raises CorruptCheckpointError naming the
    file that is missing, cut short, changed or unreadable, and CheckpointReadError for an
    error of the machine (memory, permission, I/O), which says nothing about the checkpoint.
    Whether its contents are what this version resumes from is `require_resumable`'s question.
    """
    marker_path = path / COMPLETE_MARKER
    try:
        text = marker_path.read_text()
    except FileNotFoundError as error:
        raise CorruptCheckpointError(
            f"{path} has no {COMPLETE_MARKER} marker: it is incomplete and cannot be loaded"
        ) from error
    except OSError as error:
        raise _read_error(marker_path, error) from error
    try:
        marker = json.loads(text)
        saved_world_size = int(marker["world_size"])
        version = int(marker.get("format", 1))
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CorruptCheckpointError(f"{marker_path} is unreadable: {error}") from error
    state = _load_verified(path / STATE_FILE, marker.get("files"))
    rank_state = None
    if saved_world_size == world_size:
        rank_state = _load_verified(path / rank_file(rank), marker.get("files"))
    return LoadedCheckpoint(
        path=path,
        state=state,
        rank_state=rank_state,
        world_size=saved_world_size,
        format=version,
    )


def require_resumable(loaded: LoadedCheckpoint) -> None:
    """Raise IncompatibleCheckpointError, naming what is missing, unless this version can
    resume from `loaded`: a format it knows, and every key it reads."""
    if loaded.format > FORMAT_VERSION:
        raise IncompatibleCheckpointError(
            f"{loaded.path.name} is of checkpoint format {loaded.format}, and this version of "
            f"the project reads formats up to {FORMAT_VERSION}: it was written by a newer version"
        )
    _require_keys(loaded.state, REQUIRED_STATE_KEYS, f"{loaded.path.name}/{STATE_FILE}")
    if loaded.rank_state is not None:
        _require_keys(loaded.rank_state, REQUIRED_RANK_KEYS, f"a rank file of {loaded.path.name}")


def load_newest_intact(run_dir: Path, env: DistEnv) -> LoadedCheckpoint | None:
    """The newest checkpoint that every rank can load, or None when the run has none.

    A collective. Rank 0 lists the checkpoints, and every rank tries the ones it names, newest
    first, agreeing after each one, so all of them resume from the same step. Damaged ones are
    reported, naming the file, and moved aside by rank 0; those of another format are skipped.
    Raises CheckpointReadError when a rank cannot read or see one for a reason other than
    damage, and NoUsableCheckpointError when checkpoints exist and none can be used.
    """
    listing = None
    if env.is_main:
        listing = (
            [path.name for path in reversed(complete_checkpoints(run_dir))],
            [path.name for path in set_aside_checkpoints(run_dir)],
        )
    names, earlier = gather_objects(listing)[0]
    root = checkpoint_root(run_dir)
    unusable: list[str] = []
    incompatible: list[Path] = []
    for name in names:
        path = root / name
        loaded, kind, reason = _try_load(path, run_dir, env)
        outcomes = gather_objects((kind, reason))
        fatal = [
            f"rank {rank}: {why}" for rank, (what, why) in enumerate(outcomes) if what == _FATAL
        ]
        if fatal:
            raise CheckpointReadError("; ".join(fatal))
        if loaded is not None and all(what == _USABLE for what, _ in outcomes):
            loaded.skipped = incompatible
            return loaded
        if any(what == _DAMAGED for what, _ in outcomes):
            why = next(why for what, why in outcomes if what == _DAMAGED)
            aside = _set_aside_on_rank_0(path, env)
            unusable.append(f"{name} (damaged: {why}; moved to {aside})")
            if env.is_main:
                log.warning(
                    "checkpoint %s cannot be loaded on every rank; moved it to %s and trying "
                    "the previous one",
                    path,
                    aside,
                )
        else:
            why = next(why for what, why in outcomes if what == _INCOMPATIBLE)
            unusable.append(f"{name} (another format: {why})")
            incompatible.append(path)
            if env.is_main:
                log.warning("checkpoint %s is skipped: %s", name, why)
    if not unusable and not earlier:
        return None
    tried = "; ".join(unusable) if unusable else "no complete checkpoint is left"
    before = f" Set aside by earlier launches: {', '.join(earlier)}." if earlier else ""
    raise NoUsableCheckpointError(
        f"no checkpoint in {root} can continue this run: {tried}.{before}", incompatible
    )


def _set_aside_on_rank_0(path: Path, env: DistEnv) -> str:
    """Rank 0 moves a damaged checkpoint aside; every rank learns its new name, or the error
    that stopped the move (then the job ends on every rank: nothing else was changed)."""
    moved: tuple[str, str] | None = None
    if env.is_main:
        try:
            moved = ("moved", set_aside(path, CORRUPT_SUFFIX).name)
        except OSError as error:
            moved = ("error", f"cannot move the damaged checkpoint {path} aside: {error}")
    outcome, text = gather_objects(moved)[0]
    if outcome == "error":
        raise CheckpointReadError(text)
    return text


def set_aside(path: Path, suffix: str) -> Path:
    """Move a checkpoint out of the way under `name + suffix` (with -2, -3, ... when taken)."""
    aside = path.with_name(path.name + suffix)
    number = 1
    while aside.exists():
        number += 1
        aside = path.with_name(f"{path.name}{suffix}-{number}")
    os.rename(path, aside)
    return aside


def prune_checkpoints(run_dir: Path, keep_last: int, job: str, keep: Collection[str] = ()) -> None:
    """Keep the newest `keep_last` complete checkpoints and those named in `keep`; drop older
    ones and this job's abandoned staging (another job's may be a save in flight)."""
    root = checkpoint_root(run_dir)
    for old in complete_checkpoints(run_dir)[:-keep_last]:
        if old.name not in keep:
            try:
                shutil.rmtree(old)
            except OSError as error:  # the new checkpoint is safe: not a reason to stop
                log.warning("cannot remove the old checkpoint %s: %s", old, error)
    for leftover in root.glob(f".step_*.{job}.tmp"):
        shutil.rmtree(leftover, ignore_errors=True)


def remove_foreign_staging(run_dir: Path, job: str) -> list[Path]:
    """Remove the staging directories other jobs left (a save they never finished); call only
    when no other job can be running in `run_dir`. Returns what was removed."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    foreign = [path for path in root.glob(".step_*.tmp") if not path.name.endswith(f".{job}.tmp")]
    for path in foreign:
        shutil.rmtree(path, ignore_errors=True)
    return foreign


_USABLE, _DAMAGED, _INCOMPATIBLE, _FATAL = "usable", "damaged", "incompatible", "fatal"


def _try_load(path: Path, run_dir: Path, env: DistEnv) -> tuple[LoadedCheckpoint | None, str, str]:
    """This rank's attempt at the checkpoint rank 0 chose: (loaded, outcome, reason)."""
    if not env.is_main and not _wait_until_listed(run_dir, path.name):
        return (
            None,
            _FATAL,
            f"{path} is listed on rank 0 but not here after {LISTING_WAIT_S:.0f} s: the run "
            "directory is not on a file system that every node shares, or its listing is not "
            "consistent across nodes (NFS attribute caching). Put run.dir on a shared file "
            "system that shows every node the same files.",
        )
    try:
        loaded = load_checkpoint(path, env.rank, env.world_size)
        require_resumable(loaded)
        return loaded, _USABLE, ""
    except CorruptCheckpointError as error:
        log.warning("cannot resume from %s on rank %d: %s", path.name, env.rank, error)
        return None, _DAMAGED, str(error)
    except IncompatibleCheckpointError as error:
        return None, _INCOMPATIBLE, str(error)
    except CheckpointReadError as error:
        return None, _FATAL, str(error)


def _wait_until_listed(run_dir: Path, name: str) -> bool:
    """Whether `name` appears among this rank's complete checkpoints within LISTING_WAIT_S,
    listing again (which refreshes a caching file system's view) every second."""
    deadline = time.monotonic() + LISTING_WAIT_S
    while name not in [path.name for path in complete_checkpoints(run_dir)]:
        if time.monotonic() > deadline:
            return False
        time.sleep(min(1.0, LISTING_WAIT_S / 10))
    return True


def _load_verified(path: Path, recorded: dict[str, Any] | list[str] | None) -> dict[str, Any]:
    try:
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
                    f"{path.name} does not match its SHA-256 checksum: it changed after it was "
                    "saved"
                )
        return torch.load(path, map_location="cpu", weights_only=True)
    except CorruptCheckpointError:
        raise
    except (MemoryError, OSError) as error:
        raise _read_error(path, error) from error
    except Exception as error:
        if any(part in str(error) for part in _RESOURCE_MESSAGES):
            raise _read_error(path, error) from error
        # The bytes are those written, but no safe unpickler takes them: unusable all the same.
        raise CorruptCheckpointError(f"{path.name} cannot be loaded: {error}") from error


def _read_error(path: Path, error: BaseException) -> CheckpointReadError:
    return CheckpointReadError(
        f"cannot read {path}: {type(error).__name__}: {error}. This is an error of the machine "
        "(memory, permissions, the file system), not damage to the checkpoint, which was left "
        "as it is: fix the cause and launch again."
    )


def _require_keys(state: Any, required: tuple[str, ...], where: str) -> None:
    missing = [key for key in required if not isinstance(state, dict) or key not in state]
    if missing:
        raise IncompatibleCheckpointError(
            f"{where} lacks {', '.join(missing)}, which this version "
            "needs to resume: it was written by another version of the project, or edited"
        )


def _require_room(root: Path, size: int) -> None:
    if shutil.disk_usage(root).free < size:
        raise OSError(
            errno.ENOSPC, "not enough free space for another checkpoint; nothing was written"
        )


def _staging(root: Path, step: int, job: str) -> Path:
    return root / f".step_{step:08d}.{job}.tmp"


def _tree_size(path: Path) -> int:
    if not path.is_dir():
        return 0
    return sum(entry.stat().st_size for entry in path.iterdir() if entry.is_file())


def _amount(size: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} bytes"


def _digest(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": digest.hexdigest()}


class _HashingWriter:
    """Passes writes through to a file while counting and hashing them: no second read.

    torch.save turns an error of `write` into a RuntimeError; the OSError (a full disk) is
    kept in `error` to be raised as itself."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle = handle
        self.digest = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self.size += len(data)
        try:
            return self.handle.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self.handle.flush()


def _atomic_save(obj: Any, path: Path) -> dict[str, Any]:
    """torch.save to a temporary name, fsync, rename; returns the file's size and checksum."""
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as handle:
        writer = _HashingWriter(handle)
        try:
            torch.save(obj, writer)
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None
            raise
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
