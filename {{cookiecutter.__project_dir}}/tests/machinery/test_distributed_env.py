"""Launcher detection: torchrun, an MPI launcher, Slurm, or a plain single process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }}.checkpointing.layout import COMPLETE_MARKER, latest_checkpoint
from {{ cookiecutter.package_name }}.cluster.distributed import (
    DistEnv,
    DistributedError,
    detect_env,
    process_group,
    select_backend,
    select_device,
)
from {{ cookiecutter.package_name }}.config import ConfigError, DistConfig
from {{ cookiecutter.package_name }}.monitoring.metrics import read_metrics

from ..helpers import FAST, TRAINING_LOSS


def test_torchrun_variables_win() -> None:
    environ = {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
    }
    assert detect_env(environ) == DistEnv(rank=3, local_rank=1, world_size=4, launcher="torchrun")


def test_slurm_task_per_gpu_variables_are_read() -> None:
    environ = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8"}
    assert detect_env(environ) == DistEnv(rank=5, local_rank=1, world_size=8, launcher="slurm")


def test_single_slurm_task_is_a_single_process() -> None:
    """`srun python -m ...` with one task (or an interactive allocation) needs no process group."""
    assert detect_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) == DistEnv()


def test_no_launcher_means_single_process() -> None:
    assert detect_env({}) == DistEnv(rank=0, local_rank=0, world_size=1, launcher="single")


def test_open_mpi_variables_are_read() -> None:
    environ = {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "4",
    }
    assert detect_env(environ) == DistEnv(rank=3, local_rank=1, world_size=4, launcher="mpi")


def test_mpich_and_intel_mpi_variables_are_read() -> None:
    environ = {"PMI_RANK": "5", "MPI_LOCALRANKID": "2", "PMI_SIZE": "8"}
    assert detect_env(environ) == DistEnv(rank=5, local_rank=2, world_size=8, launcher="mpi")


def test_mpirun_inside_a_slurm_allocation_is_read_as_mpi_not_as_its_slurm_task() -> None:
    """mpirun starts its processes from one Slurm task per node: they inherit its SLURM_*."""
    environ = {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "4",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "2",
    }
    assert detect_env(environ) == DistEnv(rank=3, local_rank=1, world_size=4, launcher="mpi")


def test_srun_with_pmi_takes_the_local_rank_from_slurm() -> None:
    environ = {"PMI_RANK": "5", "PMI_SIZE": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1"}
    assert detect_env(environ) == DistEnv(rank=5, local_rank=1, world_size=8, launcher="mpi")


def test_an_mpi_process_without_a_local_rank_is_a_clear_error() -> None:
    with pytest.raises(DistributedError, match="PMI_RANK is set, but no local rank"):
        detect_env({"PMI_RANK": "1", "PMI_SIZE": "2"})


def test_a_pmix_process_of_unknown_world_size_is_refused_not_trained_alone() -> None:
    with pytest.raises(DistributedError, match="no variable gives the number of processes"):
        detect_env({"PMIX_RANK": "1"})


def test_mpi_without_a_rendezvous_address_says_how_to_pass_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    env = DistEnv(rank=0, local_rank=0, world_size=2, launcher="mpi")
    with (
        pytest.raises(DistributedError, match="mpirun -x MASTER_ADDR=") as error,
        process_group(env, DistConfig(device="cpu")),
    ):
        pass
    assert "MASTER_ADDR and MASTER_PORT not set" in str(error.value)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.distributed
@pytest.mark.faults
@pytest.mark.timeout(120)
def test_two_processes_started_as_mpirun_starts_them_train_as_one_job(tmp_path: Path) -> None:
    """Each process sees only Open MPI's variables and the rendezvous address, as under
    `mpirun -np 2 -x MASTER_ADDR -x MASTER_PORT python -m ...`: one job of two ranks, not
    two jobs of one rank in one run directory."""
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "{{ cookiecutter.package_name }}.train"]
    command += [*FAST, f"run.dir={run_dir}", "train.max_steps=4"]
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "PMI_RANK")
    base = {name: value for name, value in os.environ.items() if name not in launcher}
    base |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
    logs = [tmp_path / f"rank_{rank}.err" for rank in range(2)]
    processes = []
    for rank, log in enumerate(logs):
        ranks = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": str(rank)}
        ranks["OMPI_COMM_WORLD_LOCAL_RANK"] = str(rank)
        with open(log, "w") as stderr:
            processes.append(subprocess.Popen(command, env=base | ranks, stderr=stderr))
    statuses = [process.wait(timeout=100) for process in processes]
    assert statuses == [0, 0], logs[0].read_text()[-3000:] + logs[1].read_text()[-3000:]
    newest = latest_checkpoint(run_dir)
    assert newest is not None and newest.name == "step_00000004"
    assert json.loads((newest / COMPLETE_MARKER).read_text())["world_size"] == 2
    steps = [record["step"] for record in read_metrics(run_dir) if TRAINING_LOSS in record]
    assert steps and steps == sorted(set(steps))


def test_cpu_device_uses_gloo() -> None:
    device = select_device(DistEnv(), DistConfig(device="cpu"))
    assert device == torch.device("cpu")
    assert select_backend(device, DistConfig()) == "gloo"


def test_a_test_not_marked_gpu_trains_on_the_cpu_on_a_gpu_machine_too() -> None:
    """conftest.py hides the GPUs from it and from the processes it starts."""
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert select_device(DistEnv(), DistConfig(device="auto")) == torch.device("cpu")


@pytest.fixture(scope="module")
def seen_by_a_module_fixture() -> tuple[str | None, torch.device]:
    """What a fixture shared by a module's tests (set up before any of them) sees."""
    auto = select_device(DistEnv(), DistConfig(device="auto"))
    return os.environ.get("CUDA_VISIBLE_DEVICES"), auto


def test_a_module_fixture_without_gpu_tests_trains_on_the_cpu_too(
    seen_by_a_module_fixture: tuple[str | None, torch.device],
) -> None:
    """The runs that a module's tests share start before the tests: the GPUs are hidden from
    them too, or their processes would take the GPU (2 ranks on one: "local rank 1 has no
    GPU")."""
    assert seen_by_a_module_fixture == ("", torch.device("cpu"))


def test_nccl_on_cpu_is_a_clear_error() -> None:
    with pytest.raises(DistributedError, match="nccl needs CUDA"):
        select_backend(torch.device("cpu"), DistConfig(backend="nccl"))


@pytest.mark.skipif(
    torch.distributed.is_mpi_available(), reason="checks the refusal where torch lacks MPI"
)
def test_the_mpi_backend_without_mpi_in_torch_is_refused_saying_why() -> None:
    with pytest.raises(ConfigError, match="needs a torch built with MPI"):
        select_backend(torch.device("cpu"), DistConfig(backend="mpi"))


def test_asking_for_cuda_without_a_gpu_is_a_clear_error() -> None:
    with pytest.raises(DistributedError, match="no CUDA device is visible"):
        select_device(DistEnv(), DistConfig(device="cuda"))


@pytest.fixture
def visible_gpus(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], list[int]]:
    """Pretend `count` GPUs are visible; returns the list that records set_device calls."""
    bound: list[int] = []

    def pretend(count: int) -> list[int]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "set_device", bound.append)
        return bound

    return pretend


def test_local_rank_i_takes_visible_gpu_i(visible_gpus: Callable[[int], list[int]]) -> None:
    bound = visible_gpus(4)
    env = DistEnv(rank=5, local_rank=1, world_size=8, launcher="torchrun")
    assert select_device(env, DistConfig(device="cuda")) == torch.device("cuda", 1)
    assert bound == [1]


def test_a_slurm_task_bound_to_one_gpu_takes_it_whatever_its_local_rank(
    visible_gpus: Callable[[int], list[int]],
) -> None:
    """srun --gpus-per-task=1: every task sees one GPU, numbered 0 in that task."""
    bound = visible_gpus(1)
    env = DistEnv(rank=3, local_rank=3, world_size=8, launcher="slurm")
    assert select_device(env, DistConfig(device="auto")) == torch.device("cuda", 0)
    assert bound == [0]


def test_more_torchrun_processes_than_gpus_is_a_clear_error(
    visible_gpus: Callable[[int], list[int]],
) -> None:
    """torchrun binds nothing: local rank 1 with one GPU would share it with local rank 0."""
    visible_gpus(1)
    env = DistEnv(rank=1, local_rank=1, world_size=2, launcher="torchrun")
    with pytest.raises(DistributedError, match="local rank 1 has no GPU: only 1 visible"):
        select_device(env, DistConfig(device="cuda"))
