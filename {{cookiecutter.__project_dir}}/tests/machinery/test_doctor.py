"""The doctor's verdicts on what it measured (the checks themselves run on two hosts in the
template's tests/test_multinode.py, where their numbers depend on the machine's load), and
its report when no process group can start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }} import doctor
from {{ cookiecutter.package_name }}.cluster.distributed import DistEnv
from {{ cookiecutter.package_name }}.config import Config

from ..helpers import FAST

pytestmark = pytest.mark.standalone


def _compute_check(
    monkeypatch: pytest.MonkeyPatch, config: Config, per_rank: list[float]
) -> doctor.Check:
    """The compute check, as if the ranks had measured `per_rank` TFLOP/s."""
    monkeypatch.setattr(doctor, "gather_objects", lambda mine: per_rank)
    return doctor._compute(config, DistEnv(), torch.device("cpu"))


def test_a_rank_below_80_percent_of_the_fastest_is_named_as_slow(
    monkeypatch: pytest.MonkeyPatch, fast_config: Config
) -> None:
    check = _compute_check(monkeypatch, fast_config, [1.0, 0.7, 0.95])
    assert check.verdict == doctor.WARN
    assert check.value.startswith("rank 1 on an unknown host below 80% of the fastest")


def test_ranks_within_80_percent_of_the_fastest_pass(
    monkeypatch: pytest.MonkeyPatch, fast_config: Config
) -> None:
    check = _compute_check(monkeypatch, fast_config, [1.0, 0.85])
    assert check.verdict == doctor.PASS
    assert check.value.startswith("0.85-1 TFLOP/s per rank")


def test_a_missing_interface_is_reported_with_this_hosts_checks_and_no_process_group(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Rank 0 of 2 under plain torchrun, GLOO_SOCKET_IFNAME naming no interface: what needs
    no other rank is checked and reported, the interface FAILs in the doctor's words, and the
    process group is not started (gloo would abort). No rendezvous address: no rank to tell."""
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    report = tmp_path / "report.json"
    arguments = ["--json", str(report), *FAST, f"run.dir={tmp_path / 'run'}"]
    assert doctor.main(arguments) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("SKIP  process group    not started: an interface that")
    failed = "FAIL  socket ifnames   GLOO_SOCKET_IFNAME=nosuch0: this machine ("
    assert any(line.startswith(failed) for line in lines)
    verdicts = {
        entry["name"]: entry["verdict"] for entry in json.loads(report.read_text())["checks"]
    }
    assert verdicts["run directory"] == verdicts["cores"] == doctor.PASS
    assert not any((tmp_path / "run").iterdir())  # the probe is removed


def test_a_run_refused_before_its_checks_leaves_no_earlier_report_behind(
    tmp_path: Path,
) -> None:
    report = tmp_path / "report.json"
    report.write_text('{"status": 0, "checks": []}')
    assert doctor.main(["--json", str(report), "train.epochs=-1"]) == 2
    assert not report.exists()


def test_a_slow_link_is_measured_within_the_bound_and_larger_sizes_are_not_tried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """50 Mbit/s between two ranks: 0.17 s per 1 MiB all-reduce, 2.8 s per 16 MiB. Measured
    in five all-reduces (the 16 MiB warm-up spends the bound), not in twelve (68 s)."""
    seconds = {1 << 18: 0.17, 4 << 20: 2.8, 16 << 20: 11.2}  # float32 elements -> seconds
    timed: list[float] = []

    def all_reduce_s(tensor: torch.Tensor, group: object) -> float:
        timed.append(seconds[tensor.numel()])
        return timed[-1]

    monkeypatch.setattr(doctor, "_all_reduce_s", all_reduce_s)
    monkeypatch.setattr(doctor.dist, "get_world_size", lambda group: 2)
    measured = doctor._sweep((1, 16, 64), None, torch.device("cpu"))
    assert timed == [0.17] * 4 + [2.8]
    assert [round(measured[size], 4) for size in measured] == [0.0062, 0.006]
    assert doctor._table(measured, (1, 16, 64), 0.1) == (
        "1 MiB 0.00617, 16 MiB 0.00599 GB/s (floor 0.1 GB/s); 64 MiB not tried: the 2 s were spent"
    )


def _pair(
    busbw: float, link_mbps: int | None, hosts: tuple[str, str] = ("alpha", "beta")
) -> doctor._Pair:
    return doctor._Pair(hosts, busbw, ("eth0", "eth1"), link_mbps)


def test_a_pair_below_the_floor_fails_naming_both_hosts() -> None:
    """What two namespace hosts held to 50 Mbit/s measured (a veth reports no speed)."""
    check = doctor._pair_verdict([_pair(0.00589, None)], floor=0.1)
    assert check.verdict == doctor.FAIL
    assert check.value == (
        "gloo busbw up to 16 MiB: alpha-beta 0.00589 GB/s (link speed not reported), below "
        "the floor of 0.1 GB/s"
    )
    assert check.fix.startswith("test the link between alpha and beta: `ethtool IFACE`")


def test_a_pair_far_below_the_speed_its_nics_report_is_named_with_both_hosts() -> None:
    check = doctor._pair_verdict([_pair(0.2, 25000), _pair(1.1, 25000, ("beta", "gamma"))], 0.1)
    assert check.verdict == doctor.WARN
    assert "alpha-beta 0.2 GB/s (links of 25000 Mb/s), 16% of the 10000 Mb/s gloo" in check.value
    assert "beta-gamma 1.1 GB/s (links of 25000 Mb/s);" not in check.value
    assert "between alpha and beta" in check.fix


def test_pairs_near_the_speed_of_their_links_pass() -> None:
    check = doctor._pair_verdict([_pair(0.11, 1000), _pair(0.1, 1000, ("beta", "gamma"))], 0.1)
    assert (check.verdict, check.fix) == (doctor.PASS, "")


def test_mpi_is_measured_only_where_torch_has_it_and_mpirun_started_the_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(doctor.dist, "is_mpi_available", lambda: False)
    _, skipped = doctor._mpi_group(DistEnv(world_size=2, launcher="torchrun"))
    assert skipped.value.startswith("this torch is not built with MPI")
    monkeypatch.setattr(doctor.dist, "is_mpi_available", lambda: True)
    monkeypatch.setattr(doctor.dist, "get_backend", lambda: "gloo")
    _, skipped = doctor._mpi_group(DistEnv(world_size=2, launcher="torchrun"))
    assert skipped.value.startswith("this torch has MPI, but torchrun started the ranks")
