"""NCCL's flight recorder: every rank's last collectives, written down when one times out.

PyTorch keeps in each process a ring buffer of its last NCCL collectives: the process group, the
sequence number, the sizes, the state (scheduled, started, completed) and the Python stack that
issued it. When a collective times out, NCCL's watchdog on that rank writes the buffer to a
file, tells the other ranks through the rendezvous store to write theirs, waits a little for
them (4 x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC), then aborts the process. `torchfrtrace DIR`
(torch's analyser) reads the files together and names the collective that some ranks never
joined, those ranks, and the stack that issued it.

Torch reads its settings from environment variables when the NCCL process group is created, so
they are set just before, on every rank (distributed.py): the recorder on, with
`dist.flight_recorder_entries` entries, and the files in `<run.dir>/comm_traces/` (the run's
local part for a run directory in an object store) rather than in each node's cache directory.
A variable the user exported, under any name torch reads for it, is left as it is.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from pathlib import Path

from ..cluster.debug_output import set_unless_exported

log = logging.getLogger(__name__)

COMM_TRACES = "comm_traces"
#: A rank's file is this prefix and its rank (`rank_0`, `rank_1`): torchfrtrace takes the
#: rank from the end of the name, after a prefix that every file in the directory shares.
FILE_PREFIX = "rank_"
#: Each setting, and every name torch reads it under (the older ones still work, with a
#: deprecation warning when set).
NAMES = {
    "TORCH_FR_BUFFER_SIZE": ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": ("TORCH_NCCL_DUMP_ON_TIMEOUT",),
    "TORCH_NCCL_ENABLE_MONITORING": ("TORCH_NCCL_ENABLE_MONITORING",),
    "TORCH_FR_DUMP_TEMP_FILE": ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"),
}


def traces_dir(run_dir: Path) -> Path:
    """Where every rank writes its flight recorder when a collective times out."""
    return run_dir / COMM_TRACES


def settings(entries: int, directory: Path) -> dict[str, str]:
    """The variables that make each rank keep its last `entries` collectives and write them to
    `directory` on a timeout (the monitoring thread is the one that writes them on the ranks
    that did not time out); with 0, those that turn the recorder off."""
    if entries == 0:
        return {"TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
    return {
        "TORCH_FR_BUFFER_SIZE": str(entries),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(directory.absolute() / FILE_PREFIX),
    }


def record_collectives(
    entries: int,
    directory: Path,
    rank: int,
    local_rank: int,
    environ: MutableMapping[str, str] = os.environ,
) -> None:
    """Before the NCCL process group starts, on every rank: set `settings(entries, directory)`
    in `environ`, each unless the user set it; rank 0 says in one log line what was set and
    what was kept.

    The first rank of each host creates the directory, as NCCL writes into it but does not
    create it: one directory of a shared run directory, or one per node for the local parts of
    a run in an object store.
    """
    applied, kept = set_unless_exported(settings(entries, directory), environ, NAMES)
    if "TORCH_FR_DUMP_TEMP_FILE" in applied and local_rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        log.info("%s", describe(entries, applied, kept))


def describe(entries: int, applied: dict[str, str], kept: dict[str, str]) -> str:
    """The log line: the setting, the variables set, and those the user exported."""
    details = []
    if applied:
        details.append("set " + ", ".join(f"{name}={value}" for name, value in applied.items()))
    if kept:
        exported = ", ".join(f"{name}={value}" for name, value in kept.items())
        details.append(f"kept as exported {exported}")
    return f"NCCL flight recorder (dist.flight_recorder_entries={entries}): {'; '.join(details)}"
