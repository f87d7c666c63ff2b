"""A resumed run is never silently different from what its config says: each changed setting is
refused or applied, in one log line per key, and a run directory never mixes two runs."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import {{ cookiecutter.package_name }}.config as config_module
from {{ cookiecutter.package_name }}.checkpointing.layout import complete_checkpoints
from {{ cookiecutter.package_name }}.checkpointing.resume import ResumeError
from {{ cookiecutter.package_name }}.config import Config, load_config
from {{ cookiecutter.package_name }}.contract import TaskBase, warmup_cosine
from {{ cookiecutter.package_name }}.monitoring.metrics import METRICS_FILE, read_metrics
from {{ cookiecutter.package_name }}.task import Task, TaskConfig
from {{ cookiecutter.package_name }}.train import main
from {{ cookiecutter.package_name }}.training.trainer import Trainer

from ..helpers import FAST, TRAINING_LOSS, make_trainer, train_steps

SAVED_AT = 4


def _overrides(run_dir: Path, *extra: str) -> list[str]:
    return [*FAST, f"run.dir={run_dir}", "train.max_steps=12", *extra]


class OneGroup(Task):
    """The project's task with the default optimizer group, AdamW and schedule, which set no
    option of their own: every optim.* setting applies to them, whatever the task builds."""

    param_groups = TaskBase.param_groups
    build_optimizer = TaskBase.build_optimizer
    build_scheduler = TaskBase.build_scheduler


def _trainer(*overrides: str) -> Trainer:
    config = load_config(None, list(overrides))
    return make_trainer(config, task=OneGroup(config.task, seed=config.run.seed))


def _resume_with(tmp_path: Path, *changed: str) -> Trainer:
    """Save a checkpoint at step 4 with the FAST settings, then resume it with `changed`."""
    trainer = _trainer(*_overrides(tmp_path))
    train_steps(trainer, SAVED_AT)
    trainer.save()
    resumed = _trainer(*_overrides(tmp_path, *changed))
    assert resumed.resume()
    return resumed


def test_a_changed_learning_rate_is_applied_from_the_current_step_and_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        resumed = _resume_with(tmp_path, "optim.lr=0.001")
    expected = 0.001 * warmup_cosine(SAVED_AT, 20, 12, 0.1)
    assert resumed.updates[0].optimizer.param_groups[0]["lr"] == pytest.approx(expected)
    assert resumed.updates[0].scheduler.base_lrs == [0.001]
    assert "optim.lr changed from 0.003 to 0.001: applied" in caplog.text


def test_changed_weight_decay_and_betas_reach_the_optimizer(tmp_path: Path) -> None:
    resumed = _resume_with(tmp_path, "optim.weight_decay=0.5", "optim.betas=[0.8,0.9]")
    group = resumed.updates[0].optimizer.param_groups[0]
    assert (group["weight_decay"], tuple(group["betas"])) == (0.5, (0.8, 0.9))


def test_a_longer_run_stretches_the_schedule_to_its_new_end(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        resumed = _resume_with(tmp_path, "train.max_steps=40", "optim.warmup_steps=2")
    expected = 0.003 * warmup_cosine(SAVED_AT, 2, 40, 0.1)
    assert resumed.updates[0].optimizer.param_groups[0]["lr"] == pytest.approx(expected)
    assert "train.max_steps changed from 12 to 40: applied" in caplog.text
    assert "optim.warmup_steps changed from 20 to 2: applied" in caplog.text


def test_unchanged_settings_resume_without_a_word_about_changes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        _resume_with(tmp_path)
    assert "changed from" not in caplog.text


def test_turning_fp16_on_at_resume_starts_a_fresh_loss_scaler(tmp_path: Path) -> None:
    resumed = _resume_with(tmp_path, "train.mixed_precision=fp16")
    assert resumed.updates[0].scaler.is_enabled()
    assert resumed.updates[0].scaler.get_scale() == 2.0**16


@dataclass
class TaskConfigWithExtra(TaskConfig):
    """The task's settings and one more, so that the test needs to know none of the task's."""

    #: A task setting that the task itself does not read.
    extra: int = 1


@dataclass
class ConfigWithExtra(Config):
    task: TaskConfigWithExtra = field(default_factory=TaskConfigWithExtra)


@pytest.mark.parametrize("change", ["run.seed=99", "task.extra=2", "train.global_batch_size=64"])
def test_changes_that_would_make_it_another_run_are_refused_by_name(
    tmp_path: Path, change: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(config_module, "Config", ConfigWithExtra)
    key = change.partition("=")[0]
    with pytest.raises(ResumeError, match=rf"{key} .*another run\.dir"):
        _resume_with(tmp_path, change)


def test_resume_false_in_a_directory_with_checkpoints_is_refused_and_changes_nothing(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    assert main(_overrides(run_dir, "train.max_steps=4")) == 0
    checkpoints, records = complete_checkpoints(run_dir), read_metrics(run_dir)
    capfd.readouterr()
    assert main(_overrides(run_dir, "checkpoint.resume=false")) == 2
    error = capfd.readouterr().err
    assert "ERROR" in error and "holds checkpoints of an earlier run" in error
    assert "Use a new run.dir" in error
    assert complete_checkpoints(run_dir) == checkpoints
    assert read_metrics(run_dir) == records


def test_a_run_that_died_before_its_first_checkpoint_leaves_no_records_behind(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dead = {"step": 2, TRAINING_LOSS: 99.0}
    (run_dir / METRICS_FILE).write_text(json.dumps(dead) + "\n")
    assert main(_overrides(run_dir, "train.max_steps=4")) == 0
    records = read_metrics(run_dir)
    assert dead not in records
    assert [record["step"] for record in records if TRAINING_LOSS in record] == [2, 4]
