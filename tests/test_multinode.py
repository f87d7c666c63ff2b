"""One job across two machines, launched separately, and every way that goes wrong.

Two network-namespace hosts (alpha at 10.213.0.1, beta at 10.213.0.2, one veth link) each run
`launch/torchrun.sh` with NNODES=2 as its own node: its own host name, /etc/hosts and
processes, the file system shared but for a directory it may be given privately. One fixture
serves the module. Each fault must end on every node within the bound its settings give (a
process that outlives it fails the test), with the documented status and a message naming the
cause; the preflight check (`--doctor`) names each one the same way, since it is launched as
training is.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cookiecutter.main import cookiecutter
from engines import Host, two_hosts, wait_until
from matrix import ROOT
from test_launchers import assert_ends_with_its_status, assert_ends_with_the_training_s_message

pytestmark = [pytest.mark.xdist_group("multinode"), pytest.mark.timeout(600)]

BIN = Path(sys.executable).parent
PACKAGE = "multi_node"
NAMES = ("alpha", "beta")
#: Short bounds, so that the faults that wait show their end within seconds. Launches that
#: should meet wait longer: torchrun's own rendezvous, slowed by a loaded machine, takes it too.
JOIN_TIMEOUT_S = 3
MEETING_JOIN_TIMEOUT_S = 60
EXIT_TIMEOUT_S = 5
TIMEOUT_S = 5
#: A launch that has not ended this long after its bounds is hung: the test fails.
SLACK_S = 90
SHORT_RUN = [
    "task.num_train_samples=512",
    "task.hidden_dim=32",
    "train.global_batch_size=32",
    "train.micro_batch_size=8",
    "train.log_every=5",
    "checkpoint.every_steps=10",
    # Loader worker processes, as on any real node: they inherit what their rank has open and
    # get the signals sent to its process group.
    "data.num_workers=2",
    f"dist.timeout_s={TIMEOUT_S}",
]
LONG_RUN = [*SHORT_RUN, "train.epochs=1000", "train.max_steps=100000", "train.log_every=500"]
_ports = itertools.count(29411)


@dataclass
class Cluster:
    """The two hosts, as nodes alpha and beta."""

    hosts: tuple[Host, Host]
    hosts_files: dict[str, Path]


@dataclass
class NodeRun:
    code: int
    log: str


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("multinode")
    context = {"project_name": "Multi Node"}
    return Path(cookiecutter(str(ROOT), no_input=True, output_dir=str(out), extra_context=context))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    etc = tmp_path_factory.mktemp("etc")
    with two_hosts(f"mn{os.getpid() % 100000}") as hosts:
        files = {}
        for name in NAMES:
            files[name] = etc / f"hosts.{name}"
            entries = "".join(f"{h.address} {n}\n" for h, n in zip(hosts, NAMES, strict=True))
            files[name].write_text(f"127.0.0.1 localhost\n{entries}")
        yield Cluster(hosts, files)


def run_nodes(
    cluster: Cluster,
    project: Path,
    tmp_path: Path,
    arguments: list[str],
    envs: tuple[dict[str, str | None], dict[str, str | None]] = ({}, {}),
    nodes: tuple[str, ...] = NAMES,
    private: dict[str, Path] | None = None,
    hosts_files: dict[str, Path] | None = None,
    during: Callable[[dict[str, subprocess.Popen]], None] | None = None,
    bound_s: float = JOIN_TIMEOUT_S,
    port: int | None = None,
    join_timeout_s: float = MEETING_JOIN_TIMEOUT_S,
    own_arguments: dict[str, list[str]] | None = None,
) -> dict[str, NodeRun]:
    """Launch `launch/torchrun.sh ARGUMENTS` on the `nodes` at once; return each one's exit
    status and output once both have ended. `envs` change each node's environment (None unsets
    a variable), `own_arguments` add to a node's arguments; `during` acts on the running
    launches (a fault mid-run). A node that has not ended `bound_s` + SLACK_S seconds after the
    start (or after `during`) is powered off and the test fails."""
    port = port or next(_ports)
    processes: dict[str, subprocess.Popen] = {}
    logs: dict[str, Path] = {}
    for host, name, changes in zip(cluster.hosts, NAMES, envs, strict=True):
        if name not in nodes:
            continue
        env = {
            **os.environ,
            "PATH": f"{BIN}:{os.environ['PATH']}",
            "PYTHONPATH": str(project / "src"),
            "OMP_NUM_THREADS": "1",
            "NNODES": "2",
            "NPROC_PER_NODE": "1",
            "RDZV_ENDPOINT": f"{cluster.hosts[0].address}:{port}",
            "RDZV_ID": tmp_path.name,
            "LOCAL_ADDR": host.address,
            "GLOO_SOCKET_IFNAME": host.interface,
            "JOIN_TIMEOUT": str(join_timeout_s),
            "EXIT_TIMEOUT": str(EXIT_TIMEOUT_S),
        }
        for key, value in changes.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value.replace("{port}", str(port))
        files = hosts_files or cluster.hosts_files
        private_dir = (private or {}).get(name)
        command = host.node_command(
            name,
            files[name],
            ["bash", "launch/torchrun.sh", *arguments, *(own_arguments or {}).get(name, [])],
            private_dir,
        )
        logs[name] = tmp_path / f"{name}.log"
        with logs[name].open("w") as output:
            processes[name] = subprocess.Popen(
                command,
                cwd=project,
                env=env,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
    if during is not None:
        during(processes)
    deadline = time.monotonic() + bound_s + SLACK_S
    results = {}
    for name, process in processes.items():
        try:
            code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            text = "\n".join(f"--- {n}:\n{path.read_text()[-3000:]}" for n, path in logs.items())
            pytest.fail(f"node {name} did not end within {bound_s + SLACK_S:.0f} s:\n{text}")
        results[name] = NodeRun(code, logs[name].read_text())
    return results


def assert_statuses(runs: dict[str, NodeRun], expected: dict[str, int]) -> None:
    codes = {name: run.code for name, run in runs.items()}
    everything = "\n".join(f"--- {name}:\n{run.log[-4000:]}" for name, run in runs.items())
    assert codes == expected, everything


def final_checkpoint(run_dir: Path) -> dict:
    newest = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    return json.loads((newest / "COMPLETE").read_text())


def test_two_hosts_train_as_one_job(cluster: Cluster, project: Path, tmp_path: Path) -> None:
    """2 processes on each host meet by c10d rendezvous at alpha and train as 4 gloo ranks over
    the link, writing one shared checkpoint; each node says who joined. The hosts load their
    data alike but for their number of loader workers (beta has no cores to spare)."""
    run_dir = tmp_path / "run"
    two_each = {"NPROC_PER_NODE": "2"}
    runs = run_nodes(
        cluster,
        project,
        tmp_path,
        [f"run.dir={run_dir}", *SHORT_RUN, "train.max_steps=20"],
        envs=(two_each, two_each),
        bound_s=180,
        own_arguments={"beta": ["data.num_workers=0"]},
    )
    assert_statuses(runs, {"alpha": 0, "beta": 0})
    assert "all 2 nodes joined: alpha (10.213.0.1, 2 process(es)), beta" in runs["beta"].log
    assert "4 ranks on 2 host(s): alpha (10.213.0.1): ranks 0-1, cpu" in runs["alpha"].log
    assert "ranks 2-3 on beta load in the training process" in runs["alpha"].log
    marker = final_checkpoint(run_dir)
    assert (marker["step"], marker["world_size"]) == (20, 4)


def test_the_doctor_passes_on_two_healthy_hosts(
    cluster: Cluster, project: Path, tmp_path: Path
) -> None:
    """Two ranks on each host: the pair of hosts is measured between their first ranks while
    the others wait."""
    report = tmp_path / "report.json"
    two_each = {"NPROC_PER_NODE": "2"}
    runs = run_nodes(
        cluster,
        project,
        tmp_path,
        ["--doctor", "--json", str(report), f"run.dir={tmp_path / 'run'}"],
        envs=(two_each, two_each),
        bound_s=120,
    )
    assert_statuses(runs, {"alpha": 0, "beta": 0})
    document = json.loads(report.read_text())
    verdicts = {check["name"]: check["verdict"] for check in document["checks"]}
    assert "FAIL" not in verdicts.values()
    # Not the compute check: both hosts share this machine's cores with the other tests, so
    # one may well multiply slower than the other (a WARN).
    for name in ("agreement", "run directory", "loopback", "busbw gloo", "host pairs"):
        assert verdicts[name] == "PASS", document
    assert [host["host"] for host in document["roster"]] == list(NAMES)
    assert re.search(r"PASS  host pairs +gloo busbw up to 16 MiB: alpha-beta", runs["beta"].log)


def _other_release(project: Path, tmp_path: Path) -> Path:
    """The project's source as another release would have it: version 0.2.0 and another
    dropout default (what a node with a stale checkout or install runs)."""
    source = tmp_path / "other-release"
    shutil.copytree(project / "src", source)
    init = source / PACKAGE / "__init__.py"
    init.write_text(init.read_text().replace('"0.1.0"', '"0.2.0"'))
    task = source / PACKAGE / "task.py"
    text = task.read_text()
    assert text.count("dropout: float = 0.1") == 1, "the default task's settings changed"
    task.write_text(text.replace("dropout: float = 0.1", "dropout: float = 0.2"))
    return source


def test_the_doctor_names_the_settings_and_code_a_node_differs_in(
    cluster: Cluster, project: Path, tmp_path: Path
) -> None:
    other = {"PYTHONPATH": str(_other_release(project, tmp_path))}
    runs = run_nodes(
        cluster,
        project,
        tmp_path,
        ["--doctor", "--json", str(tmp_path / "report.json"), f"run.dir={tmp_path / 'run'}"],
        envs=({}, other),
        bound_s=60,
    )
    assert_statuses(runs, {"alpha": 1, "beta": 1})
    for run in runs.values():
        assert_ends_with_its_status(run.log, 1)
        assert "FAIL  agreement" in run.log
        assert "task.dropout: 0.1 on rank 0 on alpha; 0.2 on rank 1 on beta" in run.log
        assert "package: 0.1.0 on rank 0 on alpha; 0.2.0 on rank 1 on beta" in run.log
        assert "task.py: digest" in run.log


def test_the_doctor_names_a_run_directory_one_node_does_not_share(
    cluster: Cluster, project: Path, tmp_path: Path
) -> None:
    """beta sees its own, empty directory where alpha's run directory is (a node-local disk):
    refused on both nodes after looking for dist.timeout_s, as training refuses it before its
    first step (tests/machinery/test_agreement.py launches that)."""
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    report = tmp_path / "report.json"
    arguments = ["--doctor", "--json", str(report), f"run.dir={runs_dir / 'exp'}", *SHORT_RUN]
    runs = run_nodes(cluster, project, tmp_path, arguments, private={"beta": runs_dir}, bound_s=60)
    assert_statuses(runs, {"alpha": 1, "beta": 1})
    for run in runs.values():
        assert "FAIL  run directory" in run.log
        assert "is not shared: rank 1 on beta does not see the run directory" in run.log
    assert not (runs_dir / "exp" / "checkpoints").exists()


#: Launch faults, each named before anything trains: (the nodes' environments, the nodes
#: launched, alpha's host name on alpha, the statuses, a word each node says).
LAUNCH_FAULTS = {
    "loopback-endpoint": (
        ({"RDZV_ENDPOINT": "127.0.0.1:{port}"}, {"RDZV_ENDPOINT": "127.0.0.1:{port}"}),
        NAMES,
        None,
        {"alpha": 2, "beta": 2},
        {"alpha": "is a loopback address here", "beta": "is a loopback address here"},
    ),
    "unresolvable-endpoint": (
        ({"RDZV_ENDPOINT": "nowhere.invalid:{port}"}, {"RDZV_ENDPOINT": "nowhere.invalid:{port}"}),
        NAMES,
        None,
        {"alpha": 2, "beta": 2},
        {"alpha": "does not resolve on alpha", "beta": "does not resolve on beta"},
    ),
    "missing-interface": (
        ({}, {"GLOO_SOCKET_IFNAME": "eth9"}),
        NAMES,
        None,
        {"alpha": 1, "beta": 2},
        {"alpha": "still missing 1 of 2 nodes", "beta": "has no interface named 'eth9'"},
    ),
    "host-name-resolving-to-loopback": (
        ({"LOCAL_ADDR": None}, {}),
        NAMES,
        "127.0.1.1",
        {"alpha": 2, "beta": 1},
        {"alpha": "resolves to 127.0.1.1 on alpha", "beta": "cannot reach the rendezvous"},
    ),
    "nnodes-differ": (
        ({}, {"NNODES": "3"}),
        NAMES,
        None,
        {"alpha": 2, "beta": 2},
        {"alpha": "beta has NNODES=3", "beta": "beta has NNODES=3"},
    ),
    "node-never-starts": (
        ({}, {}),
        ("alpha",),
        None,
        {"alpha": 1},
        {"alpha": "still missing 1 of 2 nodes"},
    ),
}


@pytest.mark.parametrize("fault", LAUNCH_FAULTS)
def test_a_launch_fault_ends_every_node_naming_its_cause(
    cluster: Cluster, project: Path, tmp_path: Path, fault: str
) -> None:
    """Before torchrun starts, with --doctor as without (the same launcher checks both): at
    once where a node can tell, after JOIN_TIMEOUT where it waits for another."""
    envs, nodes, alpha_address, statuses, words = LAUNCH_FAULTS[fault]
    files = dict(cluster.hosts_files)
    if alpha_address:
        files["alpha"] = tmp_path / "hosts.alpha"
        files["alpha"].write_text(f"127.0.0.1 localhost\n{alpha_address} alpha\n")
    arguments = ["--doctor", "--json", str(tmp_path / "report.json"), f"run.dir={tmp_path}/run"]
    runs = run_nodes(
        cluster,
        project,
        tmp_path,
        arguments,
        envs=envs,
        nodes=nodes,
        hosts_files=files,
        join_timeout_s=JOIN_TIMEOUT_S,
    )
    assert_statuses(runs, statuses)
    for name, word in words.items():
        assert word in runs[name].log, runs[name].log[-3000:]


@pytest.mark.parametrize("port_state", ["dropped", "taken"])
def test_a_blocked_or_taken_rendezvous_port_ends_both_nodes(
    cluster: Cluster, project: Path, tmp_path: Path, port_state: str
) -> None:
    """A firewall on alpha drops the rendezvous port: beta never gets an answer, alpha never
    sees beta, and both stop after JOIN_TIMEOUT saying so. Or another program listens there:
    alpha cannot take the port (exit 2), and beta, connected to that program, hears nothing."""
    alpha, port = cluster.hosts[0], next(_ports)
    holder = None
    if port_state == "dropped":
        alpha.drop_port(port)
    else:
        listen = f"import socket, time; s = socket.create_server(('', {port})); time.sleep(300)"
        holder = subprocess.Popen([*alpha.prefix, sys.executable, "-c", listen])
        wait_until(lambda: _listening(alpha, port), 30, f"a program on port {port}")
    try:
        runs = run_nodes(
            cluster,
            project,
            tmp_path,
            [f"run.dir={tmp_path}/run"],
            port=port,
            join_timeout_s=JOIN_TIMEOUT_S,
        )
    finally:
        alpha.open_ports()
        if holder is not None:
            holder.kill()
            holder.wait()
    if port_state == "dropped":
        assert_statuses(runs, {"alpha": 1, "beta": 1})
        assert "still missing 1 of 2 nodes" in runs["alpha"].log
        assert "no answer: a firewall may be dropping port" in runs["beta"].log
    else:
        assert_statuses(runs, {"alpha": 2, "beta": 1})
        assert f"cannot listen on port {port} of alpha" in runs["alpha"].log
        assert "gave no word" in runs["beta"].log


def _listening(host: Host, port: int) -> bool:
    probe = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1)"
    return subprocess.run([*host.prefix, sys.executable, "-c", probe]).returncode == 0


def _launcher_of(host: Host) -> int:
    """The pid (as this machine numbers it) of the launch process on `host`."""
    found = subprocess.run(
        ["pgrep", "-f", f"{PACKAGE}.launch .*--local-addr={host.address} "],
        capture_output=True,
        text=True,
    )
    return int(found.stdout.split()[0])


def test_a_cut_link_ends_every_node_within_the_timeout_naming_the_host_lost(
    cluster: Cluster, project: Path, tmp_path: Path
) -> None:
    """beta's link goes down mid-run, without a reset, between two saves. Each node's training
    fails in its next collective after dist.timeout_s and names the other host; beta's
    torchrun, waiting on the rendezvous store at alpha, is ended EXIT_TIMEOUT after its worker.
    (A cut during a save waits for the save's own bound: docs/faults.md.)"""
    beta = cluster.hosts[1]

    def cut(processes: dict[str, subprocess.Popen]) -> None:
        log = tmp_path / "alpha.log"
        wait_until(lambda: "step 100/" in log.read_text(), 120, "100 steps")
        beta.link(up=False)

    try:
        runs = run_nodes(
            cluster,
            project,
            tmp_path,
            [
                f"run.dir={tmp_path / 'run'}",
                *LONG_RUN,
                "train.log_every=100",
                "checkpoint.every_steps=100000",
            ],
            during=cut,
            bound_s=TIMEOUT_S + 60,
        )
    finally:
        beta.link(up=True)
    assert_statuses(runs, {"alpha": 1, "beta": 1})
    assert "rank 1 on beta did not answer" in runs["alpha"].log
    assert "this host lost contact with alpha" in runs["beta"].log
    assert "after its last worker ended" in runs["beta"].log


def test_sigterm_to_one_node_stops_both_with_a_checkpoint_and_status_75(
    cluster: Cluster, project: Path, tmp_path: Path
) -> None:
    """A stop sent to alpha alone (its launcher): every rank agrees on the step, saves there,
    and both nodes' launchers exit 75 where torchrun says 1."""
    run_dir = tmp_path / "run"

    def stop_alpha(processes: dict[str, subprocess.Popen]) -> None:
        checkpoints = run_dir / "checkpoints"
        wait_until(lambda: any(checkpoints.glob("step_*/COMPLETE")), 120, "a first checkpoint")
        os.kill(_launcher_of(cluster.hosts[0]), signal.SIGTERM)

    runs = run_nodes(
        cluster, project, tmp_path, [f"run.dir={run_dir}", *LONG_RUN], during=stop_alpha
    )
    assert_statuses(runs, {"alpha": 75, "beta": 75})
    stopped = re.search(r"stopped at step (\d+) of \d+ on SIGTERM", runs["alpha"].log)
    assert stopped, runs["alpha"].log[-3000:]
    marker = final_checkpoint(run_dir)
    assert (marker["step"], marker["world_size"]) == (int(stopped.group(1)), 2)
    assert_ends_with_the_training_s_message(runs["alpha"].log, "launch the same command", 75)
    assert_ends_with_its_status(runs["beta"].log, 75)
