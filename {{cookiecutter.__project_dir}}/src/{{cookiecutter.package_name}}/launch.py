"""torchrun, supervised: checks before it starts, the nodes' meeting, and the training's status.

`python -m <package>.launch [torchrun options] -m <package>.train [overrides]` runs torchrun
(`python -m torch.distributed.run`, with this Python) with those options, given as
`--name=value`, as launch/torchrun.sh and the Slurm script do. torchrun alone leaves the
multi-node failures silent: a rendezvous endpoint that is a loopback address, a host name that
resolves to 127.0.1.1, a blocked port, a node that never starts or was given another NNODES
each leave the nodes waiting for minutes with no word; a node whose rendezvous store died
blocks torchrun for a quarter of an hour after its workers have ended, deaf to SIGTERM; and
torchrun exits 1 whatever its workers did. Here:

- Before torchrun starts (milliseconds): the endpoint resolves, and not to a loopback address
  when there are several nodes; the address this node advertises (LOCAL_ADDR, else its host
  name) is one of its own and not a loopback address; the interfaces that GLOO_SOCKET_IFNAME
  and NCCL_SOCKET_IFNAME name exist. Each failure says what to set; exit status 2.
- The nodes meet first (a fixed NNODES): the node whose address is the endpoint's listens on
  its port, the others connect. Every 10 s each node prints who has joined and who is
  missing; a node given another NNODES or RDZV_ID is refused (exit 2) on every node at once;
  after JOIN_TIMEOUT seconds the nodes stop (exit 1), saying which joined. The port is then
  torchrun's, which finds every node there. Elastic ranges (NNODES=MIN:MAX) skip the meeting.
- While torchrun runs, SIGTERM, SIGUSR1 and SIGUSR2 are passed on to it. SIGINT and SIGHUP
  are not: a terminal sends them to its whole foreground process group, torchrun included,
  and torchrun signalled twice turns the second into SIGTERM. In a Slurm step nothing is
  passed on: Slurm signals every process of the step itself.
- torchrun ends within EXIT_TIMEOUT seconds of its last worker (plus JOIN_TIMEOUT while it may
  still restart them), or within SHUTDOWN_TIMEOUT + EXIT_TIMEOUT of a stop signal; otherwise
  it is killed, saying so.
- The exit status is the training's on this node: each worker records its own
  (`exit_status_recorded`), and the most telling is passed on (a named cause, 2, 3 or 4, before
  any other failure, before 130, 75 and 0). torchrun's own status is used only when no worker
  recorded one.
- The last lines on the screen are the training's: torchrun runs as cluster/agent.py, which
  keeps what torchrun itself writes (its log, its 30-line report of a failure or a signal) in a
  file, while the workers write to the screen as before. When the training did not finish, one
  line ends the launch: its exit status, what it means, torchrun's report in a few words, and
  where all of it is kept (`<run.dir>/torchrun_<host>.log`, once the training has its run
  directory).

Only the standard library: the checks run before anything imports torch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from .cluster import network
from .dependencies import require_installed

#: The variable that tells a training process where to record its exit status.
STATUS_DIR_VARIABLE = "TRAINING_STATUS_DIR"
#: Exit statuses that name their cause, each documented: a bad setting, a diverged training,
#: a run directory held by another job.
NAMED_STATUSES = (2, 3, 4)
EXIT_RESUMABLE = 75
EXIT_INTERRUPTED = 130
#: What an exit status of the training (or the doctor) says, in the launcher's last line.
STATUS_MEANINGS = {
    1: "it failed (its traceback above says where)",
    2: "a setting, the launch or the environment was refused (the message above says which)",
    3: "the training diverged",
    4: "another job holds the run directory",
    EXIT_RESUMABLE: "stopped with a checkpoint at its current step: the same command continues",
    EXIT_INTERRUPTED: "interrupted twice: stopped without a checkpoint of its current step",
}
#: Files of the status directory: torchrun's own output (cluster/agent.py), and the run
#: directory the training recorded once its job owned it.
TORCHRUN_REPORT = "torchrun.log"
RUN_DIR_RECORD = "run_dir"
#: A failed rank in torchrun's report (ChildFailedError): its rank and exit code.
FAILED_RANK = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
#: Seconds between two progress lines while nodes wait for each other.
PROGRESS_S = 10.0
DEFAULT_JOIN_TIMEOUT_S = 300
DEFAULT_EXIT_TIMEOUT_S = 30
_POLL_S = 0.5


class LaunchRefused(Exception):
    """The launch cannot go on as set up: `status` is the exit status, the message says why."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


def say(message: str) -> None:
    print(f"launch: {message}", file=sys.stderr, flush=True)


# --- the training's side: its exit status ------------------------------------------------------


def exit_status_recorded(main: Callable[[], int]) -> int:
    """Run the training's `main` and record its exit status for the launcher (a file in
    $TRAINING_STATUS_DIR, named by torchrun's restart count and the local rank), also when it
    raises: torchrun reports 1 whatever its workers did."""
    status = 1
    try:
        status = main()
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else 1
        raise
    finally:
        record_exit_status(status)
    return status


def record_exit_status(status: int, environ: dict[str, str] | None = None) -> None:
    environ = os.environ if environ is None else environ
    directory = environ.get(STATUS_DIR_VARIABLE)
    if not directory:
        return
    attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    name = f"{attempt}.{environ.get('LOCAL_RANK', '0')}"
    with contextlib.suppress(OSError):  # the launcher falls back to torchrun's status
        partial = Path(directory) / f".{name}.tmp"
        partial.write_text(f"{status}\n")
        partial.replace(Path(directory) / name)


def record_run_dir(path: Path, environ: dict[str, str] | None = None) -> None:
    """Tell the launcher where the run keeps its logs, once the job owns that directory: the
    launcher keeps torchrun's report there."""
    environ = os.environ if environ is None else environ
    directory = environ.get(STATUS_DIR_VARIABLE)
    if not directory or environ.get("LOCAL_RANK", "0") != "0":
        return
    with contextlib.suppress(OSError):
        partial = Path(directory) / f".{RUN_DIR_RECORD}.tmp"
        partial.write_text(str(path.resolve()))
        partial.replace(Path(directory) / RUN_DIR_RECORD)


def recorded_statuses(directory: Path) -> list[int]:
    """The statuses of the last attempt's workers on this node, in the order they ended."""
    found: list[tuple[int, float, int]] = []
    for path in directory.iterdir():
        attempt, _, local_rank = path.name.partition(".")
        if attempt.isdigit() and local_rank.isdigit():
            with contextlib.suppress(OSError, ValueError):
                found.append((int(attempt), path.stat().st_mtime, int(path.read_text())))
    if not found:
        return []
    last = max(attempt for attempt, _, _ in found)
    return [status for attempt, _, status in sorted(found) if attempt == last]


def most_telling(statuses: list[int]) -> int | None:
    """The status that says most about how the training ended on this node: a named cause
    (2, 3, 4), then any other failure, then 130, 75 and 0; the earliest of a kind."""
    tiers: list[Callable[[int], bool]] = [
        lambda status: status in NAMED_STATUSES,
        lambda status: status not in (0, EXIT_RESUMABLE, EXIT_INTERRUPTED),
        lambda status: status == EXIT_INTERRUPTED,
        lambda status: status == EXIT_RESUMABLE,
        lambda status: True,
    ]
    for tier in tiers:
        chosen = [status for status in statuses if tier(status)]
        if chosen:
            return chosen[0]
    return None


# --- before torchrun: the launch's settings --------------------------------------------------


@dataclass(frozen=True)
class Launch:
    """What this node was asked to run: torchrun's options that the checks read."""

    nnodes: str
    nproc_per_node: str
    endpoint: str
    rdzv_id: str
    local_addr: str
    max_restarts: int
    standalone: bool

    @property
    def multi_node(self) -> bool:
        return not self.standalone and self.nnodes != "1"

    @property
    def elastic(self) -> bool:
        return ":" in self.nnodes


def parse_launch(options: list[str]) -> Launch:
    """torchrun's options (`--name=value`, before the program to run) that matter here."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for name, default in (
        ("nnodes", "1"),
        ("nproc-per-node", "1"),
        ("rdzv-endpoint", ""),
        ("rdzv-id", "none"),
        ("local-addr", ""),
        ("max-restarts", "0"),
    ):
        parser.add_argument(f"--{name}", f"--{name.replace('-', '_')}", default=default)
    parser.add_argument("--standalone", action="store_true")
    known, _ = parser.parse_known_args(options)
    return Launch(
        nnodes=known.nnodes,
        nproc_per_node=known.nproc_per_node,
        endpoint=known.rdzv_endpoint,
        rdzv_id=known.rdzv_id,
        local_addr=known.local_addr,
        max_restarts=int(known.max_restarts),
        standalone=known.standalone,
    )


def check_launch(launch: Launch, environ: dict[str, str] | None = None) -> bool:
    """Refuse (LaunchRefused, status 2) what would leave the nodes waiting; return whether
    this node hosts the rendezvous."""
    environ = os.environ if environ is None else environ
    problems = network.interface_problems(environ)
    if problems:
        raise LaunchRefused("\n".join(problems))
    if not launch.multi_node:
        return True
    try:
        host, _ = network.split_endpoint(launch.endpoint)
    except ValueError as error:
        raise LaunchRefused(f"RDZV_ENDPOINT: {error}") from None
    here = socket.gethostname()
    try:
        endpoint_addresses = network.resolve(host)
    except OSError as error:
        raise LaunchRefused(
            f"the rendezvous endpoint {launch.endpoint} does not resolve on {here} ({error}): "
            "give every node a host name they all resolve, or the rendezvous node's address "
            "(RDZV_ENDPOINT=10.0.0.1:29500)"
        ) from None
    advertised = _advertised_addresses(launch, here)
    named_host = bool(launch.local_addr) and (
        launch.local_addr == host or bool(set(advertised) & set(endpoint_addresses))
    )
    if all(network.is_loopback(address) for address in endpoint_addresses) and not named_host:
        raise LaunchRefused(
            f"RDZV_ENDPOINT={launch.endpoint} is a loopback address here ({host} resolves to "
            f"{', '.join(endpoint_addresses)} on {here}): with NNODES={launch.nnodes} the other "
            "nodes cannot reach it, and this one would meet only itself. Use the address (or "
            "a name that resolves to it everywhere) of the rendezvous node on the network the "
            "nodes share, e.g. RDZV_ENDPOINT=10.0.0.1:29500, and set LOCAL_ADDR to it there. "
            f"This machine's interfaces: {network.describe_interfaces()}"
        )
    return named_host or any(
        not network.is_loopback(address) and network.is_local(address)
        for address in endpoint_addresses
    )


def _advertised_addresses(launch: Launch, here: str) -> list[str]:
    """The addresses the other nodes reach this one at: LOCAL_ADDR's, else the host name's."""
    name = launch.local_addr or socket.getfqdn()
    what = f"LOCAL_ADDR={launch.local_addr}" if launch.local_addr else f"this host's name {name}"
    fix = (
        "set LOCAL_ADDR to this machine's address on the network the nodes share "
        f"(its interfaces: {network.describe_interfaces()})"
    )
    try:
        addresses = network.resolve(name)
    except OSError as error:
        raise LaunchRefused(f"{what} does not resolve on {here} ({error}): {fix}") from None
    if all(network.is_loopback(address) for address in addresses):
        raise LaunchRefused(
            f"{what} resolves to {', '.join(addresses)} on {here}, a loopback address: the "
            f"other nodes would be sent there and reach themselves. {fix[0].upper()}{fix[1:]}"
        )
    if launch.local_addr and not any(network.is_local(address) for address in addresses):
        raise LaunchRefused(
            f"{what} ({', '.join(addresses)}) is not an address of this machine ({here}): {fix}"
        )
    return addresses


# --- the nodes meet ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    """A node as it introduces itself at the meeting."""

    host: str
    address: str
    nnodes: str
    nproc_per_node: str
    rdzv_id: str

    def describe(self) -> str:
        return f"{self.host} ({self.address}, {self.nproc_per_node} process(es))"


def meet(launch: Launch, is_host: bool, join_timeout_s: float, expected: list[str]) -> list[Node]:
    """Every node of a fixed NNODES joins before torchrun starts; returns them, host first.

    Raises LaunchRefused: status 2 for a setting (another NNODES or RDZV_ID, a port in use),
    1 when the nodes did not all join within `join_timeout_s`.
    """
    host, port = network.split_endpoint(launch.endpoint)
    me = Node(
        host=socket.gethostname(),
        address=launch.local_addr or _first_address(socket.getfqdn()),
        nnodes=launch.nnodes,
        nproc_per_node=launch.nproc_per_node,
        rdzv_id=launch.rdzv_id,
    )
    if is_host:
        return _host_meeting(me, port, int(launch.nnodes), join_timeout_s, expected)
    return _join_meeting(me, host, port, join_timeout_s)


def _first_address(name: str) -> str:
    with contextlib.suppress(OSError):
        return network.resolve(name)[0]
    return name


def _host_meeting(
    me: Node, port: int, nnodes: int, timeout_s: float, expected: list[str]
) -> list[Node]:
    try:
        server = socket.create_server(("", port), reuse_port=False)
    except OSError as error:
        raise LaunchRefused(
            f"cannot listen on port {port} of {me.host} for the rendezvous "
            f"({os.strerror(error.errno) if error.errno else error}): "
            "another program (or an earlier run still ending) holds it. Choose another port "
            "in RDZV_ENDPOINT on every node, or end that program."
        ) from None
    selector = selectors.DefaultSelector()
    selector.register(server, selectors.EVENT_READ)
    joined: dict[socket.socket, Node] = {}
    buffers: dict[socket.socket, bytes] = {}
    deadline = time.monotonic() + timeout_s
    next_progress = time.monotonic() + PROGRESS_S
    try:
        while len(joined) + 1 < nnodes:
            now = time.monotonic()
            if now >= deadline:
                message = _missing_message(me, list(joined.values()), nnodes, timeout_s, expected)
                _tell(joined, {"refused": message, "status": 1})
                raise LaunchRefused(message, status=1)
            if now >= next_progress:
                waiting = _waiting_message(me, list(joined.values()), nnodes, expected)
                say(waiting)
                _tell(joined, {"waiting": waiting})
                next_progress = now + PROGRESS_S
            for key, _ in selector.select(timeout=min(_POLL_S, deadline - now)):
                if key.fileobj is server:
                    connection, _ = server.accept()
                    connection.setblocking(False)
                    selector.register(connection, selectors.EVENT_READ)
                    buffers[connection] = b""
                    continue
                connection = key.fileobj
                data = connection.recv(4096)
                if not data:  # gone before it introduced itself, or after
                    selector.unregister(connection)
                    joined.pop(connection, None)
                    buffers.pop(connection, None)
                    connection.close()
                    continue
                buffers[connection] += data
                if b"\n" in buffers[connection] and connection not in joined:
                    node = _read_hello(buffers[connection])
                    joined[connection] = node
                    _refuse_if_unlike(me, node, joined)
        nodes = [me, *joined.values()]
        _tell(joined, {"nodes": [asdict(node) for node in nodes]})
        _wait_for_goodbyes(list(joined))
        return nodes
    finally:
        for connection in list(buffers):
            connection.close()
        selector.close()
        server.close()


def _read_hello(data: bytes) -> Node:
    line = data.split(b"\n", 1)[0]
    try:
        return Node(**json.loads(line)["hello"])
    except (ValueError, KeyError, TypeError):
        return Node("an unknown program", "?", "?", "?", "?")


def _refuse_if_unlike(me: Node, node: Node, joined: dict[socket.socket, Node]) -> None:
    """A node of another run, or given another NNODES, stops every node now (status 2)."""
    if node.rdzv_id != me.rdzv_id:
        problem = (
            f"{node.describe()} joined with RDZV_ID={node.rdzv_id}, and {me.host} hosts "
            f"RDZV_ID={me.rdzv_id}: two runs share one endpoint. Give every node of a run the "
            "same RDZV_ID, and each run its own endpoint or RDZV_ID."
        )
    elif node.nnodes != me.nnodes:
        problem = (
            f"the nodes were given different NNODES: {me.host} (the rendezvous host) has "
            f"NNODES={me.nnodes}, {node.host} has NNODES={node.nnodes}. Launch every node with "
            "the same NNODES."
        )
    else:
        return
    _tell(joined, {"refused": problem, "status": 2})
    raise LaunchRefused(problem)


def _waiting_message(me: Node, others: list[Node], nnodes: int, expected: list[str]) -> str:
    present = [me, *others]
    missing = [name for name in expected if name not in {node.host for node in present}]
    also = f": {', '.join(missing)}" if missing else ""
    return (
        f"waiting for {nnodes - len(present)} of {nnodes} nodes{also} at the rendezvous on "
        f"{me.host}; joined: {', '.join(node.describe() for node in present)}"
    )


def _missing_message(
    me: Node, others: list[Node], nnodes: int, timeout_s: float, expected: list[str]
) -> str:
    return (
        f"{_waiting_message(me, others, nnodes, expected).replace('waiting for', 'still missing')}"
        f" after JOIN_TIMEOUT={timeout_s:.0f} s. Start launch/torchrun.sh on every node with "
        f"NNODES={me.nnodes} and the same RDZV_ENDPOINT; a node that is running but not "
        "listed cannot reach this one: check that the port is open between them (the "
        "launching guide lists the ports) and that RDZV_ENDPOINT resolves there."
    )


def _tell(joined: dict[socket.socket, Node], message: dict) -> None:
    line = (json.dumps(message) + "\n").encode()
    for connection in joined:
        with contextlib.suppress(OSError):
            connection.setblocking(True)
            connection.settimeout(2)
            connection.sendall(line)
            connection.setblocking(False)


def _wait_for_goodbyes(connections: list[socket.socket], wait_s: float = 5.0) -> None:
    """The joined nodes close first, so that the port is free for torchrun at once here."""
    deadline = time.monotonic() + wait_s
    for connection in connections:
        connection.setblocking(True)
        with contextlib.suppress(OSError):
            connection.settimeout(max(0.1, deadline - time.monotonic()))
            while connection.recv(4096):
                pass


def _join_meeting(me: Node, host: str, port: int, timeout_s: float) -> list[Node]:
    deadline = time.monotonic() + timeout_s
    margin = min(PROGRESS_S, timeout_s)
    next_progress = time.monotonic() + PROGRESS_S
    connection = None
    while connection is None:
        try:
            wait_s = min(5.0, max(0.5, deadline - time.monotonic()))
            connection = socket.create_connection((host, port), timeout=wait_s)
        except OSError as error:
            reason = _connect_failure(error, host, port)
            now = time.monotonic()
            if now >= deadline:
                raise LaunchRefused(
                    f"cannot reach the rendezvous at {host}:{port} from {me.host} within "
                    f"JOIN_TIMEOUT={timeout_s:.0f} s: {reason}. Check from {me.host}: "
                    f"nc -z {host} {port}",
                    status=1,
                ) from None
            if now >= next_progress:
                say(f"waiting to reach the rendezvous at {host}:{port}: {reason}")
                next_progress = now + PROGRESS_S
            time.sleep(min(1.0, max(0.0, deadline - now)))
    with connection:
        connection.sendall((json.dumps({"hello": asdict(me)}) + "\n").encode())
        received = b""
        heard = time.monotonic()
        while True:
            now = time.monotonic()
            # The host gives its verdict by its own deadline, which a node started at about
            # the same time reaches soon after its own; it says something every PROGRESS_S
            # meanwhile. Silence beyond both is not a rendezvous of this project.
            if now >= deadline + margin or now - heard > 2 * PROGRESS_S:
                raise LaunchRefused(
                    f"{host}:{port} accepted {me.host} but gave no word for "
                    f"{now - heard:.0f} s: the rendezvous node stopped, or another program "
                    "holds that port (choose another port in RDZV_ENDPOINT)",
                    status=1,
                )
            if b"\n" not in received:
                connection.settimeout(min(PROGRESS_S, deadline + margin - now))
                try:
                    data = connection.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    raise LaunchRefused(
                        f"{host}:{port} accepted {me.host}, then closed: the rendezvous node "
                        "stopped, or another program holds that port",
                        status=1,
                    )
                received += data
                heard = time.monotonic()
                continue
            line, received = received.split(b"\n", 1)
            try:
                message = json.loads(line)
            except ValueError:
                raise LaunchRefused(
                    f"{host}:{port} answered, but not as a rendezvous of this project: another "
                    "program holds that port. Choose another port in RDZV_ENDPOINT."
                ) from None
            if "waiting" in message:
                say(message["waiting"])
            elif "refused" in message:
                raise LaunchRefused(message["refused"], status=message.get("status", 2))
            elif "nodes" in message:
                return [Node(**node) for node in message["nodes"]]


def _connect_failure(error: OSError, host: str, port: int) -> str:
    if isinstance(error, ConnectionRefusedError):
        return (
            "connection refused: nothing listens there yet (start the node whose address "
            f"{host} is), or the port is wrong"
        )
    if isinstance(error, TimeoutError):
        return f"no answer: a firewall may be dropping port {port}, or {host} is down"
    return str(error.strerror or error)


# --- torchrun, supervised ---------------------------------------------------------------------


def run(arguments: list[str], environ: dict[str, str] | None = None) -> int:
    """Check, meet, then run torchrun with `arguments`; return the training's exit status."""
    environ = dict(os.environ if environ is None else environ)
    split = next((i for i, arg in enumerate(arguments) if not arg.startswith("--")), None)
    options = arguments if split is None else arguments[:split]
    launch = parse_launch(options)
    join_timeout_s = float(environ.get("JOIN_TIMEOUT", DEFAULT_JOIN_TIMEOUT_S))
    exit_timeout_s = float(environ.get("EXIT_TIMEOUT", DEFAULT_EXIT_TIMEOUT_S))
    shutdown_timeout_s = float(environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
    try:
        is_host = check_launch(launch, environ)
        if launch.multi_node:
            if launch.elastic:
                say(
                    f"NNODES={launch.nnodes} is elastic: the nodes meet in torchrun's "
                    f"rendezvous directly (its join timeout: JOIN_TIMEOUT={join_timeout_s:.0f} s)"
                )
            else:
                expected = environ.get("EXPECTED_NODES", "").split()
                nodes = meet(launch, is_host, join_timeout_s, expected)
                say(f"all {len(nodes)} nodes joined: {', '.join(n.describe() for n in nodes)}")
            arguments = _with_host_role(arguments, is_host)
    except LaunchRefused as refusal:
        say(f"error: {refusal}")
        return refusal.status
    with tempfile.TemporaryDirectory(prefix="training-status-") as status_dir:
        environ[STATUS_DIR_VARIABLE] = status_dir
        report = Path(status_dir) / TORCHRUN_REPORT
        status = _supervise(
            [sys.executable, "-m", f"{__package__}.cluster.agent", str(report), *arguments],
            environ,
            launch,
            Path(status_dir),
            exit_timeout_s,
            join_timeout_s,
            shutdown_timeout_s,
        )
        host = socket.gethostname()
        report_text = report.read_text() if report.exists() else ""
        kept = keep_report(report_text, Path(status_dir), host)
        if status != 0:
            say(conclusion(status, report_text, kept, host))
        return status


def _with_host_role(arguments: list[str], is_host: bool) -> list[str]:
    """torchrun's is_host as the checks found it (unless given): torchrun guesses it from the
    host name, and a name that resolves to 127.0.1.1 makes every node a client."""
    role = f"is_host={str(is_host).lower()}"
    for index, argument in enumerate(arguments):
        if argument.startswith("--rdzv-conf=") or argument.startswith("--rdzv_conf="):
            if "is_host=" in argument:
                return arguments
            return [*arguments[:index], f"{argument},{role}", *arguments[index + 1 :]]
        if not argument.startswith("--"):
            return [*arguments[:index], f"--rdzv-conf={role}", *arguments[index:]]
    return [*arguments, f"--rdzv-conf={role}"]


def _supervise(
    command: list[str],
    environ: dict[str, str],
    launch: Launch,
    status_dir: Path,
    exit_timeout_s: float,
    join_timeout_s: float,
    shutdown_timeout_s: float,
) -> int:
    in_slurm_step = "SLURM_STEP_ID" in environ
    received: list[int] = []
    stop_signalled_at: list[float] = []

    def ignore_requests_until_exec() -> None:
        # torchrun sets its own handlers for USR1 and USR2, which would end it until then;
        # SIGINT and SIGQUIT as a terminal delivers them.
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    torchrun = subprocess.Popen(command, env=environ, preexec_fn=ignore_requests_until_exec)

    def pass_on(signum: int, frame: object) -> None:
        received.append(signum)
        stop_signalled_at.append(time.monotonic())
        if not in_slurm_step and signum not in (signal.SIGINT, signal.SIGHUP):
            with contextlib.suppress(ProcessLookupError):
                os.kill(torchrun.pid, signum)

    stop_signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
    for signum in stop_signals:
        signal.signal(signum, pass_on)
    watch = _WorkerWatch(torchrun.pid, status_dir, _local_workers(launch))
    code: int | None = None
    while code is None:
        try:
            code = torchrun.wait(timeout=_POLL_S)
        except subprocess.TimeoutExpired:
            pass
        else:
            break
        gone_s = watch.workers_gone_s()
        restarts_left = launch.max_restarts - max(0, watch.generations - 1)
        allowed_s = exit_timeout_s + (join_timeout_s if restarts_left > 0 else 0)
        stopping_s = time.monotonic() - stop_signalled_at[0] if stop_signalled_at else 0.0
        if gone_s > allowed_s or stopping_s > shutdown_timeout_s + exit_timeout_s:
            why = (
                f"{gone_s:.0f} s after its last worker ended"
                if gone_s > allowed_s
                else f"{stopping_s:.0f} s after a stop signal"
            )
            say(
                f"torchrun had not exited {why} (it waits for its rendezvous store, on a node "
                "that is gone or cut off): ending it"
            )
            torchrun.kill()
            torchrun.wait()
            code = 1
    for signum in stop_signals:
        signal.signal(signum, signal.SIG_DFL)
    status = most_telling(recorded_statuses(status_dir))
    if status is None:
        status = _status_after_signal(code, received)
    return status


def _status_after_signal(code: int, received: list[int]) -> int:
    """torchrun exits 1 after a signal whatever its workers did: without their own record,
    the status a stop on that signal has (75 after TERM, INT or HUP, 0 after USR1 or USR2)."""
    if code != 1 or not received:
        return code
    if any(signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP) for signum in received):
        return EXIT_RESUMABLE
    return 0


class _WorkerWatch:
    """torchrun's worker processes (its children), followed across restarts."""

    def __init__(self, pid: int, status_dir: Path, workers: int) -> None:
        self.pid, self.status_dir, self.workers = pid, status_dir, workers
        self.generations = 0
        self._alive = False
        self._gone_since: float | None = None

    def workers_gone_s(self) -> float:
        """Seconds since the last worker ended (0 while some run, or before the first); a
        worker that ended before it was ever seen counts by its recorded status."""
        children = _children(self.pid)
        now = time.monotonic()
        if children:
            if not self._alive:
                self.generations += 1
            self._alive, self._gone_since = True, None
            return 0.0
        if self._alive or (self._gone_since is None and self._all_recorded()):
            self._alive, self._gone_since = False, now
            self.generations = max(self.generations, 1)
        return 0.0 if self._gone_since is None else now - self._gone_since

    def _all_recorded(self) -> bool:
        return len(recorded_statuses(self.status_dir)) >= self.workers


def _local_workers(launch: Launch) -> int:
    """The workers torchrun starts here (`gpu`, `auto`: at least one)."""
    return int(launch.nproc_per_node) if launch.nproc_per_node.isdigit() else 1


def _children(pid: int) -> set[int]:
    """The pids of `pid`'s living child processes (Linux /proc): an ended worker stays a zombie
    until torchrun reaps it, which a torchrun blocked on its store does not."""
    found: set[int] = set()
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                found.update(int(child) for child in (task / "children").read_text().split())
    return {child for child in found if not _is_zombie(child)}


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # gone
    return stat[stat.rindex(")") + 2 :].startswith(("Z", "X"))


# --- after torchrun: the launch's last line ---------------------------------------------------


def conclusion(status: int, report: str, kept: str | None, host: str) -> str:
    """The line that ends a launch whose training did not finish: the training's exit status
    and what it means, torchrun's `report` in a few words, and where it is `kept`."""
    line = f"exit status {status} on {host}: {STATUS_MEANINGS.get(status, 'it failed')}"
    if not report.strip():
        return line
    where = f"; all of it in {kept}" if kept else ""
    return f"{line} (torchrun: {report_gist(report)}{where})"


def report_gist(report: str) -> str:
    """torchrun's report in a few words: how each failed rank ended, the signal that stopped
    torchrun, or the last line of another error."""
    failures = FAILED_RANK.findall(report)
    if failures:
        ranks = sorted({int(rank): int(code) for rank, code in failures}.items())
        return ", ".join(f"rank {rank} exited {_code(code)}" for rank, code in ranks)
    stopped = re.search(r"SignalException: Process \d+ got signal: (\d+)", report)
    if stopped:
        return f"stopped on {signal.Signals(int(stopped.group(1))).name}"
    return [line.strip() for line in report.splitlines() if line.strip()][-1]


def _code(code: int) -> str:
    """An exit code as torchrun gives it: negative for the signal that ended the process."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"{code} ({signal.Signals(-code).name})"
    return str(code)


def keep_report(report: str, status_dir: Path, host: str) -> str | None:
    """Append torchrun's report to `torchrun_<host>.log` in the directory the training
    recorded; its path, or None where there is no report, no such directory (the training
    stopped before its job owned one) or it cannot be written."""
    record = status_dir / RUN_DIR_RECORD
    if not report or not record.exists():
        return None
    path = Path(record.read_text()) / f"torchrun_{host}.log"
    try:
        with path.open("a") as kept:
            kept.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}: torchrun's own output\n")
            kept.write(report)
    except OSError:
        return None
    relative = os.path.relpath(path)
    return str(path) if relative.startswith("..") else relative


def main(argv: list[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    if not arguments or arguments[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if arguments else 2
    require_installed()
    return run(arguments)


if __name__ == "__main__":
    sys.exit(main())
