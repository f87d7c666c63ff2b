"""The same training on CUDA with NCCL. Skipped, with the reason, where GPUs are missing.

`make gpu-check` (benchmarks/gpu_check.py) runs these with the GPU's figures.
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }}.checkpointing.checkpoint import load_checkpoint
from {{ cookiecutter.package_name }}.checkpointing.layout import latest_checkpoint
from {{ cookiecutter.package_name }}.cluster.distributed import DistEnv
from {{ cookiecutter.package_name }}.config import load_config
from {{ cookiecutter.package_name }}.faults.flight_recorder import FILE_PREFIX
from {{ cookiecutter.package_name }}.monitoring.metrics import MetricsLogger, read_metrics
from {{ cookiecutter.package_name }}.task import Task
from {{ cookiecutter.package_name }}.training.trainer import Trainer

from ..helpers import FAST, TRAINING_LOSS, run_torchrun, spawn, write_fault_entry
from .test_slow_rank import rank_one_named_slowest, train_ranks
from .test_timeouts import HANG

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


@needs_cuda
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_one_gpu_trains_in_each_precision(tmp_path: Path, precision: str) -> None:
    """bf16 autocast needs no loss scaling; fp16 scales the loss and checkpoints its scaler."""
    run_dir = tmp_path / "run"
    overrides = [f"run.dir={run_dir}", "train.max_steps=8", f"train.mixed_precision={precision}"]
    result = run_torchrun(1, [*FAST, *overrides])
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [record[TRAINING_LOSS] for record in read_metrics(run_dir) if TRAINING_LOSS in record]
    assert losses and all(math.isfinite(loss) for loss in losses)
    state = load_checkpoint(latest_checkpoint(run_dir), rank=0, world_size=1).state
    assert bool(state["scaler"]) == (precision == "fp16")


@needs_cuda
def test_a_slow_rank_on_a_gpu_is_named_from_cuda_events_with_the_gpu_readings(
    tmp_path: Path,
) -> None:
    """Two ranks share GPU 0 over gloo (NCCL takes one rank per GPU), rank 1 sleeping after each
    forward: its compute and the other rank's wait come from CUDA events, the GPU's readings
    from NVML where nvidia-ml-py is installed, and profile.nvtx's ranges cost the run nothing."""
    more = ("dist.backend=gloo", "profile.nvtx=true")
    lines, records = spawn(
        2, train_ranks, tmp_path / "run", True, 4, 2, "cuda", more, workdir=tmp_path
    )[0]
    warnings, train = rank_one_named_slowest(lines, records)
    if importlib.util.find_spec("pynvml") is not None:
        readings = ["clock_mhz", "temperature_c", "power_w", "utilization"]
        assert all(f"train/gpu_{name}" in train[-1] for name in readings), train[-1]
        assert "its GPU: " in warnings[-1]


#: Deterministic CUDA kernels where torch has them (both runs alike), and one failure in step 6
#: of the first attempt when FAIL_ONCE is set: torchrun restarts the rank, which resumes from
#: the checkpoint of step 4.
DETERMINISTIC_FAILING_ONCE = """
import torch

torch.use_deterministic_algorithms(True, warn_only=True)
train_step = Trainer.train_step


def failing_train_step(self, batches):
    first_attempt = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
    if os.environ.get("FAIL_ONCE") and first_attempt and self.step + 1 == 6:
        raise RuntimeError("fails once in step 6")
    return train_step(self, batches)


Trainer.train_step = failing_train_step
"""


def _final_weights(run_dir: Path, entry: Path) -> dict[str, torch.Tensor]:
    """The weights at the end of a one-GPU run of `entry`, which torchrun restarts once."""
    overrides = [*FAST, f"run.dir={run_dir}", "train.max_steps=8"]
    result = run_torchrun(1, overrides, entry=entry, max_restarts=1)
    assert result.returncode == 0, result.stderr[-3000:]
    return load_checkpoint(latest_checkpoint(run_dir), rank=0, world_size=1).state["model"]


@needs_cuda
def test_a_run_resumed_on_cuda_ends_bitwise_like_an_unbroken_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint holds all a CUDA run needs, the device's random state included."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    entry = write_fault_entry(tmp_path, DETERMINISTIC_FAILING_ONCE)
    unbroken = _final_weights(tmp_path / "unbroken", entry)
    monkeypatch.setenv("FAIL_ONCE", "1")
    resumed = _final_weights(tmp_path / "resumed", entry)
    assert "resumed from" in (tmp_path / "resumed" / "train.log").read_text()
    assert unbroken.keys() == resumed.keys()
    assert all(torch.equal(unbroken[key], resumed[key]) for key in unbroken)


@needs_cuda
@needs_two_gpus
def test_a_rank_hung_under_nccl_leaves_every_rank_s_flight_recorder_and_the_stacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 hangs in step 6. Rank 0's all-reduce times out in NCCL's watchdog, which has every
    rank write its flight recorder to comm_traces/ and then aborts rank 0, whose Python stacks
    go to train.log; torchrun's SIGTERM then makes rank 1 write its stacks. torchfrtrace names
    rank 1 as the rank that did not join rank 0's all-reduce."""
    monkeypatch.setenv("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "2000")  # 8 s for the files
    run_dir = tmp_path / "run"
    overrides = [*FAST, f"run.dir={run_dir}", "train.max_steps=6", "dist.backend=nccl"]
    overrides += ["dist.timeout_s=4", "checkpoint.stop_check_s=0.2"]
    result = run_torchrun(2, overrides, timeout=300, entry=write_fault_entry(tmp_path, HANG))
    assert result.returncode != 0
    traces = run_dir / "comm_traces"
    assert {f"{FILE_PREFIX}0", f"{FILE_PREFIX}1"} <= {path.name for path in traces.iterdir()}
    command = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(traces)]
    analysis = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert "missing ranks: {1}" in analysis.stdout + analysis.stderr
    assert "Fatal Python error: Aborted" in (run_dir / "train.log").read_text()
    assert "in hanging_train_step" in (run_dir / "stacks" / "rank_00001.txt").read_text()
