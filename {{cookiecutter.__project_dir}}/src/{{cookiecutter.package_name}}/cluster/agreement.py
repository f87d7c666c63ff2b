"""The ranks agree before the first step: code, settings, versions, devices, data, run directory.

A job spans machines launched separately, and nothing makes them alike: a node launched with
another seed, global batch or learning rate, another release of the project or of torch,
another GPU, or a run directory it does not share, trains on to exit 0 while its replicas
drift apart, or fails only at the first save. Three checks find it first, each stopping every
rank with exit status 2 and one message that names the odd ranks, their hosts, and what
differs, with both values:

1. `agree_on_launch`, as the process group starts (distributed.process_group): each rank posts
   its identity (host, device, versions, a digest of every source file, the resolved config)
   in the rendezvous store; rank 0 compares them and posts one verdict, which every rank
   reads. Through the store rather than a collective, so that ranks that could not even start
   a process group together (another backend, another timeout) are told why, and a rank that
   could not read its settings (`refuse_launch`) stops the others within seconds instead of
   leaving them waiting. The verdict's rank -> host map (`roster()`) names hosts in later
   failures.
2. `require_shared_run_dir`, right after rank 0 has taken the run directory's lock: every rank
   proves that it sees that lock, so a node-local run directory is refused before the first
   step rather than at the first save.
3. `agree_on_data`, once the task has built its data sets: their sizes and fingerprints.

Mixed GPU types are refused unless `dist.allow_mixed_devices`. Everything is exchanged as JSON,
so that ranks running different releases can still be told what differs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy
import torch
import torch.distributed as dist

from .. import __version__
from ..checkpointing.run_lock import LOCK_FILE, Holder
from ..checkpointing.storage import Location, is_url, storage_of
from ..config import Config, ConfigError, flatten
from . import network
from .distributed import DistEnv, LaunchIncompleteError, gather_objects

log = logging.getLogger(__name__)

#: How long a rank looks for rank 0's lock in the run directory: long enough for a shared file
#: system's caches (an NFS client may cache a name's absence for up to a minute, but a name
#: never looked up before is found at once), short enough that a refused launch ends soon.
SHARED_WAIT_S = 30.0
#: How long rank 0 keeps the store up for the other ranks to read a refusal.
_READ_WAIT_S = 10.0
#: Keys of the verdict's comparison, in the order the message lists them.
_ASPECTS = ("code", "versions", "device", "config")
#: Settings each host may choose for itself: how it loads its data, never which samples or
#: how they are drawn (data.py), so hosts with other core counts train together.
PER_HOST_SETTINGS = (
    "data.num_workers",
    "data.prefetch_factor",
    "data.persistent_workers",
    "data.pin_memory",
)
#: At most this many differing settings or files are listed; the rest are counted.
_MAX_LISTED = 12


class LaunchMismatchError(ConfigError):
    """The ranks were not launched alike (code, settings, versions, devices, data, run
    directory), or one of them refused its settings: every rank stops with exit status 2."""


@dataclass(frozen=True)
class Roster:
    """Which rank runs where: hosts in rank order, each with its addresses, ranks and device."""

    hosts: list[dict[str, Any]] = field(default_factory=list)
    #: Seconds the agreement took on this rank, start-up waits included.
    seconds: float = 0.0

    def host_of(self, rank: int) -> str:
        for host in self.hosts:
            if rank in host["ranks"]:
                return host["host"]
        return "an unknown host"

    def ranks_on(self, host: str) -> int:
        """How many ranks run on `host` (0 when it is not in the roster)."""
        return sum(len(entry["ranks"]) for entry in self.hosts if entry["host"] == host)

    def host_of_address(self, address: str) -> str | None:
        for host in self.hosts:
            if address in host["addresses"]:
                return host["host"]
        return None

    def describe(self) -> str:
        """The map for the log: `2 ranks on 2 hosts: node01 (10.0.0.1): rank 0, cpu; ...`."""
        ranks = sum(len(host["ranks"]) for host in self.hosts)
        parts = [
            f"{host['host']} ({', '.join(host['addresses']) or 'no network address'}): "
            f"{_rank_ranges(host['ranks'])}, {host['device']}"
            for host in self.hosts
        ]
        return f"{ranks} ranks on {len(self.hosts)} host(s): " + "; ".join(parts)


_roster = Roster()


def roster() -> Roster:
    """The rank -> host map of this job, as agreed at start-up (empty for a single process)."""
    return _roster


def identity(config: Config | None, device: torch.device) -> dict:
    """What this rank compares with the others: where it runs and what it would train
    (without a `config`: where it runs, and its versions)."""
    return {
        "host": socket.gethostname(),
        "addresses": [interface.address for interface in network.network_interfaces()],
        "device": _device(device),
        "versions": versions(),
        "code": {"package": __version__, "files": source_digests()},
        "config": {} if config is None else _compared_settings(config),
        "allow_mixed_devices": config is not None and config.dist.allow_mixed_devices,
    }


def _compared_settings(config: Config) -> dict[str, Any]:
    settings = flatten(config.to_dict())
    return {key: value for key, value in settings.items() if key not in PER_HOST_SETTINGS}


def versions() -> dict[str, str]:
    """The versions that must match across nodes: Python, torch, its CUDA and NCCL, NumPy."""
    nccl = "none"
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return {
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "cuda": str(torch.version.cuda or "none"),
        "nccl": nccl,
        "numpy": numpy.__version__,
    }


def source_digests() -> dict[str, str]:
    """A digest of every Python file of this package, by its path in the package."""
    root = Path(__file__).parents[1]
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        for path in sorted(root.rglob("*.py"))
    }


def _device(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    memory = torch.cuda.get_device_properties(device).total_memory / 2**30
    return f"{torch.cuda.get_device_name(device)} (capability {major}.{minor}, {memory:.0f} GiB)"


def agree_on_launch(
    store: dist.Store, rank: int, world_size: int, mine: dict, timeout_s: float
) -> Roster:
    """Exchange identities through `store` and stop every rank alike unless they agree.

    Every rank calls it once, before the process group starts. Raises LaunchMismatchError
    (exit 2) when they differ or one refused its settings, LaunchIncompleteError when some rank
    never reported; else returns the roster, also kept for `roster()`.
    """
    global _roster
    started = time.monotonic()
    store = dist.PrefixStore("launch", store)
    store.set(f"identity/{rank}", json.dumps(mine))
    if rank == 0:
        verdict = _judge_all(store, world_size, timeout_s)
        store.set("verdict", json.dumps(verdict))
        if verdict["problems"]:
            _wait_for_readers(store, world_size)
    else:
        verdict = _read_verdict(store, timeout_s)
    if verdict["problems"]:
        error = LaunchMismatchError if verdict["kind"] == "mismatch" else LaunchIncompleteError
        raise error("\n".join(verdict["problems"]))
    _roster = Roster(verdict["roster"], seconds=time.monotonic() - started)
    return _roster


def refuse_launch(store: dist.Store, rank: int, world_size: int, reason: str) -> None:
    """This rank cannot train (its settings are refused): tell the others through the
    agreement, so that every rank stops now with exit status 2. Returns once told."""
    mine = {"host": socket.gethostname(), "refusal": reason}
    with contextlib.suppress(LaunchMismatchError, LaunchIncompleteError, dist.DistError):
        agree_on_launch(store, rank, world_size, mine, timeout_s=_READ_WAIT_S * 3)


def _judge_all(store: dist.Store, world_size: int, timeout_s: float) -> dict:
    keys = [f"identity/{rank}" for rank in range(world_size)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except dist.DistError:
        reported = {rank for rank, key in enumerate(keys) if store.check([key])}
        identities = {rank: json.loads(store.get(keys[rank])) for rank in sorted(reported)}
        partial = _roster_of(identities)
        missing = sorted(set(range(world_size)) - reported)
        return {
            "kind": "incomplete",
            "problems": [
                f"rank(s) {_rank_ranges(missing)} did not report to rank 0 within "
                f"dist.timeout_s={timeout_s:.0f} s of start-up (reported: "
                f"{describe_ranks(reported, partial)}). They failed to start (their node's "
                "log says why), or cannot reach MASTER_ADDR:MASTER_PORT "
                f"({os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')})."
            ],
            "roster": partial.hosts,
        }
    identities = dict(enumerate(json.loads(value) for value in store.multi_get(keys)))
    roster_ = _roster_of(identities)
    return {"kind": "mismatch", "problems": judge(identities, roster_), "roster": roster_.hosts}


def _read_verdict(store: dist.Store, timeout_s: float) -> dict:
    try:
        # Rank 0 answers within timeout_s; a little longer here, so that its answer comes first.
        store.wait(["verdict"], timedelta(seconds=timeout_s + _READ_WAIT_S))
        verdict = json.loads(store.get("verdict"))
    except dist.DistError as error:
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        return {
            "kind": "incomplete",
            "problems": [
                f"rank 0 (at {where}) gave no verdict on the launch within "
                f"{timeout_s + _READ_WAIT_S:.0f} s ({str(error).splitlines()[0]}): it failed "
                "to start or is out of reach; its node's log says more"
            ],
            "roster": [],
        }
    if verdict["problems"]:
        store.add("read", 1)
    return verdict


def _wait_for_readers(store: dist.Store, world_size: int) -> None:
    """Rank 0 may host the store: keep it up until the others have read the refusal."""
    deadline = time.monotonic() + _READ_WAIT_S
    while store.add("read", 0) < world_size - 1 and time.monotonic() < deadline:
        time.sleep(0.05)


def judge(identities: Mapping[int, dict], roster_: Roster) -> list[str]:
    """What differs between the ranks' identities, in words; empty when they agree."""
    refusals: dict[str, list[int]] = {}
    for rank, found in identities.items():
        if found.get("refusal"):
            refusals.setdefault(found["refusal"], []).append(rank)
    if refusals:
        lines = [
            f"{describe_ranks(ranks, roster_)} refused the settings: {reason}"
            for reason, ranks in refusals.items()
        ]
        return [*lines, "Fix the settings there, then launch again."]
    problems = []
    for aspect in _ASPECTS:
        allowed = all(found.get("allow_mixed_devices") for found in identities.values())
        if aspect == "device" and allowed:
            continue
        lines = _differences(aspect, identities, roster_)
        if lines:
            listed = "\n".join(f"  {line}" for line in lines)
            problems.append(f"{_ASPECT_TITLES[aspect]}:\n{listed}")
    if problems:
        problems.insert(
            0,
            f"the ranks were not launched alike, and would train apart ({roster_.describe()}):",
        )
        problems.append(
            "Launch every node with the same code (the same commit, installed alike), the same "
            "config file and overrides, and the same environment."
        )
    return problems


_ASPECT_TITLES = {
    "code": "code (the project's source files differ)",
    "versions": "versions",
    "device": (
        "devices (mixed GPU types train at the pace of the slowest and round differently; "
        "dist.allow_mixed_devices=true runs them anyway)"
    ),
    "config": "settings",
}


def _differences(aspect: str, identities: Mapping[int, dict], roster_: Roster) -> list[str]:
    """One line per differing key of `aspect` (see differences). A key that an identity lacks
    (one posted by another release) counts as `absent`."""
    if aspect == "code":
        values = {}
        for rank, found in identities.items():
            code = found.get("code", {})
            files = {name: f"digest {digest}" for name, digest in code.get("files", {}).items()}
            values[rank] = {"package": code.get("package", "absent"), **files}
    elif aspect == "device":
        values = {
            rank: {"device": found.get("device", "absent")} for rank, found in identities.items()
        }
    else:
        values = {rank: found.get(aspect, {}) for rank, found in identities.items()}
    return differences(values, roster_)


def differences(values: Mapping[int, Mapping[str, Any]], roster_: Roster) -> list[str]:
    """One line per key whose value differs between ranks: each value with the ranks that
    hold it, the most common first (the other ranks are the odd ones). A key a rank lacks is
    `absent` there."""
    keys = sorted(set().union(*values.values()), key=lambda key: (key != "package", key))
    lines = []
    for key in keys:
        groups: dict[str, list[int]] = {}
        for rank, found in values.items():
            groups.setdefault(json.dumps(found.get(key, "absent")), []).append(rank)
        if len(groups) > 1:
            ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), item[1][0]))
            listed = "; ".join(
                f"{json.loads(value)} on {describe_ranks(ranks, roster_)}"
                for value, ranks in ordered
            )
            lines.append(f"{key}: {listed}")
    if len(lines) > _MAX_LISTED:
        lines = [*lines[:_MAX_LISTED], f"... and {len(lines) - _MAX_LISTED} more"]
    return lines


def require_shared_run_dir(
    run_dir: Location,
    run_dir_setting: str,
    token: str | None,
    env: DistEnv,
    wait_s: float,
    marker: str = LOCK_FILE,
) -> None:
    """Every rank sees the run directory that rank 0 locked, or every rank stops (exit 2).

    `token` is that of rank 0's lock (None elsewhere), or of another `marker` file rank 0
    wrote there with a lock's record (the doctor's probe). A collective, right after the lock
    is taken and before anything is read or written there: each rank looks for that file for
    up to `wait_s` seconds (at most SHARED_WAIT_S).
    """
    if env.world_size == 1:
        return
    wait_s = min(wait_s, SHARED_WAIT_S)
    token = gather_objects(token)[0]
    missing = _look_for(run_dir / marker, token, wait_s)
    reports = gather_objects({"host": socket.gethostname(), "cwd": os.getcwd(), "missing": missing})
    odd = [rank for rank, report in enumerate(reports) if report["missing"]]
    if not odd:
        return
    roster_ = roster() if roster().hosts else _roster_of(dict(enumerate(reports)))
    found = "; ".join(
        sorted({f"{entry['host']}: {entry['missing']}" for entry in reports if entry["missing"]})
    )
    where = ""
    if not is_url(run_dir_setting) and not Path(run_dir_setting).is_absolute():
        cwds = "; ".join(sorted({f"{report['cwd']} on {report['host']}" for report in reports}))
        where = f" It is relative to each node's working directory: {cwds}."
    raise LaunchMismatchError(
        f"run.dir={run_dir_setting} is not shared: {describe_ranks(odd, roster_)} "
        f"{'does' if len(odd) == 1 else 'do'} not see "
        f"the run directory that rank 0 on {reports[0]['host']} has locked ({found}; looked "
        f"for {wait_s:.0f} s).{where} Every rank must see the same run directory: a "
        "path on a file system that every node mounts (run.dir=/shared/runs/NAME), or an "
        "object store (run.dir=s3://BUCKET/PREFIX)."
    )


def _look_for(path: Location, token: str, wait_s: float) -> str | None:
    """None once this rank reads the record of `token` at `path`; what it found instead when
    `wait_s` seconds have passed."""
    store = storage_of(path)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            holder = Holder.parse(store.read_bytes(path))
            if holder.token == token:
                return None
            found = f"another job's {path.name} (host {holder.host}, pid {holder.pid})"
        except FileNotFoundError:
            found = f"no {path.name} in {path.parent}"
        except OSError as error:
            found = f"cannot read {path}: {error}"
        if time.monotonic() >= deadline:
            return found
        time.sleep(0.5)


def agree_on_data(datasets: Mapping[str, Any]) -> None:
    """Every rank built the same data sets (sizes, and fingerprints where a data set has a
    `fingerprint` attribute, such as a digest of the files it reads), or every rank stops
    (exit 2). A collective, once the task has built them."""
    mine: dict[str, Any] = {}
    for name, dataset in datasets.items():
        mine[f"{name} samples"] = len(dataset)
        fingerprint = getattr(dataset, "fingerprint", None)
        if fingerprint is not None:
            mine[f"{name} fingerprint"] = str(fingerprint)
    lines = differences(dict(enumerate(gather_objects(mine))), roster())
    if lines:
        raise LaunchMismatchError(
            "the ranks built different data, and would train on different samples:\n"
            + "\n".join(f"  {line}" for line in lines)
            + "\nGive every node the same data (the same files, prepared alike) and the same "
            "task settings."
        )


def _roster_of(identities: Mapping[int, dict]) -> Roster:
    hosts: dict[str, dict[str, Any]] = {}
    for rank, found in sorted(identities.items()):
        host = hosts.setdefault(
            found["host"],
            {
                "host": found["host"],
                "addresses": found.get("addresses", []),
                "device": found.get("device", "unknown"),
                "ranks": [],
            },
        )
        host["ranks"].append(rank)
    return Roster(list(hosts.values()))


def describe_ranks(ranks: Iterable[int], roster_: Roster) -> str:
    """`rank 3 on node02`, `ranks 0-7 on node01, 16-23 on node03`."""
    ranks = sorted(ranks)
    by_host: dict[str, list[int]] = {}
    for rank in ranks:
        by_host.setdefault(roster_.host_of(rank), []).append(rank)
    word = "rank" if len(ranks) == 1 else "ranks"
    return f"{word} " + ", ".join(
        f"{_rank_ranges(group, bare=True)} on {host}" for host, group in by_host.items()
    )


def _rank_ranges(ranks: Iterable[int], bare: bool = False) -> str:
    """`0-3, 8` (with `ranks `/`rank ` in front unless bare)."""
    ranks = sorted(ranks)
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    if bare:
        return text
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {text}"
