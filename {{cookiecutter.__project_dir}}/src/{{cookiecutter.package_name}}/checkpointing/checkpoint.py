"""One checkpoint on disk: writing it atomically, reading it back verified.

A checkpoint (named and listed as layout.py says) holds `state.pt` (the replicated state,
written by rank 0 only), `rank_00000.pt`, `rank_00001.pt`, ... (each rank's own RNG state) and
`COMPLETE`. It is assembled in a hidden staging directory of its step and of the job that writes
it, `COMPLETE` is written last, and the directory is renamed into place in one `os.replace`: a
crash at any moment leaves either the previous checkpoints untouched or a hidden directory that
is never loaded. A save ends by pruning (retention.py).

A save that fails on any rank, in any phase (a full disk, a failing file system), removes its
staging directory and fails on every rank, saying the checkpoint's size and the free space;
every earlier checkpoint is left as it was. Rank 0 refuses to start a save when the previous
checkpoint would not fit in the free space.

`COMPLETE` records the checkpoint's format version and the size and SHA-256 of every file.
Loading verifies each file against it and tells damage (CorruptCheckpointError), another format
(IncompatibleCheckpointError) and an error of the machine (CheckpointReadError) apart; which
checkpoint the ranks load, and what each outcome does, is newest_intact.py's.

On an object store (`run.dir=s3://...`, storage.py) nothing can be renamed: a checkpoint's files
are written under its own name (after the leftovers of an earlier save of that step are
removed), and `COMPLETE`, written last, commits it; a checkpoint without it is never listed nor
loaded, and the next launch removes it. Loading verifies every file against COMPLETE as above;
an error of the store's client (unreachable, access denied) is a read error, not damage. The
run's metrics and logs, kept in a local directory, travel with each checkpoint (`run/`,
restore_run_files).
"""

from __future__ import annotations

import errno
import hashlib
import importlib
import io
import json
import logging
import shutil
import warnings
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed import ProcessGroup

from ..cluster.distributed import DistEnv, barrier, gather_objects
from ..monitoring.logs import log_file_name
from ..monitoring.metrics import RUN_FILES
from .layout import (
    COMPLETE_MARKER,
    checkpoint_root,
    complete_checkpoints,
    latest_checkpoint,
    new_job_token,
    staging_dir,
)
from .retention import prune_checkpoints
from .storage import Location, ObjectPath, local_dir_of, storage_of

log = logging.getLogger(__name__)

#: Names this module held before 1.0 that moved to a module of their own: importing one from
#: here still works in this release, with a FutureWarning naming its new place.
MOVED_NAMES = {
    "CORRUPT_SUFFIX": "layout",
    "INCOMPATIBLE_SUFFIX": "layout",
    "set_aside_checkpoints": "layout",
    "LISTING_WAIT_S": "newest_intact",
    "NoUsableCheckpointError": "newest_intact",
    "load_newest_intact": "newest_intact",
    "remove_foreign_staging": "retention",
    "set_aside": "retention",
}


def __getattr__(name: str) -> Any:
    if name not in MOVED_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    new = f"{__package__}.{MOVED_NAMES[name]}"
    warnings.warn(
        f"{name} moved to {new} in release 1.0: import it from there (its old place stops "
        "working in the next release)",
        FutureWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(new), name)


STATE_FILE = "state.pt"
#: The version of what a checkpoint holds, recorded in COMPLETE. Checkpoints from before it was
#: recorded are version 1: they load when they hold every key below.
FORMAT_VERSION = 2
#: What this version reads from state.pt and from a rank file without a default.
REQUIRED_STATE_KEYS = ("model", "optimizer", "scheduler", "scaler", "step", "config")
REQUIRED_RANK_KEYS = ("rng",)
#: Where a checkpoint on an object store holds the run's metrics and logs (see save_checkpoint).
RUN_FILES_DIR = "run"
#: The bound on the waits around a save, from the previous save's write time: a rank that
#: takes longer has hung. Never shorter than the floor, never longer than dist.barrier_timeout_s.
SAVE_TIMEOUT_FACTOR = 4.0
SAVE_TIMEOUT_FLOOR_S = 300.0
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


@dataclass
class LoadedCheckpoint:
    """A checkpoint every rank could load: the replicated state, and this rank's own state when
    the checkpoint was written by as many ranks as this run has."""

    path: Location
    state: dict[str, Any]
    rank_state: dict[str, Any] | None
    world_size: int
    #: The checkpoint's format version (FORMAT_VERSION when it was written by this version).
    format: int = FORMAT_VERSION
    #: Newer checkpoints of another format that the run goes on without: the caller sets
    #: them aside before the run's own saves could replace or prune them.
    skipped: list[Location] = field(default_factory=list)


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def save_timeout_s(previous_write_s: float | None, ceiling_s: float) -> float:
    """How long the ranks wait for each other around a save: `ceiling_s`
    (dist.barrier_timeout_s) for the first save of a launch, then a bound from the previous
    save's write time, so that a rank hung in a save ends the job in bounded time."""
    if previous_write_s is None:
        return ceiling_s
    return min(ceiling_s, max(SAVE_TIMEOUT_FLOOR_S, SAVE_TIMEOUT_FACTOR * previous_write_s))


def save_checkpoint(
    run_dir: Location,
    step: int,
    state: dict[str, Any],
    rank_state: dict[str, Any],
    env: DistEnv,
    keep_last: int,
    job: str | None = None,
    timeout_s: float | None = None,
    keep: Collection[str] = (),
    group: ProcessGroup | None = None,
) -> Location:
    """Write a checkpoint collectively: every rank must call this at the same step.

    Rank 0 checks the free space and creates the staging directory, every rank writes its own
    file, rank 0 writes the replicated state and the completion marker (with each file's size
    and checksum), renames the directory into place and prunes old checkpoints (never those
    named in `keep`). After each phase the ranks wait for each other for up to `timeout_s`
    (naming a rank that does not arrive) and share their errors: no collective runs inside a
    rank-0-only branch, and a failure anywhere fails the save everywhere. Raises
    CheckpointSaveError. `job` names the staging directory (default: this process, which is
    right for a single process only: ranks must pass the same name). `group` is the gloo group
    its waits and exchanges run on (default: the control group); a save in the background
    passes its own (background_save.py).

    On an object store (no rename) the files are written under the checkpoint's own name, after
    what an earlier save of the same step left there is removed, and COMPLETE, written last, is
    the commit point. Each rank also copies its files of the run's local part (metrics.jsonl,
    its log) under `run/` in the checkpoint: a run resumed on another node continues them.
    """
    job = job or new_job_token()
    root = checkpoint_root(run_dir)
    store = storage_of(root)
    final = root / f"step_{step:08d}"
    staging = staging_dir(root, step, job) if store.renames else final
    previous = latest_checkpoint(run_dir) if env.is_main else None
    phase = _SavePhase(env, final, staging, previous, timeout_s, group)

    def prepare() -> None:
        if previous is not None:
            _require_room(root, checkpoint_size(previous))
        store.remove_tree(staging, first=COMPLETE_MARKER)
        store.make_dirs(staging)

    def write_own_files() -> None:
        _atomic_save(rank_state, staging / rank_file(env.rank))
        if isinstance(run_dir, ObjectPath):
            _upload_run_files(local_dir_of(run_dir), staging, env.rank)

    def publish() -> None:
        files = {STATE_FILE: _atomic_save(state, staging / STATE_FILE)}
        names = [rank_file(rank) for rank in range(env.world_size)]
        names += [f"{RUN_FILES_DIR}/{name}" for name in store.names(staging / RUN_FILES_DIR)]
        for name in names:
            files[name] = _digest(staging / name)
        marker = {
            "format": FORMAT_VERSION,
            "step": step,
            "world_size": env.world_size,
            "files": files,
        }
        atomic_write_text(staging / COMPLETE_MARKER, json.dumps(marker, indent=2) + "\n")
        store.publish(staging, final)
        phase.committed = True
        prune_checkpoints(run_dir, keep_last, job, keep)

    phase.run(prepare if env.is_main else None)
    phase.run(write_own_files)
    phase.run(publish if env.is_main else None)
    return final


class _SavePhase:
    """One phase of a save on every rank: this rank's part, then the wait for every rank and
    the exchange of errors. On any rank's error, rank 0 removes the staging directory and every
    rank raises the same CheckpointSaveError."""

    def __init__(
        self,
        env: DistEnv,
        final: Location,
        staging: Location,
        previous: Location | None,
        timeout_s: float | None,
        group: ProcessGroup | None = None,
    ) -> None:
        self.env, self.final, self.staging = env, final, staging
        self.previous, self.timeout_s, self.group = previous, timeout_s, group
        #: Set once the checkpoint is in place: on an object store, where the staging is the
        #: checkpoint itself, a failure after that point must not remove it.
        self.committed = False

    def run(self, part: Callable[[], object] | None) -> None:
        error = None
        try:
            if part is not None:
                part()
        except OSError as caught:
            error = f"rank {self.env.rank}: {caught}"
        try:
            barrier(self.timeout_s, self.group)
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
        errors = [message for message in gather_objects(error, self.group) if message]
        if not errors:
            return
        message = self._failure(errors) if self.env.is_main else None
        raise CheckpointSaveError(gather_objects(message, self.group)[0])

    def _failure(self, errors: list[str]) -> str:
        """Rank 0: remove the staging directory and say what was written and what is free, as
        far as the storage answers (an object store out of reach answers nothing)."""
        store = storage_of(self.staging)
        written = _measured(store.tree_size, self.staging)
        self._remove_staging()
        root = self.final.parent
        free = _measured(store.free_space, root)
        needed = "there is no previous checkpoint to compare with"
        if self.previous is not None:
            size = _measured(checkpoint_size, self.previous)
            takes = "an unknown size (it could not be measured)" if size is None else _amount(size)
            needed = f"the previous checkpoint, {self.previous.name}, takes {takes}"
        wrote = f"{_amount(written)} of it had been written, " if written else ""
        room = f", and {_amount(free)} are free in {root}" if free is not None else ""
        return (
            f"cannot save checkpoint {self.final.name} ({'; '.join(errors)}): {wrote}{needed}"
            f"{room}. The staging directory is removed and the earlier checkpoints are intact: "
            "free space (or lower checkpoint.keep_last, or move "
            "run.dir), then launch again to continue from the newest of them."
        )

    def _remove_staging(self) -> None:
        if self.env.is_main and not self.committed:
            try:
                storage_of(self.staging).remove_tree(self.staging, first=COMPLETE_MARKER)
            except OSError as error:  # never incomplete: it is not loaded, a later save removes it
                log.warning("cannot remove the unfinished checkpoint %s: %s", self.staging, error)


def checkpoint_size(path: Location) -> int:
    """Bytes of the files of one checkpoint directory."""
    return storage_of(path).tree_size(path)


def room_warning(run_dir: Location, keep_last: int) -> str | None:
    """A warning when the run directory's file system cannot hold `keep_last` + 1 checkpoints
    (the peak: a new one is complete before the oldest is pruned), estimated from the newest."""
    newest = latest_checkpoint(run_dir)
    if newest is None:
        return None
    size = checkpoint_size(newest)
    held = sum(checkpoint_size(path) for path in complete_checkpoints(run_dir))
    needed = (keep_last + 1) * size - held
    free = storage_of(newest).free_space(checkpoint_root(run_dir))
    if free is None or free >= needed:
        return None
    return (
        f"{checkpoint_root(run_dir)} has {_amount(free)} free, but checkpoint.keep_last="
        f"{keep_last} needs about {_amount(needed)} more: {keep_last + 1} checkpoints of "
        f"{_amount(size)} at the peak of a save. A save will fail for lack of space; free some, "
        "or lower checkpoint.keep_last."
    )


def load_checkpoint(path: Location, rank: int, world_size: int) -> LoadedCheckpoint:
    """Verify and load one checkpoint on the CPU, with the safe unpickler.

    The rank file is loaded only when the checkpoint was written by `world_size` ranks: per-rank
    state means nothing on another number of ranks. Raises CorruptCheckpointError naming the
    file that is missing, cut short, changed or unreadable, and CheckpointReadError for an
    error of the machine (memory, permission, I/O), which says nothing about the checkpoint.
    Whether its contents are what this version resumes from is `require_resumable`'s question.
    """
    marker_path = path / COMPLETE_MARKER
    try:
        text = storage_of(marker_path).read_text(marker_path)
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


def _load_verified(path: Location, recorded: dict[str, Any] | list[str] | None) -> dict[str, Any]:
    try:
        store = storage_of(path)
        if not store.is_file(path):
            raise CorruptCheckpointError(f"{path.name} is missing")
        # Checkpoints from before checksums were recorded hold a plain list of names.
        expected = recorded.get(path.name) if isinstance(recorded, dict) else None
        # A local file is read twice, to check and to load; an object is fetched once.
        source: Path | io.BytesIO = path
        if isinstance(path, ObjectPath):
            source = io.BytesIO(store.read_bytes(path))
        if expected is not None:
            found = _digest(path) if isinstance(source, Path) else _hash(source.getvalue())
            if found["bytes"] != expected["bytes"]:
                raise CorruptCheckpointError(
                    f"{path.name} has {found['bytes']} bytes, {expected['bytes']} were written"
                )
            if found["sha256"] != expected["sha256"]:
                raise CorruptCheckpointError(
                    f"{path.name} does not match its SHA-256 checksum: it changed after it was "
                    "saved"
                )
        return torch.load(source, map_location="cpu", weights_only=True)
    except CorruptCheckpointError:
        raise
    except (MemoryError, OSError) as error:
        raise _read_error(path, error) from error
    except Exception as error:
        if any(part in str(error) for part in _RESOURCE_MESSAGES):
            raise _read_error(path, error) from error
        # The bytes are those written, but no safe unpickler takes them: unusable all the same.
        raise CorruptCheckpointError(f"{path.name} cannot be loaded: {error}") from error


def _read_error(path: Location, error: BaseException) -> CheckpointReadError:
    return CheckpointReadError(
        f"cannot read {path}: {type(error).__name__}: {error}. This is an error of the machine "
        "(memory, permissions, the file system or object store), not damage to the checkpoint, "
        "which was left as it is: fix the cause and launch again."
    )


def _require_keys(state: Any, required: tuple[str, ...], where: str) -> None:
    missing = [key for key in required if not isinstance(state, dict) or key not in state]
    if missing:
        raise IncompatibleCheckpointError(
            f"{where} lacks {', '.join(missing)}, which this version "
            "needs to resume: it was written by another version of the project, or edited"
        )


def _require_room(root: Location, size: int) -> None:
    free = storage_of(root).free_space(root)
    if free is not None and free < size:
        raise OSError(
            errno.ENOSPC, "not enough free space for another checkpoint; nothing was written"
        )


def _measured(size: Callable[[Any], int | None], path: Location) -> int | None:
    """`size(path)`, or None when the storage cannot tell it: a failed save is described with
    what could be measured, never replaced by a second error on rank 0 alone."""
    try:
        return size(path)
    except OSError:
        return None


def _amount(size: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} bytes"


def _digest(path: Location) -> dict[str, Any]:
    digest = hashlib.sha256()
    size = 0
    with storage_of(path).open_read(path) as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": digest.hexdigest()}


def _hash(data: bytes) -> dict[str, Any]:
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


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


def _atomic_save(obj: Any, path: Location) -> dict[str, Any]:
    """torch.save into `path` in one step (a temporary name, fsync and rename on a file
    system; one upload to an object store); returns the file's size and checksum."""
    written: dict[str, Any] = {}

    def fill(handle: BinaryIO) -> None:
        writer = _HashingWriter(handle)
        try:
            torch.save(obj, writer)
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None
            raise
        written.update(bytes=writer.size, sha256=writer.digest.hexdigest())

    storage_of(path).write(path, fill)
    return written


def atomic_write_text(path: Location, text: str) -> None:
    """Write `text` in one step: a reader sees all of it or none."""
    storage_of(path).write_text(path, text)


def _upload_run_files(local_dir: Path, checkpoint: ObjectPath, rank: int) -> None:
    """Copy this rank's files of the run's local part (metrics.jsonl and the tracker's step on
    rank 0, each rank's own log) under the checkpoint's `run/`."""
    store = storage_of(checkpoint)
    names = [*RUN_FILES, log_file_name(0)] if rank == 0 else [log_file_name(rank)]
    for name in names:
        if (local_dir / name).is_file():
            with open(local_dir / name, "rb") as source:
                store.write(
                    checkpoint / RUN_FILES_DIR / name,
                    lambda handle, source=source: shutil.copyfileobj(source, handle),
                )


def restore_run_files(run_dir: Location, rank: int) -> Location | None:
    """On a run directory in an object store whose local part lacks them (a new node, an
    empty run.local_dir): fetch this rank's metrics.jsonl and log from the newest complete
    checkpoint, checked against its COMPLETE, so that the run continues them. Returns the
    checkpoint they came from, or None when nothing was fetched.

    Rank 0 also replaces local files whose metrics end before the checkpoint's copy (left on
    this node by an earlier launch, since continued elsewhere). Call before logging starts. A
    file that fails its checksum is left out, with a warning: the run goes on without it.
    """
    if not isinstance(run_dir, ObjectPath):
        return None
    local_dir = local_dir_of(run_dir)
    newest = latest_checkpoint(run_dir)
    if newest is None:
        return None
    store = storage_of(newest)
    if rank == 0:
        metrics = local_dir / RUN_FILES[0]
        copy = newest / RUN_FILES_DIR / RUN_FILES[0]
        if metrics.is_file() and (
            not store.is_file(copy)
            or _last_step(metrics.read_text()) >= _last_step(store.read_text(copy))
        ):
            return None
        names = [*RUN_FILES, log_file_name(0)]
    else:
        names = [] if (local_dir / log_file_name(rank)).is_file() else [log_file_name(rank)]
    recorded = json.loads(store.read_text(newest / COMPLETE_MARKER)).get("files", {})
    local_dir.mkdir(parents=True, exist_ok=True)
    fetched = False
    for name in names:
        expected = recorded.get(f"{RUN_FILES_DIR}/{name}")
        if expected is None:
            continue
        data = store.read_bytes(newest / RUN_FILES_DIR / name)
        if _hash(data) != expected:
            log.warning("%s/%s/%s fails its checksum; not restored", newest, RUN_FILES_DIR, name)
            continue
        (local_dir / name).write_bytes(data)
        fetched = True
    return newest if fetched else None


def _last_step(metrics: str) -> int:
    """The step of the last whole record of metrics.jsonl's text (-1 when it has none)."""
    for line in reversed(metrics.splitlines()):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return -1
