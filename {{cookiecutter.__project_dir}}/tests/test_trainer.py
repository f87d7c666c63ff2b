"""The training step and schedule, in a single process."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

from {{ cookiecutter.package_name }}.config import ConfigError
from {{ cookiecutter.package_name }}.metrics import read_metrics
from {{ cookiecutter.package_name }}.train import main
from {{ cookiecutter.package_name }}.trainer import (
    accumulation_steps,
    warmup_cosine,
)

from .helpers import FAST


def test_accumulation_is_derived_from_the_global_batch() -> None:
    """global 128 = 2 ranks x micro 16 x 4 accumulation steps."""
    assert accumulation_steps(128, 16, world_size=2) == 4
    assert accumulation_steps(128, 16, world_size=8) == 1


def test_global_batch_that_does_not_divide_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="not a multiple of world size 3"):
        accumulation_steps(128, 16, world_size=3)


def test_lr_warms_up_then_decays_to_the_floor() -> None:
    schedule = [
        warmup_cosine(step, warmup_steps=10, total_steps=100, min_lr_ratio=0.1)
        for step in range(100)
    ]
    assert schedule[0] == pytest.approx(0.1)
    assert schedule[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(schedule[9:]))
    assert warmup_cosine(100, 10, 100, 0.1) == pytest.approx(0.1)


@pytest.mark.parametrize("precision", ["bf16", "fp16", "none"])
def test_single_process_training_lowers_the_loss(tmp_path: Path, precision: str) -> None:
    """Each precision trains on CPU without a process group and writes its metrics."""
    run_dir = tmp_path / "run"
    assert (
        main(
            [
                *FAST,
                f"run.dir={run_dir}",
                "train.max_steps=24",
                f"train.mixed_precision={precision}",
            ]
        )
        == 0
    )
    losses = [r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r]
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0]
    assert (run_dir / "config.yaml").is_file()
    assert (run_dir / "train.log").is_file()


def test_second_launch_with_the_same_command_resumes(tmp_path: Path) -> None:
    """A finished run launched again resumes at its last step and does not train twice."""
    args = [*FAST, f"run.dir={tmp_path / 'run'}", "train.max_steps=8"]
    assert main(args) == 0
    records = read_metrics(tmp_path / "run")
    assert main(args) == 0
    assert read_metrics(tmp_path / "run") == records
