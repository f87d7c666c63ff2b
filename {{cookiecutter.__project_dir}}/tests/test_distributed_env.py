"""Launcher detection: torchrun, Slurm, or a plain single process."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from {{ cookiecutter.package_name }}.config import DistConfig
from {{ cookiecutter.package_name }}.distributed import (
    DistEnv,
    DistributedError,
    detect_env,
    select_backend,
    select_device,
)


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


def test_cpu_device_uses_gloo() -> None:
    device = select_device(DistEnv(), DistConfig(device="cpu"))
    assert device == torch.device("cpu")
    assert select_backend(device, DistConfig()) == "gloo"


def test_nccl_on_cpu_is_a_clear_error() -> None:
    with pytest.raises(DistributedError, match="nccl needs CUDA"):
        select_backend(torch.device("cpu"), DistConfig(backend="nccl"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
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
