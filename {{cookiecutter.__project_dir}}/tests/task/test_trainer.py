"""The training step and schedule, in a single process."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from pathlib import Path

import pytest
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from {{ cookiecutter.package_name }}.config import Config, ConfigError, DataConfig, load_config
from {{ cookiecutter.package_name }}.contract import warmup_cosine
from {{ cookiecutter.package_name }}.loading.data import usable_cores
from {{ cookiecutter.package_name }}.monitoring.metrics import read_metrics
from {{ cookiecutter.package_name }}.task import Task
from {{ cookiecutter.package_name }}.train import main
from {{ cookiecutter.package_name }}.training.trainer import Trainer, batch_split

from ..helpers import FAST, TRAINING_LOSS, first_part, make_trainer


@pytest.mark.parametrize(
    ("world_size", "split"),
    [(1, (32, 4)), (2, (32, 2)), (4, (32, 1)), (8, (16, 1)), (16, (8, 1)), (64, (2, 1))],
)
def test_the_default_global_batch_splits_on_every_power_of_two_world_size(
    world_size: int, split: tuple[int, int]
) -> None:
    """128 samples per step: micro-batch (at most 32) x accumulation x ranks, 1 to 64 ranks."""
    micro, accumulation = batch_split(128, 32, world_size)
    assert (micro, accumulation) == split
    assert micro * accumulation * world_size == 128


def test_the_micro_batch_is_the_largest_divisor_of_the_per_rank_share_that_fits() -> None:
    """96 samples on 2 ranks = 48 per rank: micro-batches of 24 (not 32, which does not divide)."""
    assert batch_split(96, 32, world_size=2) == (24, 2)


def test_a_global_batch_that_ranks_cannot_share_names_the_nearest_valid_values() -> None:
    with pytest.raises(ConfigError) as error:
        batch_split(128, 16, world_size=3)
    message = str(error.value)
    assert "cannot be shared equally by 3 ranks" in message
    assert "train.global_batch_size=126 or 129" in message
    assert "2 or 4 ranks" in message


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
    losses = [r[TRAINING_LOSS] for r in read_metrics(run_dir) if TRAINING_LOSS in r]
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0]
    assert (run_dir / "config.yaml").is_file()
    assert (run_dir / "train.log").is_file()


def test_logs_evaluations_and_replica_checks_fall_on_their_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each every so many steps, on its own interval, and all of them at the last step."""
    checked: list[int] = []
    monkeypatch.setattr(Trainer, "_check_replicas", lambda self: checked.append(self.step))
    run_dir = tmp_path / "run"
    intervals = ["train.log_every=3", "train.eval_every=5", "dist.check_replicas_every=6"]
    assert main([*FAST, f"run.dir={run_dir}", "train.max_steps=13", *intervals]) == 0
    records = read_metrics(run_dir)
    assert [r["step"] for r in records if TRAINING_LOSS in r] == [3, 6, 9, 12, 13]
    assert [r["step"] for r in records if any(k.startswith("eval/") for k in r)] == [5, 10, 13]
    assert checked == [6, 12, 13]


def test_second_launch_with_the_same_command_resumes(tmp_path: Path) -> None:
    """A finished run launched again resumes at its last step and does not train twice."""
    args = [*FAST, f"run.dir={tmp_path / 'run'}", "train.max_steps=8"]
    assert main(args) == 0
    records = read_metrics(tmp_path / "run")
    assert main(args) == 0
    assert read_metrics(tmp_path / "run") == records


def test_more_loader_workers_than_cores_are_warned_about(
    fast_config: Config, caplog: pytest.LogCaptureFixture
) -> None:
    config = dataclasses.replace(fast_config, data=DataConfig(num_workers=usable_cores() + 1))
    make_trainer(config)
    assert "loader workers on" in caplog.text and "exceed its" in caplog.text


def test_auto_loader_workers_are_said_in_one_line(
    fast_config: Config, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO")
    make_trainer(dataclasses.replace(fast_config, data=DataConfig(num_workers="auto")))
    assert "data.num_workers=auto:" in caplog.text
    assert "exceed its" not in caplog.text


@pytest.mark.parametrize(("norm", "counted"), [(nn.BatchNorm1d, 1), (nn.SyncBatchNorm, 0)])
def test_batch_norm_is_announced_once_and_sync_batch_norm_not(
    norm: type[nn.Module], counted: int, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """BatchNorm normalizes with one rank's micro-batch; SyncBatchNorm with every rank's. The
    task's model may hold BatchNorm layers of its own (a CNN's): they are counted too."""

    class WithNorm(Task):
        def build_model(self) -> nn.Module:
            model = super().build_model()
            first_part(model).added_norm = norm(4)
            return model

    config = load_config(None, [*FAST, f"run.dir={tmp_path}"])
    modules = Task(config.task, seed=config.run.seed).build_model().modules()
    own = sum(isinstance(m, _BatchNorm) and not isinstance(m, nn.SyncBatchNorm) for m in modules)
    with caplog.at_level(logging.WARNING):
        make_trainer(config, task=WithNorm(config.task, seed=config.run.seed))
    said = [r.getMessage() for r in caplog.records if "BatchNorm layer(s)" in r.getMessage()]
    expected = [f"the model has {own + counted} BatchNorm layer(s)"] if own + counted else []
    assert [message.split(":")[0] for message in said] == expected
