"""The launcher's side (launch.py): the checks before torchrun, the nodes' meeting, and the
training's exit status passed on. Real sockets on this machine stand in for the nodes; the
two-host runs are the template's launcher tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from {{ cookiecutter.package_name }} import launch
from {{ cookiecutter.package_name }}.cluster import network
from {{ cookiecutter.package_name }}.launch import Launch, LaunchRefused

pytestmark = pytest.mark.standalone


def _launch(**changes: Any) -> Launch:
    settings = {
        "nnodes": "2",
        "nproc_per_node": "1",
        "endpoint": "node01:29500",
        "rdzv_id": "exp1",
        "local_addr": "",
        "max_restarts": 0,
        "standalone": False,
    }
    return Launch(**{**settings, **changes})


@pytest.fixture
def node02(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine is node02 (10.0.0.2) of a cluster where node01 is 10.0.0.1."""
    names = {"node01": ["10.0.0.1"], "node02": ["10.0.0.2"], "127.0.0.1": ["127.0.0.1"]}

    def resolve(host: str) -> list[str]:
        if host in names:
            return names[host]
        if host.replace(".", "").isdigit():
            return [host]
        raise OSError(f"[Errno -2] Name or service not known: {host}")

    monkeypatch.setattr(network, "resolve", resolve)
    monkeypatch.setattr(network, "is_local", lambda address: address == "10.0.0.2")
    monkeypatch.setattr(socket, "gethostname", lambda: "node02")
    monkeypatch.setattr(socket, "getfqdn", lambda name="": "node02")
    monkeypatch.setattr(network, "interface_problems", lambda environ=None: [])
    return names


def test_a_node_that_is_not_the_endpoint_joins_as_a_client(node02: dict) -> None:
    assert launch.check_launch(_launch()) is False


def test_the_node_the_endpoint_names_hosts_the_rendezvous(node02: dict) -> None:
    assert launch.check_launch(_launch(endpoint="node02:29500")) is True


def test_a_loopback_endpoint_is_refused_on_a_multi_node_launch(node02: dict) -> None:
    with pytest.raises(
        LaunchRefused, match=r"RDZV_ENDPOINT=127\.0\.0\.1:29500 is a loopback"
    ) as found:
        launch.check_launch(_launch(endpoint="127.0.0.1:29500", local_addr="10.0.0.2"))
    assert found.value.status == 2


def test_an_endpoint_that_does_not_resolve_is_refused(node02: dict) -> None:
    with pytest.raises(LaunchRefused, match="nodex:29500 does not resolve on node02"):
        launch.check_launch(_launch(endpoint="nodex:29500"))


def test_a_host_name_that_resolves_to_loopback_asks_for_local_addr(node02: dict) -> None:
    node02["node02"] = ["127.0.1.1"]
    with pytest.raises(LaunchRefused, match=r"resolves to 127\.0\.1\.1 on node02") as found:
        launch.check_launch(_launch())
    assert "Set LOCAL_ADDR to this machine's address" in str(found.value)


def test_a_local_addr_of_another_machine_is_refused(node02: dict) -> None:
    with pytest.raises(LaunchRefused, match="is not an address of this machine"):
        launch.check_launch(_launch(local_addr="10.0.0.9"))


def test_a_missing_interface_is_refused_before_anything_waits() -> None:
    with pytest.raises(LaunchRefused, match="GLOO_SOCKET_IFNAME=eth-missing"):
        launch.check_launch(_launch(), {"GLOO_SOCKET_IFNAME": "eth-missing"})


def test_one_node_needs_no_rendezvous_checks() -> None:
    assert launch.check_launch(_launch(nnodes="1", standalone=True), {}) is True


# --- the meeting ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _meet_in_threads(host: Launch, others: list[Launch], timeout_s: float = 10) -> list[Any]:
    """Run the meeting of `host` and `others` (joining it) in threads: each one's result, or
    the LaunchRefused it raised."""
    results: list[Any] = [None] * (1 + len(others))

    def attend(index: int, node: Launch, is_host: bool) -> None:
        try:
            results[index] = launch.meet(node, is_host, timeout_s, expected=[])
        except LaunchRefused as refusal:
            results[index] = refusal

    threads = [threading.Thread(target=attend, args=(0, host, True))]
    threads += [
        threading.Thread(target=attend, args=(i + 1, node, False)) for i, node in enumerate(others)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 30)
    return results


def _local(port: int, **changes: Any) -> Launch:
    return _launch(endpoint=f"127.0.0.1:{port}", local_addr="127.0.0.1", **changes)


def test_the_nodes_meet_and_each_learns_every_node() -> None:
    port = _free_port()
    host, other = _meet_in_threads(_local(port, nnodes="2"), [_local(port, nproc_per_node="4")])
    assert [node.nproc_per_node for node in host] == ["1", "4"]
    assert host == other


def test_nodes_given_different_nnodes_are_all_refused_at_once() -> None:
    port = _free_port()
    host, other = _meet_in_threads(_local(port), [_local(port, nnodes="3")])
    for refusal in (host, other):
        assert isinstance(refusal, LaunchRefused) and refusal.status == 2
        assert "has NNODES=2" in str(refusal) and "has NNODES=3" in str(refusal)


def test_a_node_of_another_run_is_refused() -> None:
    port = _free_port()
    _, other = _meet_in_threads(_local(port), [_local(port, rdzv_id="exp2")])
    assert isinstance(other, LaunchRefused) and "RDZV_ID=exp2" in str(other)


def test_a_node_that_never_joins_ends_the_wait_naming_who_joined(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(launch, "PROGRESS_S", 0.2)
    [refusal] = _meet_in_threads(_local(_free_port()), [], timeout_s=1)
    assert isinstance(refusal, LaunchRefused) and refusal.status == 1
    assert "still missing 1 of 2 nodes" in str(refusal)
    assert "waiting for 1 of 2 nodes" in capsys.readouterr().err  # progress meanwhile


def test_a_rendezvous_port_in_use_is_refused_on_the_host() -> None:
    with socket.create_server(("", 0)) as taken:
        port = taken.getsockname()[1]
        [refusal] = _meet_in_threads(_local(port), [], timeout_s=1)
    assert isinstance(refusal, LaunchRefused) and refusal.status == 2
    assert f"cannot listen on port {port}" in str(refusal)


def test_a_program_that_holds_the_port_and_says_nothing_ends_the_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(launch, "PROGRESS_S", 0.2)
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        with pytest.raises(LaunchRefused, match="gave no word") as found:
            launch.meet(_local(port), is_host=False, join_timeout_s=5, expected=[])
    assert found.value.status == 1


def test_nobody_at_the_endpoint_ends_the_wait_with_the_cause() -> None:
    with pytest.raises(LaunchRefused, match="connection refused") as found:
        launch.meet(_local(_free_port()), is_host=False, join_timeout_s=1, expected=[])
    assert found.value.status == 1


def test_the_host_role_is_added_to_the_rendezvous_settings() -> None:
    given = ["--rdzv-conf=join_timeout=300", "-m", "pkg.train"]
    assert launch._with_host_role(given, True)[0] == "--rdzv-conf=join_timeout=300,is_host=true"
    assert launch._with_host_role(["-m", "pkg.train"], False)[0] == "--rdzv-conf=is_host=false"


# --- exit statuses --------------------------------------------------------------------------


def test_a_named_cause_wins_over_other_statuses_then_failures_then_stops() -> None:
    assert launch.most_telling([75, 1, 2]) == 2
    assert launch.most_telling([75, 1]) == 1
    assert launch.most_telling([0, 75]) == 75
    assert launch.most_telling([0, 130, 75]) == 130
    assert launch.most_telling([0, 0]) == 0
    assert launch.most_telling([]) is None


def test_only_the_last_attempts_statuses_count(tmp_path: Path) -> None:
    (tmp_path / "0.0").write_text("1\n")  # the attempt torchrun restarted
    (tmp_path / "1.0").write_text("0\n")
    (tmp_path / "1.1").write_text("0\n")
    assert launch.recorded_statuses(tmp_path) == [0, 0]


def test_the_training_records_its_status_also_when_it_raises(tmp_path: Path) -> None:
    environ = {launch.STATUS_DIR_VARIABLE: str(tmp_path), "LOCAL_RANK": "1"}

    def failing() -> int:
        raise RuntimeError("a bug")

    with pytest.MonkeyPatch.context() as patch:
        for name, value in environ.items():
            patch.setenv(name, value)
        assert launch.exit_status_recorded(lambda: 75) == 75
        assert (tmp_path / "0.1").read_text() == "75\n"
        with pytest.raises(RuntimeError):
            launch.exit_status_recorded(failing)
        assert (tmp_path / "0.1").read_text() == "1\n"
        with pytest.raises(SystemExit):
            launch.exit_status_recorded(lambda: sys.exit(2))
        assert (tmp_path / "0.1").read_text() == "2\n"


def test_the_doctor_records_its_status_for_the_launcher(tmp_path: Path) -> None:
    """A refused setting: the doctor exits 2, and the launcher finds 2 recorded."""
    environ = {**os.environ, launch.STATUS_DIR_VARIABLE: str(tmp_path), "LOCAL_RANK": "0"}
    command = [sys.executable, "-m", "{{ cookiecutter.package_name }}.doctor", "train.epochs=-1"]
    result = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert launch.recorded_statuses(tmp_path) == [2]


#: A stand-in for torchrun: its worker records status 3 and ends, and it stays, deaf to SIGTERM,
#: as torchrun waiting on a rendezvous store on a node that is gone.
HANGING_TORCHRUN = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
record = "import os, pathlib; pathlib.Path(os.environ['{variable}'], '0.0').write_text('3')"
subprocess.run([sys.executable, "-c", record], check=True)
while True:
    time.sleep(1)
"""


def test_a_torchrun_that_outlives_its_workers_is_ended_with_their_status(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "torchrun.py"
    script.write_text(HANGING_TORCHRUN.format(variable=launch.STATUS_DIR_VARIABLE))
    status_dir = tmp_path / "status"
    status_dir.mkdir()
    environ = {"PATH": "/usr/bin:/bin", launch.STATUS_DIR_VARIABLE: str(status_dir)}
    status = launch._supervise(
        [sys.executable, str(script)],
        environ,
        _launch(nnodes="1", standalone=True),
        status_dir,
        exit_timeout_s=0.5,
        join_timeout_s=60,
        shutdown_timeout_s=60,
    )
    assert status == 3
    err = capsys.readouterr().err
    assert "after its last worker ended" in err and "ending it" in err


def test_without_a_recorded_status_a_signal_gives_the_stop_its_status() -> None:
    import signal

    assert launch._status_after_signal(1, [signal.SIGTERM]) == 75
    assert launch._status_after_signal(1, [signal.SIGUSR1]) == 0
    assert launch._status_after_signal(1, []) == 1
    assert launch._status_after_signal(4, [signal.SIGTERM]) == 4


# --- the launch's last line -------------------------------------------------------------------

#: torchrun's report after rank 1 diverged and torchrun ended rank 0 (its ChildFailedError).
CHILD_FAILED = """\
E1128 10:15:13.884000 10764 api.py:1002] failed (exitcode: 3) local_rank: 1 (pid: 10786)
Traceback (most recent call last):
  File "agent.py", line 30, in main
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
ddp_project.train FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-28_10:15:13
  host      : node01
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 10785)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-28_10:15:13
  host      : node01
  rank      : 1 (local_rank: 1)
  exitcode  : 3 (pid: 10786)
============================================================
"""


def test_the_last_line_is_the_training_s_status_and_the_gist_of_torchrun_s_report() -> None:
    kept = "runs/exp1/torchrun_node01.log"
    assert launch.conclusion(3, CHILD_FAILED, kept, "node01") == (
        "exit status 3 on node01: the training diverged (torchrun: rank 0 exited -15 "
        f"(SIGTERM), rank 1 exited 3; all of it in {kept})"
    )


def test_without_a_report_the_last_line_is_the_status_alone() -> None:
    assert launch.conclusion(75, "", None, "node01") == (
        "exit status 75 on node01: stopped with a checkpoint at its current step: the same "
        "command continues"
    )


@pytest.mark.parametrize(
    ("report", "gist"),
    [
        ("SignalException: Process 12 got signal: 2\n", "stopped on SIGINT"),
        ("RendezvousTimeoutError: no join\n\n", "RendezvousTimeoutError: no join"),
    ],
    ids=["signal", "other-error"],
)
def test_torchrun_s_report_is_cut_to_its_gist(report: str, gist: str) -> None:
    assert launch.report_gist(report) == gist


def test_torchrun_s_report_is_kept_beside_the_run_s_logs(tmp_path: Path) -> None:
    """Only once the training recorded its run directory (its job owns it); rank 0 of each
    node records it."""
    status_dir, run_dir = tmp_path / "status", tmp_path / "run"
    status_dir.mkdir()
    run_dir.mkdir()
    assert launch.keep_report(CHILD_FAILED, status_dir, "node01") is None
    launch.record_run_dir(run_dir, {launch.STATUS_DIR_VARIABLE: str(status_dir), "LOCAL_RANK": "1"})
    assert launch.keep_report(CHILD_FAILED, status_dir, "node01") is None
    launch.record_run_dir(run_dir, {launch.STATUS_DIR_VARIABLE: str(status_dir), "LOCAL_RANK": "0"})
    kept = Path(launch.keep_report(CHILD_FAILED, status_dir, "node01") or "")
    assert kept == run_dir / "torchrun_node01.log"
    assert kept.read_text().endswith(CHILD_FAILED)
    assert launch.recorded_statuses(status_dir) == []  # the record is no status
