"""The preflight check: launched exactly as training is, it says whether this job can train here.

    launch/torchrun.sh --doctor [section.key=value ...]
    sbatch launch/slurm/train.sbatch --doctor [section.key=value ...]
    torchrun ... -m <package>.doctor --config configs/default.yaml [overrides] [--json FILE]

Before a long job, it runs on the same nodes, with the same config and overrides, what the
articles on multi-node training ask to check by hand, and prints one line per check: PASS,
WARN or FAIL, the value measured, and the fix (the variable, setting or command to change).
It exits 1 on any FAIL (0 otherwise; 2 for a setting refused as training refuses it) and rank 0
writes the report as JSON: the previous one is removed as it starts, and the new one written
whole. It trains nothing and writes nothing in the run directory but a probe file it removes.

What needs no other rank runs first, and is reported even when the process group cannot start
(an interface that GLOO_SOCKET_IFNAME names is missing, the ranks were launched unalike, the
group fails): each rank's interfaces, addresses, variables, locked memory and cores, and rank
0's write in the run directory. Then, with the group:

- agreement: code, settings, versions and devices of every rank (agreement.py); the run
  directory is shared and has room for checkpoint.keep_last + 1 checkpoints; the hosts' clocks.
- network: the address and interface each rank's gloo uses, with its link speed where a NIC
  reports one; no loopback address between hosts; the interfaces GLOO_SOCKET_IFNAME and
  NCCL_SOCKET_IFNAME name exist on every host; on GPUs, what NCCL says it uses (nccl_log.py).
- fabric: all-reduce bus bandwidth (busbw, as nccl-tests define it) for every backend at hand,
  over all ranks and between neighbouring hosts (each host with the next, judged against the
  floor, the link their NICs report and the best pair, so that a bad link or node is named),
  against a floor (--busbw-floor); each measurement bounded by MEASURE_S.
- compute: each rank's matrix-multiply throughput in the training precision, against the
  fastest: a slow or throttled device is named with its host.
- data: the loader's throughput with the configured workers against what a few real steps of
  the task consume; /dev/shm; cores against ranks x workers; pinned memory and persistent
  workers.
- environment: the NCCL_*, GLOO_* and TORCH_* variables of every rank (differences named), the
  locked-memory limit, and the container's CPU limit.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .checkpointing.checkpoint import checkpoint_size
from .checkpointing.layout import latest_checkpoint
from .checkpointing.run_lock import Holder
from .checkpointing.storage import run_location, storage_of
from .cluster import nccl_log, network
from .cluster.agreement import (
    LaunchIncompleteError,
    LaunchMismatchError,
    agree_on_launch,
    describe_ranks,
    differences,
    identity,
    require_shared_run_dir,
    roster,
)
from .cluster.distributed import (
    DistEnv,
    barrier,
    control_group,
    detect_env,
    gather_objects,
    is_distributed,
    process_group,
)
from .config import Config
from .faults.stopping import StopRequests
from .faults.watchdog import startup_bounded
from .launch import exit_status_recorded
from .loading.data import affinity_cores, loader_workers, usable_cores
from .monitoring.logs import setup_logging
from .monitoring.metrics import MetricsLogger
from .monitoring.throughput import synchronize
from .task import Task
from .train import checked_config, tell_the_other_ranks
from .training.trainer import AUTOCAST_DTYPES, Trainer, move_to_device

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
#: All-reduce message sizes, in MiB: around DDP's default bucket (25 MiB).
SIZES_MIB = (1, 16, 64)
#: Those between each pair of neighbouring hosts.
PAIR_SIZES_MIB = (1, 16)
#: Seconds each bandwidth measurement may take: past it, the size in progress keeps what it has
#: and larger sizes are not tried. Without it a link held to 50 Mbit/s took 68 s to measure
#: (four all-reduces of each size; 11 s each at 64 MiB); with it, about 3 s.
MEASURE_S = 2.0
#: Default floors of busbw, in GB/s, below which the fabric is reported as too slow: a 1 Gb/s
#: link gives about 0.1 GB/s; NCCL between nodes should reach several GB/s.
FLOORS_GBPS = {"gloo": 0.1, "nccl": 5.0, "mpi": 0.1}
#: A rank or a link slower than this share of the best is named.
SLOW_SHARE = 0.8
#: A pair of hosts below this share of the speed their NICs report is named.
LINK_SHARE = 0.25
#: gloo sends a pair's data over one TCP connection, which seldom passes 10 Gb/s: a faster
#: link is judged as one of 10 Gb/s.
GLOO_LINK_CAP_MBPS = 10_000
_ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_")


@dataclass
class Check:
    """One line of the report."""

    name: str
    verdict: str
    value: str
    fix: str = ""

    def line(self) -> str:
        text = f"{self.verdict}  {self.name:<16} {self.value}"
        return f"{text}\n      fix: {self.fix}" if self.fix else text


class _Disagreed(Exception):
    """The ranks were not launched alike: no process group, and `check` says why."""

    def __init__(self, check: Check) -> None:
        super().__init__(check.value)
        self.check = check


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__package__}.doctor",
        description="Preflight check of a job, launched exactly as training is.",
    )
    parser.add_argument("--config", type=Path, help="YAML file on top of the defaults")
    parser.add_argument(
        "--json", type=Path, default=Path("doctor-report.json"), help="the report, as JSON"
    )
    parser.add_argument(
        "--busbw-floor",
        type=float,
        metavar="GBPS",
        help=f"the least all-reduce busbw in GB/s (default: {FLOORS_GBPS})",
    )
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = detect_env()
    if env.is_main:
        # A run that ends before its report must not leave an earlier run's report looking
        # like its own.
        args.json.unlink(missing_ok=True)
    config = checked_config(args.config, args.overrides, env)
    if config is None:
        return 2
    setup_logging(env.rank)
    started = time.monotonic()
    nccl_log_dir = _log_nccl_transport()
    here = _here(config, env)
    with _run_dir_probe(config, env) as probe:
        checks = _checks(config, env, args.busbw_floor, nccl_log_dir, here, probe)
    return _finish(checks, env, args.json, time.monotonic() - started)


def _checks(
    config: Config,
    env: DistEnv,
    floor: float | None,
    nccl_log_dir: Path | None,
    here: dict[str, Any],
    probe: _Probe,
) -> list[Check]:
    """Every check once the process group has started; what this rank found alone, and why
    the group did not start, when it cannot (the report names its cause in the project's
    words, not gloo's)."""
    if here["problems"] and env.world_size > 1:
        # gloo would abort on the missing interface: the other ranks are told instead.
        tell_the_other_ranks(env, "\n".join(here["problems"]))
        reason = "not started: an interface that GLOO_/NCCL_SOCKET_IFNAME names is missing"
        return [Check("process group", SKIP, reason), *_checks_alone(config, env, here, probe)]

    def agree(store: dist.Store, device: torch.device) -> None:
        try:
            agree_on_launch(
                store, env.rank, env.world_size, identity(config, device), config.dist.timeout_s
            )
        except (LaunchMismatchError, LaunchIncompleteError) as error:
            fix = (
                "launch every node with the same commit, installed alike, and the same --config "
                "and overrides; a rank that refused its settings says which one to change"
            )
            raise _Disagreed(Check("agreement", FAIL, str(error), fix)) from error

    guard = startup_bounded(StopRequests(enabled=False), env, config.dist.timeout_s)
    group_started = False
    try:
        with process_group(env, config.dist, agree=agree, starting=guard) as device:
            group_started = True
            return _run_checks(config, env, device, floor, nccl_log_dir, here, probe)
    except _Disagreed as disagreed:
        return [disagreed.check, *_checks_alone(config, env, here, probe)]
    except RuntimeError as error:  # gloo's and NCCL's errors, LaunchIncompleteError
        if group_started:
            raise
        failed = Check(
            "process group",
            FAIL,
            f"did not start: {str(error).strip().splitlines()[0]}",
            "start every rank (a node's own log says why one failed), open MASTER_PORT "
            "between the nodes, and set GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME) to the "
            "interface they share",
        )
        return [failed, *_checks_alone(config, env, here, probe)]


def _run_checks(
    config: Config,
    env: DistEnv,
    device: torch.device,
    floor: float | None,
    nccl_log_dir: Path | None,
    here: dict[str, Any],
    probe: _Probe,
) -> list[Check]:
    """Every check, on every rank in the same order (they hold collectives); the report as
    rank 0 composed it."""
    everyone = gather_objects(here)
    checks = [_agreement(env, device), _run_dir(config, env, probe), probe.room]
    checks.extend(_clock_skew(config, env))
    checks.extend(_host_checks(config, everyone))
    checks.extend(_fabric(env, device, floor, everyone))
    checks.append(_nccl_transport(device, nccl_log_dir))
    checks.append(_compute(config, env, device))
    checks.extend(_data(config, env, device))
    return gather_objects(checks if env.is_main else None)[0]


def _checks_alone(config: Config, env: DistEnv, here: dict[str, Any], probe: _Probe) -> list[Check]:
    """What this rank finds without the others: its host's interfaces, variables and cores,
    and (rank 0) whether it can write in the run directory."""
    if probe.problem:
        run_dir = Check("run directory", FAIL, probe.problem, _RUN_DIR_WRITABLE)
    elif env.is_main:
        shown = f"rank 0 can write in {probe.run_dir}; whether every rank sees it needs the group"
        run_dir = Check("run directory", PASS, shown)
    else:
        run_dir = Check("run directory", SKIP, "rank 0 checks it")
    return [run_dir, probe.room, *_host_checks(config, [here])]


def _finish(checks: list[Check], env: DistEnv, report: Path, seconds: float) -> int:
    status = 1 if any(check.verdict == FAIL for check in checks) else 0
    counts = {kind: sum(check.verdict == kind for check in checks) for kind in (FAIL, WARN, PASS)}
    summary = (
        f"doctor: {counts[FAIL]} FAIL, {counts[WARN]} WARN, {counts[PASS]} PASS in "
        f"{seconds:.1f} s on {env.world_size} rank(s); report: {report.resolve()}"
    )
    if env.local_rank == 0:  # every host prints it: a node's own output may be all a user sees
        print("\n".join(check.line() for check in checks), flush=True)
        print(summary, flush=True)
    if env.is_main:
        document = {
            "status": status,
            "seconds": round(seconds, 2),
            "roster": roster().hosts,
            "checks": [asdict(check) for check in checks],
        }
        partial = report.with_name(f".{report.name}.partial")
        partial.write_text(json.dumps(document, indent=2) + "\n")
        partial.replace(report)  # whole or not at all: a reader never sees half a report
    return status


# --- agreement --------------------------------------------------------------------------------


def _agreement(env: DistEnv, device: torch.device) -> Check:
    versions = identity(None, device)["versions"]
    return Check(
        "agreement",
        PASS,
        f"code, settings, versions (torch {versions['torch']}, CUDA {versions['cuda']}, NCCL "
        f"{versions['nccl']}) and devices agree: {_where(env)}",
    )


def _where(env: DistEnv) -> str:
    return roster().describe() if roster().hosts else f"{env.world_size} rank(s)"


_RUN_DIR_WRITABLE = "set run.dir to a directory rank 0 can write (or fix its permissions)"


@dataclass
class _Probe:
    """Rank 0's probe file in the run directory, which every rank looks for once the group
    has started; and the disk room there, as rank 0 found it."""

    run_dir: Any
    #: The file's name and its record's token: rank 0's (None elsewhere).
    marker: str | None
    token: str | None
    #: Why rank 0 could not write it; None when it could.
    problem: str | None
    room: Check


@contextlib.contextmanager
def _run_dir_probe(config: Config, env: DistEnv) -> Iterator[_Probe]:
    """Rank 0 writes the probe before any process group starts, and removes it on leaving."""
    run_dir = run_location(config.run.dir, config.run.local_dir)
    if not env.is_main:
        yield _Probe(run_dir, None, None, None, Check("disk room", SKIP, ""))
        return
    store = storage_of(run_dir)
    holder = Holder.of_this_process(0)
    marker = f".doctor-probe-{holder.token}"
    try:
        store.make_dirs(run_dir)
        store.write(
            run_dir / marker, lambda handle: handle.write(json.dumps(asdict(holder)).encode())
        )
    except OSError as error:
        yield _Probe(
            run_dir,
            None,
            None,
            f"rank 0 cannot write in {run_dir}: {error}",
            _room(config, run_dir),
        )
        return
    try:
        yield _Probe(run_dir, marker, holder.token, None, _room(config, run_dir))
    finally:
        with contextlib.suppress(OSError):
            store.remove(run_dir / marker)


def _run_dir(config: Config, env: DistEnv, probe: _Probe) -> Check:
    """Every rank sees the probe that rank 0 wrote: the run directory is shared."""
    marker, token, problem = gather_objects((probe.marker, probe.token, probe.problem))[0]
    if problem:
        return Check("run directory", FAIL, problem, _RUN_DIR_WRITABLE)
    try:
        require_shared_run_dir(
            probe.run_dir, config.run.dir, token, env, config.dist.timeout_s, marker
        )
    except LaunchMismatchError as error:
        fix = (
            "set run.dir to a path every node mounts (run.dir=/shared/runs/NAME), or to an "
            "object store (run.dir=s3://BUCKET/PREFIX)"
        )
        return Check("run directory", FAIL, str(error), fix)
    return Check("run directory", PASS, f"every rank sees {probe.run_dir}")


def _room(config: Config, run_dir: Any) -> Check:
    """Free space for keep_last + 1 checkpoints: the newest one's size, or the model's."""
    keep = config.checkpoint.keep_last + 1
    newest = latest_checkpoint(run_dir)
    if newest is not None:
        size, source = checkpoint_size(newest), f"{newest.name}'s size"
    else:
        model = Task(config.task, seed=config.run.seed).build_model()
        weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        size, source = 3 * weights, "the weights and AdamW's two moments"
    free = storage_of(run_dir).free_space(run_dir)
    needed = f"{keep} checkpoints of about {_gb(size)} ({source})"
    if free is None:
        return Check("disk room", PASS, f"{run_dir} is an object store: {needed}")
    verdict = PASS if free >= keep * size else WARN if free >= size else FAIL
    fix = (
        ""
        if verdict == PASS
        else (
            "free space there, lower checkpoint.keep_last, or set run.dir to a larger file system"
        )
    )
    return Check("disk room", verdict, f"{_gb(free)} free in {run_dir}; needs {needed}", fix)


def _clock_skew(config: Config, env: DistEnv) -> list[Check]:
    barrier(config.dist.timeout_s)
    clocks = gather_objects(time.time())
    skew = max(clocks) - min(clocks)
    slowest, fastest = clocks.index(min(clocks)), clocks.index(max(clocks))
    value = f"{skew:.3f} s between the hosts' clocks"
    if skew < 2:
        return [Check("clock skew", PASS, value)]
    value += f" ({roster().host_of(fastest)} ahead of {roster().host_of(slowest)})"
    verdict = WARN if skew < 300 else FAIL
    fix = "synchronise the clocks (chrony or ntpd on every node): logs interleave wrongly, and "
    fix += "object stores refuse requests signed more than 15 minutes off"
    return [Check("clock skew", verdict, value, fix)]


# --- network ----------------------------------------------------------------------------------


def _here(config: Config, env: DistEnv) -> dict[str, Any]:
    """What this rank finds on its host with no other rank: the interface gloo uses, the
    interfaces the variables name, the variables, the locked-memory limit, the cores."""
    address = network.gloo_address()
    used = next((i for i in network.interfaces().values() if i.address == address), None)
    master = os.environ.get("MASTER_ADDR", "")
    try:
        master_addresses = network.resolve(master) if master else []
    except OSError:
        master_addresses = []
    variables = {  # the interfaces' names may differ between hosts: "socket ifnames" checks them
        k: v
        for k, v in os.environ.items()
        if k.startswith(_ENV_PREFIXES) and k not in network.SOCKET_INTERFACE_VARIABLES
    }
    return {
        "host": socket.gethostname(),
        "gloo": _describe(used) if used else address,
        "interface": used.name if used else address,
        "link_mbps": used.speed_mbps if used else None,
        "loopback": network.is_loopback(address),
        "master_loopback": bool(master_addresses)
        and all(map(network.is_loopback, master_addresses)),
        "problems": network.interface_problems() if env.world_size > 1 else [],
        "variables": variables,
        "memlock": resource.getrlimit(resource.RLIMIT_MEMLOCK)[0],
        "cores": usable_cores(),
        "affinity": affinity_cores(),
    }


def _describe(interface: network.Interface) -> str:
    if interface.speed_mbps or interface.is_loopback:
        return interface.describe()
    return f"{interface.describe()}, link speed not reported (a virtual interface)"


def _host_checks(config: Config, everyone: list[dict[str, Any]]) -> list[Check]:
    """The hosts' checks, from what each rank found on its own (`_here`): every rank's, or
    this rank's alone."""
    return [*_network(everyone), *_environment(everyone), _cores(config, everyone)]


def _network(everyone: list[dict[str, Any]]) -> list[Check]:
    hosts = {entry["host"] for entry in everyone}
    seen = "; ".join(sorted({f"{entry['host']}: {entry['gloo']}" for entry in everyone}))
    checks = [Check("interfaces", PASS, f"gloo uses {seen}")]
    problems = sorted({problem for entry in everyone for problem in entry["problems"]})
    if problems:
        fix = (
            "set the variable to an interface every node has (`ip -br addr` lists them), or "
            "unset it and let gloo and NCCL choose"
        )
        checks.append(Check("socket ifnames", FAIL, "; ".join(problems), fix))
    else:
        checks.append(Check("socket ifnames", PASS, "GLOO_/NCCL_SOCKET_IFNAME name existing ones"))
    if len(hosts) > 1:
        master = os.environ.get("MASTER_ADDR", "")
        odd = [rank for rank, entry in enumerate(everyone) if entry["master_loopback"]]
        loops = [rank for rank, entry in enumerate(everyone) if entry["loopback"]]
        if odd:
            checks.append(
                Check(
                    "loopback",
                    FAIL,
                    f"MASTER_ADDR={master} is a loopback address on "
                    f"{describe_ranks(odd, roster())}",
                    "set LOCAL_ADDR on the rank-0 node to its address on the network the nodes "
                    "share (or fix the /etc/hosts line that maps its name to 127.0.1.1)",
                )
            )
        elif loops:
            checks.append(
                Check(
                    "loopback",
                    WARN,
                    f"gloo on {describe_ranks(loops, roster())} uses a loopback address: other "
                    "hosts may not reach it",
                    "set GLOO_SOCKET_IFNAME to the interface the nodes share (`ip -br addr` "
                    "lists them)",
                )
            )
        else:
            checks.append(Check("loopback", PASS, "no loopback address between the hosts"))
    return checks


def _log_nccl_transport() -> Path | None:
    """On a GPU, have NCCL log its choice of transport to a scratch directory (unless the user
    already directs NCCL's log): NCCL reads these variables when its first group starts."""
    if not torch.cuda.is_available() or "NCCL_DEBUG_FILE" in os.environ:
        return None
    directory = Path(tempfile.mkdtemp(prefix="doctor-nccl-"))
    os.environ.setdefault("NCCL_DEBUG", "INFO")
    os.environ.setdefault("NCCL_DEBUG_SUBSYS", "INIT,NET")
    os.environ["NCCL_DEBUG_FILE"] = str(directory / "nccl.%h.%p.log")
    return directory


_SILENT = nccl_log.Transports()


def _nccl_transport(device: torch.device, log_dir: Path | None) -> Check:
    """What NCCL says it uses (cluster/nccl_log.py), on every rank: TCP sockets between hosts
    is named, with the cause NCCL gave."""
    if device.type != "cuda":
        return Check("nccl transport", SKIP, "no GPU: NCCL is not used")
    text = ""
    if log_dir is not None:
        text = "".join(path.read_text(errors="replace") for path in log_dir.glob("nccl.*"))
    everyone = [told for told in gather_objects(nccl_log.transports(text)) if told != _SILENT]
    if not everyone:
        return Check("nccl transport", SKIP, "NCCL's log says nothing (NCCL_DEBUG_FILE is yours)")
    networks = sorted({found.network for found in everyone if found.network})
    channels = dict.fromkeys(channel for found in everyone for channel in found.channels)
    told = nccl_log.Transports(
        ", ".join(networks) or None, any(f.no_ib_device for f in everyone), tuple(channels)
    )
    value = f"NCCL: {told.describe()}"
    if len(roster().hosts) > 1 and nccl_log.SOCKETS in (*networks, *channels):
        fix = (
            "if the nodes have InfiniBand or RoCE: `ibv_devinfo` on each (a port must be "
            "PORT_ACTIVE), unset NCCL_IB_DISABLE and NCCL_NET, set NCCL_IB_HCA to the devices, "
            "and give a container /dev/infiniband (docker run --device=/dev/infiniband)"
        )
        return Check("nccl transport", WARN, f"{value}: TCP between the hosts", fix)
    return Check("nccl transport", PASS, value)


def _environment(everyone: list[dict[str, Any]]) -> list[Check]:
    checks = []
    lines = differences(dict(enumerate(e["variables"] for e in everyone)), roster())
    shown = ", ".join(f"{k}={v}" for k, v in sorted(everyone[0]["variables"].items()))
    if lines:
        fix = (
            "export the same values on every node (in the batch script, or before "
            "launch/torchrun.sh), unless the hardware differs"
        )
        checks.append(Check("environment", WARN, "differ: " + " | ".join(lines), fix))
    else:
        where = "alike on every rank" if len(everyone) > 1 else "on this rank"
        checks.append(Check("environment", PASS, f"{where}: {shown or 'none set'}"))
    limited = [r for r, e in enumerate(everyone) if e["memlock"] != resource.RLIM_INFINITY]
    if limited and torch.cuda.is_available():
        checks.append(
            Check(
                "memlock",
                WARN,
                f"locked memory is limited on {describe_ranks(limited, roster())}: InfiniBand "
                "and GPUDirect need it unlimited",
                "run `ulimit -l unlimited` before the launch (docker run --ulimit memlock=-1; "
                "under Slurm, LimitMEMLOCK=infinity in slurmd's systemd unit)",
            )
        )
    else:
        checks.append(Check("memlock", PASS, "unlimited, or no GPU that needs it"))
    capped = [r for r, e in enumerate(everyone) if e["cores"] < e["affinity"]]
    if capped:
        checks.append(
            Check(
                "cpu limit",
                WARN,
                f"a container limit leaves {describe_ranks(capped, roster())} fewer cores than "
                "it may run on",
                "raise the container's CPU limit (docker run --cpus, Slurm --cpus-per-task), "
                "or lower data.num_workers",
            )
        )
    else:
        cores = everyone[0]["cores"]
        checks.append(Check("cpu limit", PASS, f"{cores} usable core(s) here, no lower limit"))
    return checks


# --- fabric and compute -----------------------------------------------------------------------


def _fabric(
    env: DistEnv, device: torch.device, floor: float | None, everyone: list[dict[str, Any]]
) -> list[Check]:
    if not is_distributed():
        return [Check("fabric", SKIP, "a single process: nothing to all-reduce")]
    backends = {"gloo": (control_group(), torch.device("cpu"))}
    if device.type == "cuda":
        backends["nccl"] = (None, device)
    mpi_group, mpi_skipped = _mpi_group(env)
    if mpi_skipped is None:
        backends["mpi"] = (mpi_group, torch.device("cpu"))
    interfaces = ", ".join(sorted({f"{e['host']}: {e['interface']}" for e in everyone}))
    checks = []
    for name, (group, on) in backends.items():
        measured = _sweep(SIZES_MIB, group, on)
        least = floor if floor is not None else FLOORS_GBPS[name]
        value = _table(measured, SIZES_MIB, least)
        if max(measured.values()) >= least:
            checks.append(Check(f"busbw {name}", PASS, value))
        else:
            fix = _SLOW_FABRIC[name].format(interfaces=interfaces)
            checks.append(Check(f"busbw {name}", FAIL, value, fix))
    if mpi_skipped is not None:
        checks.append(mpi_skipped)
    checks.append(_host_pairs(env, everyone, floor))
    return checks


#: What to change when a backend's busbw is below its floor.
_SLOW_FABRIC = {
    "gloo": (
        "gloo runs over {interfaces}: set GLOO_SOCKET_IFNAME to a faster interface every node "
        "has (`ip -br link` lists them), or pass --busbw-floor GBPS if this link is the "
        "fastest there is"
    ),
    "nccl": (
        "see `nccl transport` for what NCCL runs over: set NCCL_IB_HCA to the InfiniBand/RoCE "
        "devices (`ibv_devinfo` lists them), or NCCL_SOCKET_IFNAME to the fastest interface"
    ),
    "mpi": (
        "MPI chooses its own transport: name the fast one to your MPI (Open MPI: "
        "`mpirun --mca pml ucx -x UCX_NET_DEVICES=mlx5_0:1`)"
    ),
}


def _mpi_group(env: DistEnv) -> tuple[dist.ProcessGroup | None, Check | None]:
    """The group to measure MPI on (None: the default group, when it is MPI's), or the line
    that says why MPI is not measured. MPI's ranks are torch's only when mpirun started them."""
    if not dist.is_mpi_available():
        reason = "this torch is not built with MPI (torch.distributed.is_mpi_available())"
        return None, Check("busbw mpi", SKIP, reason)
    if dist.get_backend() == "mpi":
        return None, None
    if env.launcher != "mpi":
        reason = (
            f"this torch has MPI, but {env.launcher} started the ranks, not mpirun: MPI's "
            "ranks are not this job's (launch the doctor with mpirun to measure it)"
        )
        return None, Check("busbw mpi", SKIP, reason)
    return dist.new_group(backend="mpi"), None


def _sweep(
    sizes_mib: tuple[int, ...], group: dist.ProcessGroup | None, device: torch.device
) -> dict[int, float]:
    """busbw in GB/s (nccl-tests' definition) of a SUM all-reduce of each size, smallest first:
    the median of up to 3 after a warm-up one. Once the all-reduces have taken MEASURE_S
    (the slowest rank's; not the group's first, which sets up its connections), the size in
    progress keeps what it has and larger ones are not tried: a slow link is judged in
    seconds. A collective of `group`'s ranks."""
    ranks = dist.get_world_size(group)
    spent, results = 0.0, {}
    for size in sizes_mib:
        tensor = torch.ones((size << 20) // 4, dtype=torch.float32, device=device)
        times: list[float] = []
        while len(times) < 4 and spent <= MEASURE_S:
            seconds = _all_reduce_s(tensor, group)
            spent += seconds if results or times else 0.0
            times.append(seconds)
        median = statistics.median(times[1:] or times)
        results[size] = (size << 20) / median * 2 * (ranks - 1) / ranks / 1e9
        if spent > MEASURE_S:
            break
    return results


def _all_reduce_s(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> float:
    """Seconds one all-reduce of `tensor` took on the slowest rank of `group`."""
    synchronize(tensor.device)
    started = time.perf_counter()
    dist.all_reduce(tensor, group=group)
    synchronize(tensor.device)
    slowest = torch.tensor([time.perf_counter() - started], device=tensor.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return float(slowest.item())


def _table(measured: dict[int, float], sizes_mib: tuple[int, ...], floor: float) -> str:
    """`1 MiB 0.5, 16 MiB 0.9 GB/s (floor 0.1 GB/s)`, and the sizes not tried."""
    table = ", ".join(f"{size} MiB {bw:.3g}" for size, bw in measured.items())
    table += f" GB/s (floor {floor} GB/s)"
    untried = [str(size) for size in sizes_mib if size not in measured]
    if untried:
        table += f"; {', '.join(untried)} MiB not tried: the {MEASURE_S:g} s were spent"
    return table


@dataclass(frozen=True)
class _Pair:
    """Two neighbouring hosts, the gloo busbw between them, and what their interfaces report."""

    hosts: tuple[str, str]
    busbw: float
    #: gloo's interface on each host.
    interfaces: tuple[str, str]
    #: The slower of the two links, in Mb/s, as the NICs report it; None where one does not.
    link_mbps: int | None


def _host_pairs(env: DistEnv, everyone: list[dict[str, Any]], floor: float | None) -> Check:
    """busbw between each host's first rank and the next host's, on gloo: a link or node that
    is slow shows as the host the slow pairs share."""
    leaders = [host["ranks"][0] for host in roster().hosts]
    if len(leaders) < 2:
        return Check("host pairs", SKIP, "one host: no link between hosts to measure")
    neighbours = zip(leaders, leaders[1:] + leaders[:1], strict=True)
    pairs = []
    for a, b in sorted({tuple(sorted(pair)) for pair in neighbours}):
        group = dist.new_group([a, b], backend="gloo")
        bandwidth = None
        if env.rank in (a, b):
            bandwidth = max(_sweep(PAIR_SIZES_MIB, group, torch.device("cpu")).values())
        speeds = [everyone[a]["link_mbps"], everyone[b]["link_mbps"]]
        pairs.append(
            _Pair(
                hosts=(everyone[a]["host"], everyone[b]["host"]),
                busbw=max(value or 0.0 for value in gather_objects(bandwidth)),
                interfaces=(everyone[a]["interface"], everyone[b]["interface"]),
                link_mbps=None if None in speeds else min(speeds),
            )
        )
    return _pair_verdict(pairs, FLOORS_GBPS["gloo"] if floor is None else floor)


def _pair_verdict(pairs: list[_Pair], floor: float) -> Check:
    """The host pairs judged, each named with both hosts when it is below `floor` (FAIL), far
    below the link their NICs report, or below SLOW_SHARE of the best pair (WARN)."""
    best = max(pair.busbw for pair in pairs)
    shown, named, verdicts = [], [], set()
    for pair in pairs:
        link = f"links of {pair.link_mbps} Mb/s" if pair.link_mbps else "link speed not reported"
        line = f"{'-'.join(pair.hosts)} {pair.busbw:.3g} GB/s ({link})"
        problem = _pair_problem(pair, floor, best)
        if problem:
            verdicts.add(problem[0])
            named.append(pair)
            line += f", {problem[1]}"
        shown.append(line)
    value = f"gloo busbw up to {max(PAIR_SIZES_MIB)} MiB: {'; '.join(shown)}"
    if not named:
        return Check("host pairs", PASS, value)
    first = named[0]
    fix = (
        f"test the link between {first.hosts[0]} and {first.hosts[1]}: `ethtool IFACE` on both "
        "(speed, duplex), `ip -s link show IFACE` (errors, drops), `tc qdisc show dev IFACE` "
        f"(a rate limit), IFACE being {first.interfaces[0]} and {first.interfaces[1]}; or set "
        "GLOO_SOCKET_IFNAME to a faster interface the hosts share"
    )
    return Check("host pairs", FAIL if FAIL in verdicts else WARN, value, fix)


def _pair_problem(pair: _Pair, floor: float, best: float) -> tuple[str, str] | None:
    """(verdict, why) for a pair to name; None for one that passes."""
    if pair.busbw < floor:
        return FAIL, f"below the floor of {floor} GB/s"
    judged_mbps = min(pair.link_mbps or 0, GLOO_LINK_CAP_MBPS)
    if judged_mbps and pair.busbw < LINK_SHARE * judged_mbps / 8000:
        share = f"{pair.busbw / (judged_mbps / 8000):.0%}"
        if judged_mbps < (pair.link_mbps or 0):
            return WARN, f"{share} of the {judged_mbps} Mb/s gloo can use of them"
        return WARN, f"{share} of their speed"
    if pair.busbw < SLOW_SHARE * best:
        return WARN, f"below {SLOW_SHARE:.0%} of the best pair"
    return None


def _compute(config: Config, env: DistEnv, device: torch.device) -> Check:
    """Matrix-multiply TFLOP/s of each rank in the training precision, against the fastest."""
    dtype = AUTOCAST_DTYPES[config.train.mixed_precision] or torch.float32
    if device.type == "cpu" and dtype == torch.float16:
        dtype = torch.float32  # CPUs multiply fp16 slowly; autocast uses bf16 or fp32 there
    n = 4096 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    iterations, started = 0, time.perf_counter()
    while time.perf_counter() - started < 0.5 or iterations < 3:
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        iterations += 1
    tflops = 2 * n**3 * iterations / (time.perf_counter() - started) / 1e12
    everyone = gather_objects(tflops)
    fastest = max(everyone)
    slow = [rank for rank, value in enumerate(everyone) if value < SLOW_SHARE * fastest]
    spread = f"{min(everyone):.3g}-{fastest:.3g} TFLOP/s per rank ({dtype}, {n}x{n} matmul)"
    if not slow:
        return Check("compute", PASS, spread)
    return Check(
        "compute",
        WARN,
        f"{describe_ranks(slow, roster())} below {SLOW_SHARE:.0%} of the fastest: {spread}",
        "run `nvidia-smi -q -d PERFORMANCE,TEMPERATURE,POWER` on that host: a throttled "
        "(hot, power-capped) or busy device; another job on it shows in `nvidia-smi`",
    )


# --- data -------------------------------------------------------------------------------------


def _data(config: Config, env: DistEnv, device: torch.device) -> list[Check]:
    """The loader against a few real steps of the task, in a scratch run directory."""
    with tempfile.TemporaryDirectory(prefix="doctor-") as scratch:
        trainer = Trainer(
            config,
            Task(config.task, seed=config.run.seed),
            env,
            device,
            Path(scratch),
            MetricsLogger(Path(scratch), is_main=env.is_main),
        )
        loader = trainer.train_loader
        accumulation = trainer.accumulation_steps
        steps = max(1, min(10, trainer.steps_per_epoch - 1))
        per_step = trainer.micro_batch_size * accumulation
        trainer.sampler.set_epoch(0)
        batches = iter(loader)
        warm = [move_to_device(next(batches), device) for _ in range(accumulation)]
        started = time.perf_counter()  # the workers run: loading at its steady pace
        timed = [move_to_device(next(batches), device) for _ in range(steps * accumulation)]
        loading = steps * per_step / (time.perf_counter() - started)
        trainer.train_step(iter(warm))  # the first step warms up: not timed
        started = time.perf_counter()  # steps on batches already loaded: the model's pace
        for step in range(steps):
            trainer.train_step(iter(timed[step * accumulation : (step + 1) * accumulation]))
        consuming = steps * per_step / (time.perf_counter() - started)
        workers, pinned = loader.num_workers, loader.pin_memory
        persistent = loader.persistent_workers
        del trainer, batches, loader, warm, timed
    everyone = gather_objects((loading, consuming))
    slowest_loader = min(value for value, _ in everyone)
    fastest_step = max(value for _, value in everyone)
    value = (
        f"{slowest_loader:,.0f} samples/s per rank loaded with {workers} worker(s); training "
        f"consumes {fastest_step:,.0f}"
    )
    checks = []
    if slowest_loader >= 1.5 * fastest_step:
        checks.append(Check("loader", PASS, value))
    else:
        fix = (
            "raise data.num_workers, or make the data set's __getitem__ cheaper; for samples "
            "already in memory, data.num_workers=0 can be faster (no hand-over between processes)"
        )
        checks.append(Check("loader", WARN, value + ": the loader would hold training back", fix))
    checks.append(_shared_memory(workers))
    in_effect = f"pin_memory {'on' if pinned else 'off'}, persistent workers "
    in_effect += f"{'on' if persistent else 'off'}, prefetch {config.data.prefetch_factor}"
    checks.append(Check("loader options", PASS, in_effect + _options_note(device, workers)))
    return checks


def _options_note(device: torch.device, workers: int) -> str:
    notes = []
    if device.type != "cuda":
        notes.append("pinned memory serves GPU copies only")
    if workers == 0:
        notes.append("persistent workers and prefetching need data.num_workers > 0")
    return f" ({'; '.join(notes)})" if notes else ""


def _shared_memory(workers: int) -> Check:
    try:
        stats = os.statvfs("/dev/shm")
        size = stats.f_frsize * stats.f_blocks
    except OSError:
        return Check("/dev/shm", SKIP, "not mounted here")
    value = f"{_gb(size)} in /dev/shm"
    if workers and size < 1 << 30:
        fix = "docker run --ipc=host (or --shm-size=16g); worker batches pass through /dev/shm"
        return Check("/dev/shm", WARN, value + f", with {workers} loader worker(s)", fix)
    return Check("/dev/shm", PASS, value)


def _cores(config: Config, everyone: list[dict[str, Any]]) -> Check:
    ranks = collections.Counter(entry["host"] for entry in everyone)
    if len(everyone) == 1:  # alone: torchrun says how many ranks share this host
        ranks[everyone[0]["host"]] = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    found = set()
    for entry in everyone:
        host, cores = entry["host"], entry["cores"]
        found.add((host, ranks[host], loader_workers(config.data, ranks[host], cores), cores))
    crowded = sorted({host for host, r, w, c in found if r * w > c})
    value = "; ".join(
        sorted(f"{h}: {r} rank(s) x {w} worker(s), {c} cores" for h, r, w, c in found)
    )
    if crowded:
        fix = "set data.num_workers lower, or to auto (it follows the cores)"
        return Check(
            "cores", WARN, f"more workers than cores on {', '.join(crowded)}: {value}", fix
        )
    return Check("cores", PASS, value)


def _gb(size: float) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"


if __name__ == "__main__":
    # Under launch/torchrun.sh the launcher reports what each worker recorded: a torchrun it
    # has to end after its workers finished must not turn a passing doctor into a failure.
    sys.exit(exit_status_recorded(main))
