"""What a run directory keeps of its checkpoints, and what it drops: the newest
`checkpoint.keep_last` (and the best) stay, older ones are pruned after each save, saves that
jobs left unfinished are removed, and checkpoints that cannot be used are moved aside, never
deleted. Kept apart from the writing and the reading of a checkpoint (checkpoint.py) because
each of these removes or moves what another save, another launch or another job left.

A job removes only its own staging at a save: another job's may be a save in flight. What other
jobs left is removed by `remove_foreign_staging`, once no other job can be writing (the run
directory's lock is held). On an object store, where nothing can be renamed, a checkpoint's
`COMPLETE` is removed before its files, by pruning and by a move aside alike: a removal cut
short never leaves a complete-looking checkpoint with files missing.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Collection

from .layout import CHECKPOINT_NAME, COMPLETE_MARKER, checkpoint_root, complete_checkpoints
from .storage import Location, storage_of

log = logging.getLogger(__name__)


def prune_checkpoints(
    run_dir: Location, keep_last: int, job: str, keep: Collection[str] = ()
) -> None:
    """Keep the newest `keep_last` complete checkpoints and those named in `keep`; drop older
    ones (COMPLETE first) and this job's abandoned staging (another job's may be a save in
    flight)."""
    root = checkpoint_root(run_dir)
    store = storage_of(root)
    for old in complete_checkpoints(run_dir)[:-keep_last]:
        if old.name not in keep:
            try:
                store.remove_tree(old, first=COMPLETE_MARKER)
            except OSError as error:  # the new checkpoint is safe: not a reason to stop
                log.warning("cannot remove the old checkpoint %s: %s", old, error)
    for name in store.names(root):
        if fnmatch.fnmatch(name, f".step_*.{job}.tmp"):
            store.remove_tree(root / name)


def remove_foreign_staging(run_dir: Location, job: str) -> list[Location]:
    """Remove the saves other jobs left unfinished; call only when no other job can be running
    in `run_dir`. Returns what was removed: staging directories, and on an object store the
    checkpoints without COMPLETE (written under their own name)."""
    root = checkpoint_root(run_dir)
    store = storage_of(root)
    names = store.names(root)
    if store.renames:
        foreign = [
            root / name
            for name in names
            if fnmatch.fnmatch(name, ".step_*.tmp") and not name.endswith(f".{job}.tmp")
        ]
    else:
        complete = {path.name for path in complete_checkpoints(run_dir)}
        foreign = [root / name for name in names if CHECKPOINT_NAME.match(name)]
        foreign = [path for path in foreign if path.name not in complete]
    for path in foreign:
        store.remove_tree(path)
    return foreign


def set_aside(path: Location, suffix: str) -> Location:
    """Move a checkpoint out of the way under `name + suffix` (with -2, -3, ... when taken).

    On an object store, a copy under the new name, then the removal of the original's COMPLETE
    and then of its files: a move cut short leaves the original whole, or incomplete (never
    listed), and a later launch moves it again or a save of its step replaces it.
    """
    store = storage_of(path)
    aside = path.with_name(path.name + suffix)
    number = 1
    while store.exists(aside):
        number += 1
        aside = path.with_name(f"{path.name}{suffix}-{number}")
    store.move(path, aside, first=COMPLETE_MARKER)
    return aside
