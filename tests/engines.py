"""Real launch engines for the launcher tests: a one-node Slurm cluster and network-namespace hosts.

Both need root and system packages (slurm-wlm, munge, iproute2, iptables). Where they are
missing the tests are skipped with the reason, unless REQUIRE_LAUNCH_ENGINES=1 (set by CI)
turns the skip into a failure, so that CI can never pass without having run them.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import pytest


def unavailable(reason: str) -> None:
    """Skip the test, or fail it where the engines are required."""
    if os.environ.get("REQUIRE_LAUNCH_ENGINES") == "1":
        pytest.fail(f"REQUIRE_LAUNCH_ENGINES=1 but {reason}")
    pytest.skip(reason)


def require_root_and(*programs: str) -> None:
    if os.geteuid() != 0:
        unavailable("needs root (to start Slurm daemons and create network namespaces)")
    missing = [program for program in programs if shutil.which(program) is None]
    if missing:
        packages = "slurm-wlm munge iproute2 iptables"
        unavailable(f"{', '.join(missing)} not installed (apt-get install {packages})")


def free_port() -> int:
    """A TCP port that nothing listens on now (for daemons that cannot take port 0)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until(condition: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.5)


@dataclass
class SlurmCluster:
    """A running one-node cluster; `env` points Slurm's commands at it.

    Partitions: `debug` (the default) and `requeue` hold the jobs under test; a job in `urgent`
    preempts them, which cancels a job in `debug` (PreemptMode=CANCEL: TERM to every process,
    KILL after KillWait) and makes Slurm requeue one in `requeue` (PreemptMode=REQUEUE).
    """

    root: Path
    env: dict[str, str]

    def run(self, *command: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            command, env=self.env, capture_output=True, text=True, check=True, **kwargs
        )

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, ...)."""
        fields = self.run("scontrol", "show", "job", "--oneliner", job_id).stdout.split()
        return dict(field.split("=", 1) for field in fields if "=" in field)

    def logs(self) -> str:
        return "\n".join(path.read_text() for path in sorted((self.root / "log").glob("*")))


@contextmanager
def slurm_cluster(root: Path) -> Iterator[SlurmCluster]:
    """Start munged, slurmctld and slurmd as root with all state under `root`; stop them after."""
    require_root_and("munged", "mungekey", "slurmctld", "slurmd", "sbatch")
    for name in ("state", "spool", "log"):
        (root / name).mkdir(parents=True)
    key, sock = root / "munge.key", root / "munge.socket"
    subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True)
    key.chmod(0o600)
    munged = [
        "munged",
        "--force",
        f"--key-file={key}",
        f"--socket={sock}",
        f"--pid-file={root / 'munged.pid'}",
        f"--log-file={root / 'log' / 'munged.log'}",
        f"--seed-file={root / 'munge.seed'}",
    ]
    subprocess.run(munged, check=True)
    host = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(
        f"""ClusterName=ddptest
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
StateSaveLocation={root / "state"}
SlurmdSpoolDir={root / "spool"}
SlurmctldPidFile={root / "slurmctld.pid"}
SlurmdPidFile={root / "slurmd.pid"}
SlurmctldLogFile={root / "log" / "slurmctld.log"}
SlurmdLogFile={root / "log" / "slurmd.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
PreemptType=preempt/partition_prio
PreemptMode=CANCEL
NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1
PartitionName=requeue Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE
PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2
"""
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons = [
        subprocess.Popen([daemon, "-D", "-f", str(conf)], env=env, stderr=subprocess.DEVNULL)
        for daemon in ("slurmctld", "slurmd")
    ]
    cluster = SlurmCluster(root, env)
    try:
        wait_until(lambda: _node_idle(cluster, host), 60, "the Slurm node to become idle")
        yield cluster
    finally:
        with suppress(subprocess.CalledProcessError):
            cluster.run("scancel", "--full", "--user=root")
        for daemon in daemons:
            daemon.terminate()
        for daemon in daemons:
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()
        with suppress(FileNotFoundError, ProcessLookupError, ValueError):
            os.kill(int((root / "munged.pid").read_text()), 15)


def _node_idle(cluster: SlurmCluster, host: str) -> bool:
    result = subprocess.run(
        ["sinfo", "--noheader", "--nodes", host, "--format=%T"],
        env=cluster.env,
        capture_output=True,
        text=True,
    )
    return result.returncode == 0 and result.stdout.strip() == "idle"


@dataclass
class Host:
    """A network namespace acting as one machine: run commands in it with `prefix`, or as a
    whole node with `node_command`."""

    namespace: str
    interface: str
    address: str

    @property
    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.namespace]

    def node_command(
        self, name: str, hosts_file: Path, command: list[str], private_dir: Path | None = None
    ) -> list[str]:
        """`command` run as node `name`: its own host name, /etc/hosts (`hosts_file`) and
        process tree (killing the first process powers the node off), the file system shared
        with the other nodes but for `private_dir`, which this node sees empty (a directory
        that is not shared, as a node-local disk)."""
        script = (
            'hostname "$1" && mount --bind "$2" /etc/hosts || exit 97; '
            'if [ -n "$3" ]; then mount -t tmpfs node-local "$3" || exit 97; fi; '
            'shift 3; exec "$@"'
        )
        isolate = ["unshare", "--uts", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc"]
        private = str(private_dir) if private_dir else ""
        return [
            *self.prefix,
            *isolate,
            "bash",
            "-c",
            script,
            "node",
            name,
            str(hosts_file),
            private,
            *command,
        ]

    def link(self, up: bool) -> None:
        """Cut this host's link (no reset: packets vanish), or restore it."""
        state = "up" if up else "down"
        subprocess.run(
            ["ip", "-n", self.namespace, "link", "set", self.interface, state], check=True
        )

    def drop_port(self, port: int) -> None:
        """A firewall on this host drops what comes in on `port` (iptables)."""
        require_root_and("iptables")
        rule = ["-p", "tcp", "--dport", str(port), "-j", "DROP"]
        subprocess.run([*self.prefix, "iptables", "-A", "INPUT", *rule], check=True)

    def open_ports(self) -> None:
        subprocess.run([*self.prefix, "iptables", "-F", "INPUT"], check=False)


@contextmanager
def two_hosts(tag: str) -> Iterator[tuple[Host, Host]]:
    """Two namespaces joined by a veth pair, with addresses of their own; removed afterwards.

    The namespaces have no other interface, so the subnet cannot clash with the machine's
    networks; `tag` (at most 12 characters) keeps the names apart from other runs.
    """
    require_root_and("ip")
    hosts = (
        Host(f"{tag}-a", f"{tag}a", "10.213.0.1"),
        Host(f"{tag}-b", f"{tag}b", "10.213.0.2"),
    )
    created: list[str] = []
    try:
        for host in hosts:
            subprocess.run(["ip", "netns", "add", host.namespace], check=True)
            created.append(host.namespace)
        first, second = hosts
        link = ["ip", "link", "add", first.interface, "type", "veth"]
        subprocess.run([*link, "peer", "name", second.interface], check=True)
        for host in hosts:
            subprocess.run(
                ["ip", "link", "set", host.interface, "netns", host.namespace], check=True
            )
            address = ["ip", "-n", host.namespace, "addr", "add", f"{host.address}/24"]
            subprocess.run([*address, "dev", host.interface], check=True)
            for interface in ("lo", host.interface):
                up = ["ip", "-n", host.namespace, "link", "set", interface, "up"]
                subprocess.run(up, check=True)
        yield hosts
    finally:
        # Deleting a namespace deletes the veth end inside it, and with it the pair.
        for namespace in created:
            subprocess.run(["ip", "netns", "delete", namespace], check=False)
