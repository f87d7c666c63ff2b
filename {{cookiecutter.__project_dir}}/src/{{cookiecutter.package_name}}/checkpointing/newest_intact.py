"""Which checkpoint a resume loads: the newest one that every rank can load, agreed by all.

Kept apart from reading one checkpoint (checkpoint.py), which a process does alone (as
init.weights does): here the ranks agree on which checkpoint to try, on what their outcomes
mean together, and on which of them changes the run directory. Rank 0 chooses (its newest
complete checkpoint) and every rank loads the same one, verified against its COMPLETE, or all
of them go on to the previous one together; what each case does:

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

import logging
import time

from ..cluster.distributed import DistEnv, gather_objects
from .checkpoint import (
    CheckpointError,
    CheckpointReadError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    LoadedCheckpoint,
    load_checkpoint,
    require_resumable,
)
from .layout import CORRUPT_SUFFIX, checkpoint_root, complete_checkpoints, set_aside_checkpoints
from .retention import set_aside
from .storage import Location

log = logging.getLogger(__name__)

#: How long a rank waits to see the checkpoint rank 0 chose: NFS caches directory listings for
#: up to a minute (acdirmax) by default.
LISTING_WAIT_S = 90.0
#: What a rank's attempt at a checkpoint came to.
_USABLE, _DAMAGED, _INCOMPATIBLE, _FATAL = "usable", "damaged", "incompatible", "fatal"


class NoUsableCheckpointError(CheckpointError):
    """The run directory holds checkpoints, and none of them can continue the run."""

    def __init__(self, message: str, incompatible: list[Location]) -> None:
        super().__init__(message)
        #: Intact checkpoints of another format, left in place.
        self.incompatible = incompatible


def load_newest_intact(run_dir: Location, env: DistEnv) -> LoadedCheckpoint | None:
    """The newest checkpoint that every rank can load, or None when the run has none.

    A collective. Rank 0 lists the checkpoints, and every rank tries the ones it names, newest
    first, agreeing after each one, so all of them resume from the same step. Damaged ones are
    reported, naming the file, and moved aside by rank 0; those of another format are skipped.
    Raises CheckpointReadError when a rank cannot read or see one for a reason other than
    damage, and NoUsableCheckpointError when checkpoints exist and none can be used.
    """
    listing: tuple[list[str], list[str]] | str | None = None
    if env.is_main:
        try:
            listing = (
                [path.name for path in reversed(complete_checkpoints(run_dir))],
                [path.name for path in set_aside_checkpoints(run_dir)],
            )
        except OSError as error:  # an object store out of reach, a permission refused
            listing = f"cannot list {checkpoint_root(run_dir)}: {error}"
    shared = gather_objects(listing)[0]
    if isinstance(shared, str):
        raise CheckpointReadError(
            f"{shared}. Nothing was changed: fix the cause (for an object store: the endpoint, "
            "the network, the credentials in the environment) and launch again."
        )
    names, earlier = shared
    root = checkpoint_root(run_dir)
    unusable: list[str] = []
    incompatible: list[Location] = []
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


def _try_load(
    path: Location, run_dir: Location, env: DistEnv
) -> tuple[LoadedCheckpoint | None, str, str]:
    """This rank's attempt at the checkpoint rank 0 chose: (loaded, outcome, reason)."""
    try:
        listed = env.is_main or _wait_until_listed(run_dir, path.name)
    except OSError as error:
        return None, _FATAL, f"cannot list {checkpoint_root(run_dir)}: {error}"
    if not listed:
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


def _wait_until_listed(run_dir: Location, name: str) -> bool:
    """Whether `name` appears among this rank's complete checkpoints within LISTING_WAIT_S,
    listing again (which refreshes a caching file system's view) every second."""
    deadline = time.monotonic() + LISTING_WAIT_S
    while name not in [path.name for path in complete_checkpoints(run_dir)]:
        if time.monotonic() > deadline:
            return False
        time.sleep(min(1.0, LISTING_WAIT_S / 10))
    return True


def _set_aside_on_rank_0(path: Location, env: DistEnv) -> str:
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
