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
