"""`dist.debug`: NCCL's and torch.distributed's debug output for one run, in its run directory.

A hang, or a collective that fails between nodes, is explained by NCCL's INFO log (the network
and transports it chose, its rings, the peer a connection failed to) and by torch.distributed's
debug mode (DDP's set-up and the names of parameters that got no gradient; c10d's store and
connections). Each is turned on by variables read as the process group starts, so `dist.debug`
sets them on every rank just before it starts (distributed.py), each unless the user exported
it, as the flight recorder's are (flight_recorder.py):

- NCCL_DEBUG=INFO and NCCL_DEBUG_FILE=<run.dir>/debug/nccl.<host>.<pid>.log: one file per
  process beside the checkpoints, rather than interleaved in the launcher's output;
- TORCH_DISTRIBUTED_DEBUG=INFO, which torch reads from the environment again here. Not
  DETAIL, which also checks every collective against the other ranks': under it DDP's
  construction ends in a segmentation fault with torch 2.13's CPU build (a 7-line DDP script
  on gloo does it), and pytorch/pytorch#148976 has its barrier fail; export it yourself to try.

torch's C++ log level (TORCH_CPP_LOG_LEVEL=INFO, without which torch.distributed's lines are
not printed) cannot come from a setting: torch reads it once, when it is imported, before any
config is read. Export it before the launch; the log line says so when it is not. Those lines
go to each rank's stderr, which the launcher collects.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path

import torch.distributed as dist

log = logging.getLogger(__name__)

DEBUG_DIR = "debug"


def debug_dir(run_dir: Path) -> Path:
    """Where every process writes NCCL's log under dist.debug."""
    return run_dir / DEBUG_DIR


def settings(directory: Path) -> dict[str, str]:
    """The variables that turn the debug output on, NCCL's going to `directory` (NCCL puts the
    host name for %h and the process id for %p)."""
    return {
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_FILE": str(directory.absolute() / "nccl.%h.%p.log"),
        "TORCH_DISTRIBUTED_DEBUG": "INFO",
    }


def set_unless_exported(
    wanted: Mapping[str, str],
    environ: MutableMapping[str, str],
    aliases: Mapping[str, tuple[str, ...]] | None = None,
) -> tuple[dict[str, str], dict[str, str]]:
    """Set each of `wanted` in `environ` unless the user exported it, under its name or one of
    its `aliases` (the older names torch still reads); returns (what was set, what was kept)."""
    applied: dict[str, str] = {}
    kept: dict[str, str] = {}
    for name, value in wanted.items():
        names = (aliases or {}).get(name, (name,))
        exported = {other: environ[other] for other in names if other in environ}
        if exported:
            kept.update(exported)
        else:
            environ[name] = applied[name] = value
    return applied, kept


def turn_on(
    directory: Path, rank: int, local_rank: int, environ: MutableMapping[str, str] = os.environ
) -> None:
    """Before the process group starts, on every rank: set `settings(directory)` (yours kept)
    and have torch read TORCH_DISTRIBUTED_DEBUG again; the first rank of each host creates the
    directory, which NCCL does not; rank 0 says in one log line what was set and kept."""
    applied, kept = set_unless_exported(settings(directory), environ)
    dist.set_debug_level_from_env()
    if "NCCL_DEBUG_FILE" in applied and local_rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        log.info("%s", describe(applied, kept, environ))


def describe(applied: dict[str, str], kept: dict[str, str], environ: Mapping[str, str]) -> str:
    """The log line: the variables set, those the user exported, and the C++ log level."""
    details = []
    if applied:
        details.append("set " + ", ".join(f"{name}={value}" for name, value in applied.items()))
    if kept:
        details.append("kept as exported " + ", ".join(f"{k}={v}" for k, v in kept.items()))
    if environ.get("TORCH_CPP_LOG_LEVEL", "").upper() != "INFO":
        details.append(
            "torch.distributed's lines need TORCH_CPP_LOG_LEVEL=INFO exported before the "
            "launch (torch reads it once, when imported)"
        )
    return f"dist.debug: {'; '.join(details)}"
