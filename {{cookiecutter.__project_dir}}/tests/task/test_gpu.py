"""The same training on CUDA with NCCL. Skipped, with the reason, where GPUs are missing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }}.checkpointing.checkpoint import load_checkpoint
from {{ cookiecutter.package_name }}.checkpointing.layout import latest_checkpoint
from {{ cookiecutter.package_name }}.cluster.distributed import DistEnv
from {{ cookiecutter.package_name }}.config import load_config
from {{ cookiecutter.package_name }}.monitoring.metrics import MetricsLogger
from {{ cookiecutter.package_name }}.task import Task
from {{ cookiecutter.package_name }}.training.trainer import Trainer

from ..helpers import FAST, run_torchrun

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
needs_two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason=f"needs 2 GPUs, found {torch.cuda.device_count()}"
)


@needs_cuda
def test_one_gpu_trains(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_torchrun(1, [*FAST, f"run.dir={run_dir}", "train.max_steps=8"])
    assert result.returncode == 0, result.stderr
    assert "device cuda:0" in result.stderr


@needs_cuda
def test_a_step_that_is_not_logged_never_waits_for_the_gpu(tmp_path: Path) -> None:
    """The host queues step after step: a host sync per step would leave the GPU idle."""
    overrides = ["train.mixed_precision=bf16", "data.pin_memory=true", "train.log_every=1000"]
    config = load_config(None, [*FAST, f"run.dir={tmp_path}", *overrides])
    task = Task(config.task, seed=config.run.seed)
    metrics = MetricsLogger(tmp_path, is_main=True)
    trainer = Trainer(config, task, DistEnv(), torch.device("cuda", 0), tmp_path, metrics)
    trainer.sampler.set_epoch(0)
    batches = iter(trainer.train_loader)
    trainer.train_step(batches)  # the first step initialises CUDA state lazily
    trainer.step += 1
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            trainer.train_step(batches)
            trainer.step += 1
    finally:
        torch.cuda.set_sync_debug_mode("default")


@needs_cuda
@needs_two_gpus
def test_two_gpus_train_checkpoint_and_resume_with_nccl(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = run_torchrun(2, [*FAST, f"run.dir={run_dir}", "train.max_steps=8", "dist.backend=nccl"])
    assert first.returncode == 0, first.stderr
    second = run_torchrun(
        2, [*FAST, f"run.dir={run_dir}", "train.max_steps=16", "dist.backend=nccl"]
    )
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stderr
    state = load_checkpoint(latest_checkpoint(run_dir), rank=0, world_size=2).state
    assert (state["step"], state["world_size"]) == (16, 2)
