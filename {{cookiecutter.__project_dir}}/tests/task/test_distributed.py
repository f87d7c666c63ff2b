"""Real multi-process training over gloo on CPU: 2 ranks launched by torchrun, and the shipped
config on 8 ranks."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from subprocess import CompletedProcess

import pytest

from {{ cookiecutter.package_name }}.checkpointing.checkpoint import load_checkpoint
from {{ cookiecutter.package_name }}.checkpointing.layout import latest_checkpoint
from {{ cookiecutter.package_name }}.config import load_config
from {{ cookiecutter.package_name }}.monitoring.metrics import read_metrics

from ..helpers import (
    FAST,
    TRAINING_LOSS,
    env_for,
    make_trainer,
    micro_batch_size,
    run_torchrun,
    spawn,
)

DEFAULT_CONFIG = Path(__file__).parents[2] / "configs" / "default.yaml"

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, CompletedProcess[str]]:
    """A first launch: torchrun with 2 gloo ranks trains 8 steps, checkpointing every 4."""
    run_dir = tmp_path_factory.mktemp("two-ranks") / "run"
    return run_dir, run_torchrun(2, [*FAST, f"run.dir={run_dir}", "train.max_steps=8"])


def test_two_ranks_train_and_checkpoint(two_rank_run: tuple[Path, CompletedProcess[str]]) -> None:
    """torchrun with 2 gloo ranks trains and checkpoints every rank's part."""
    run_dir, first = two_rank_run
    assert first.returncode == 0, first.stderr
    assert "2 ranks" in first.stderr
    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint is not None and checkpoint.name == "step_00000008"
    assert {path.name for path in checkpoint.iterdir()} >= {"rank_00000.pt", "rank_00001.pt"}
    losses = [r[TRAINING_LOSS] for r in read_metrics(run_dir) if TRAINING_LOSS in r]
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses)


def test_a_second_launch_resumes_the_two_ranks_and_the_loss_falls(
    two_rank_run: tuple[Path, CompletedProcess[str]], tmp_path: Path
) -> None:
    """A second launch on (a copy of) the first launch's run directory resumes at its step 8
    and trains on to step 16, logging every step once; the loss falls over the 16 steps."""
    first_run, first = two_rank_run
    assert first.returncode == 0, first.stderr
    run_dir = Path(shutil.copytree(first_run, tmp_path / "run"))
    second = run_torchrun(2, [*FAST, f"run.dir={run_dir}", "train.max_steps=16"])
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stderr and "at step 8" in second.stderr
    state = load_checkpoint(latest_checkpoint(run_dir), rank=0, world_size=2).state
    assert (state["step"], state["world_size"]) == (16, 2)

    losses = [r[TRAINING_LOSS] for r in read_metrics(run_dir) if TRAINING_LOSS in r]
    assert [r["step"] for r in read_metrics(run_dir) if TRAINING_LOSS in r] == list(range(2, 17, 2))
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0]


def test_failing_rank_ends_the_job_with_an_error(tmp_path: Path) -> None:
    """A bad setting found after start-up makes every rank exit non-zero instead of hanging:
    a global batch larger than the training set, which only the built data set tells (split
    into micro-batches as the task's rules allow: one per rank for a whole-batch loss)."""
    too_large = [f"train.global_batch_size={2**20}", micro_batch_size(8, 2**20)]
    result = run_torchrun(2, [*FAST, f"run.dir={tmp_path / 'run'}", *too_large], timeout=120)
    assert result.returncode != 0
    assert "smaller than one global batch" in result.stderr


def _train_the_default_config(rank: int, world_size: int, run_dir: Path) -> dict:
    config = load_config(DEFAULT_CONFIG, [f"run.dir={run_dir}", "train.max_steps=3"])
    trainer = make_trainer(config, env_for(rank, world_size))
    return {
        "status": trainer.fit(),
        "split": (trainer.micro_batch_size, trainer.accumulation_steps),
    }


def test_eight_ranks_train_the_default_config_unchanged(tmp_path: Path) -> None:
    """The shipped config on 8 processes: 128 samples per step = 8 ranks x 16, no accumulation."""
    run_dir = tmp_path / "run"
    ranks = spawn(8, _train_the_default_config, run_dir, workdir=tmp_path, timeout=280)
    assert [rank["status"] for rank in ranks] == [0] * 8
    assert {rank["split"] for rank in ranks} == {(16, 1)}
    loaded = load_checkpoint(latest_checkpoint(run_dir), rank=7, world_size=8)
    assert (loaded.state["step"], loaded.world_size) == (3, 8)
