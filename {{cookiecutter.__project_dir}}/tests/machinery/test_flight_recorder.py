"""NCCL's flight recorder: the variables every rank gets before an NCCL group starts, the
directory the ranks write to on a timeout, and torch's analyser that the docs name.

No NCCL group starts on CPU: here the group's start stops where torch reads the variables.
tests/task/test_gpu.py hangs a rank under NCCL and reads what the ranks wrote.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from {{ cookiecutter.package_name }}.cluster import distributed
from {{ cookiecutter.package_name }}.cluster.distributed import DistEnv, process_group
from {{ cookiecutter.package_name }}.config import ConfigError, DistConfig, load_config
from {{ cookiecutter.package_name }}.faults.flight_recorder import (
    FILE_PREFIX,
    NAMES,
    record_collectives,
)

from ..helpers import spawn

pytestmark = pytest.mark.standalone
#: Every name torch reads a setting of the recorder under.
ALL_NAMES = {name for names in NAMES.values() for name in names}
DEFAULT_ENTRIES = DistConfig().flight_recorder_entries


def test_every_rank_keeps_2000_collectives_and_writes_them_to_comm_traces_by_default(
    tmp_path: Path,
) -> None:
    environ: dict[str, str] = {}
    record_collectives(DEFAULT_ENTRIES, tmp_path / "comm_traces", 1, 1, environ)
    assert environ == {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "TORCH_FR_DUMP_TEMP_FILE": f"{tmp_path}/comm_traces/{FILE_PREFIX}",
    }


def test_a_value_the_user_exported_is_kept_under_either_of_its_names(tmp_path: Path) -> None:
    exported = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "500",  # the older name of TORCH_FR_BUFFER_SIZE
        "TORCH_FR_DUMP_TEMP_FILE": "/scratch/traces/fr_",
        "TORCH_NCCL_ENABLE_MONITORING": "0",
    }
    environ = dict(exported)
    record_collectives(DEFAULT_ENTRIES, tmp_path / "comm_traces", 0, 0, environ)
    assert environ == {**exported, "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert not (tmp_path / "comm_traces").exists()


def test_zero_entries_turn_the_recorder_off_and_make_no_directory(tmp_path: Path) -> None:
    environ: dict[str, str] = {}
    record_collectives(0, tmp_path / "comm_traces", 0, 0, environ)
    assert environ == {"TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
    assert not (tmp_path / "comm_traces").exists()


def test_a_negative_number_of_entries_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"dist\.flight_recorder_entries must be >= 0"):
        load_config(None, ["dist.flight_recorder_entries=-1"])


def test_the_first_rank_of_each_host_creates_the_directory(tmp_path: Path) -> None:
    """NCCL writes into the directory but does not create it; every host needs it where the
    run's local part is the node's own (a run directory in an object store)."""
    directory = tmp_path / "run" / "comm_traces"
    record_collectives(DEFAULT_ENTRIES, directory, rank=9, local_rank=1, environ={})
    assert not directory.exists()
    record_collectives(DEFAULT_ENTRIES, directory, rank=8, local_rank=0, environ={})
    assert directory.is_dir()


def test_rank_0_says_in_one_line_what_was_set_and_what_was_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    exported = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "500"}
    for rank in (1, 0):
        record_collectives(DEFAULT_ENTRIES, tmp_path, rank, rank, dict(exported))
    assert [record.getMessage() for record in caplog.records] == [
        "NCCL flight recorder (dist.flight_recorder_entries=2000): set "
        "TORCH_NCCL_DUMP_ON_TIMEOUT=1, TORCH_NCCL_ENABLE_MONITORING=1, "
        f"TORCH_FR_DUMP_TEMP_FILE={tmp_path}/{FILE_PREFIX}; kept as exported "
        "TORCH_NCCL_TRACE_BUFFER_SIZE=500"
    ]


class _Started(Exception):
    """Raised where torch would start the process group."""


@pytest.fixture
def variables_at_start(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, dict[str, str]]]:
    """backend -> the recorder's variables in the environment when a 2-rank group starts with
    it (the start stops there); none of them is set before, and all are restored after."""
    seen: dict[str, dict[str, str]] = {}

    def init_process_group(backend: str, **options: object) -> None:
        seen[backend] = {name: os.environ[name] for name in ALL_NAMES if name in os.environ}
        raise _Started

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(distributed, "open_store", lambda env, timeout: dist.HashStore())
    saved = {name: os.environ.pop(name) for name in ALL_NAMES if name in os.environ}
    try:
        yield seen
    finally:
        for name in ALL_NAMES:
            os.environ.pop(name, None)
        os.environ.update(saved)


def _start_two_ranks(config: DistConfig, comm_traces: Path) -> None:
    env = DistEnv(rank=0, local_rank=0, world_size=2, launcher="torchrun")
    with pytest.raises(_Started), process_group(env, config, comm_traces=comm_traces):
        pass


def test_an_nccl_group_starts_with_the_recorder_writing_into_the_run_directory(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    variables_at_start: dict[str, dict[str, str]],
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    _start_two_ranks(DistConfig(), tmp_path / "comm_traces")
    assert variables_at_start == {
        "nccl": {
            "TORCH_FR_BUFFER_SIZE": "2000",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_ENABLE_MONITORING": "1",
            "TORCH_FR_DUMP_TEMP_FILE": f"{tmp_path}/comm_traces/{FILE_PREFIX}",
        }
    }
    assert (tmp_path / "comm_traces").is_dir()


def test_a_gloo_group_starts_without_the_recorder_settings(
    tmp_path: Path, variables_at_start: dict[str, dict[str, str]]
) -> None:
    _start_two_ranks(DistConfig(device="cpu"), tmp_path / "comm_traces")
    assert variables_at_start == {"gloo": {}}
    assert not (tmp_path / "comm_traces").exists()


def test_the_analyser_the_docs_name_is_torchs_console_script() -> None:
    (script,) = importlib.metadata.entry_points(group="console_scripts", name="torchfrtrace")
    assert script.value == "torch.distributed.flight_recorder.fr_trace:main"
    assert callable(script.load())


def _rank_1_skips_a_collective(rank: int, world_size: int, traces: Path) -> None:
    """Rank 0 all-reduces twice, rank 1 once; then each writes its recorder as NCCL would."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=1))
    tensor = torch.ones(4)
    dist.all_reduce(tensor, group=group)
    if rank == 0:
        with pytest.raises(RuntimeError):
            dist.all_reduce(tensor, group=group)
    dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    # gloo's records lack the groups' names in pg_config (NCCL's have them): filled in.
    groups = {entry["process_group"] for entry in dump["entries"]}
    dump["pg_config"] = {
        name: {"name": name, "desc": desc, "ranks": str(list(range(world_size)))}
        for name, desc in groups
    }
    (traces / f"{FILE_PREFIX}{rank}").write_bytes(pickle.dumps(dump))


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_the_analyser_reads_the_ranks_files_and_names_the_rank_that_did_not_join(
    tmp_path: Path,
) -> None:
    """The command of the troubleshooting page, on files named as the ranks name theirs."""
    traces = tmp_path / "comm_traces"
    traces.mkdir()
    spawn(2, _rank_1_skips_a_collective, traces, workdir=tmp_path / "spawn")
    command = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(traces)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    report = result.stdout + result.stderr
    assert result.returncode == 0, report
    assert "Not all ranks joining collective" in report
    assert "missing ranks: {1}" in report
    assert "_rank_1_skips_a_collective at " in report  # the stack that issued it
