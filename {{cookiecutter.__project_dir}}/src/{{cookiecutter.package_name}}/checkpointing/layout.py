"""Where a run's checkpoints are and what they are called: the names and the listing that the
writer (checkpoint.py), the choice of the checkpoint to resume (newest_intact.py), retention
and the rest of the package share, kept in one place so that none spells a name its own way.

`<run.dir>/checkpoints/step_00000100/` is the checkpoint of step 100. It is assembled under a
hidden name of its step and of the job that writes it (`.step_00000100.<job>.tmp`) and counts
once it holds `COMPLETE`, written last: a directory without it is never listed, so never
loaded. A checkpoint that cannot be used is moved aside, never deleted, as
`step_00000100.corrupt` (damaged) or `step_00000100.incompatible` (of another format), with
-2, -3, ... when that name is taken. Nothing here writes.
"""

from __future__ import annotations

import os
import re
import socket
import time

from .storage import Location, storage_of

#: The marker a checkpoint's writer puts last: with it, the checkpoint is complete.
COMPLETE_MARKER = "COMPLETE"
CORRUPT_SUFFIX = ".corrupt"
INCOMPATIBLE_SUFFIX = ".incompatible"
#: The name of a checkpoint's directory.
CHECKPOINT_NAME = re.compile(r"^step_(\d{8})$")
_SET_ASIDE_NAME = re.compile(r"^step_\d{8}\.(corrupt|incompatible)(-\d+)?$")


def checkpoint_root(run_dir: Location) -> Location:
    return run_dir / "checkpoints"


def staging_dir(root: Location, step: int, job: str) -> Location:
    """Where `job` assembles the checkpoint of `step`: a hidden name, never listed."""
    return root / f".step_{step:08d}.{job}.tmp"


def new_job_token() -> str:
    """A name for this job, unique among the jobs that could share a run directory: host,
    process id and start time (of rank 0, which every rank then uses)."""
    host = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())
    return f"{host}-{os.getpid()}-{time.strftime('%Y%m%dT%H%M%S')}"


def complete_checkpoints(run_dir: Location) -> list[Location]:
    """Complete checkpoints, oldest first. Directories without the marker are ignored."""
    root = checkpoint_root(run_dir)
    store = storage_of(root)
    found = [
        root / name
        for name in store.names(root)
        if CHECKPOINT_NAME.match(name) and store.is_file(root / name / COMPLETE_MARKER)
    ]
    return sorted(found, key=lambda path: path.name)


def latest_checkpoint(run_dir: Location) -> Location | None:
    """The newest complete checkpoint (not yet verified), or None for a fresh run."""
    checkpoints = complete_checkpoints(run_dir)
    return checkpoints[-1] if checkpoints else None


def set_aside_checkpoints(run_dir: Location) -> list[Location]:
    """Checkpoints moved aside as damaged or of another format, by name."""
    root = checkpoint_root(run_dir)
    names = storage_of(root).names(root)
    return sorted(root / name for name in names if _SET_ASIDE_NAME.match(name))
