"""The classifier example: its FLOPs and what it learns. Replace this file with your task's."""

from __future__ import annotations

from pathlib import Path

import pytest

from {{ cookiecutter.package_name }}.config import load_config
from {{ cookiecutter.package_name }}.task import Task, TaskConfig

from ..helpers import FAST, make_trainer


def test_flops_per_sample_match_a_hand_count() -> None:
    """6 per weight of the three matrices (2 forward, 4 backward); biases are not counted."""
    task = Task(TaskConfig(input_dim=12, hidden_dim=16, num_classes=5), seed=0)
    weights = 12 * 16 + 16 * 16 + 16 * 5
    assert task.flops_per_sample(task.build_model()) == 6 * weights


def test_training_lifts_the_accuracy_from_chance(tmp_path: Path) -> None:
    """From about 1 / num_classes (a guess) to well above it in 30 steps."""
    overrides = ["train.max_steps=30", "optim.lr=0.03", "optim.warmup_steps=2"]
    config = load_config(None, [*FAST, f"run.dir={tmp_path}", *overrides])
    trainer = make_trainer(config)
    before = trainer.evaluate()["accuracy"]
    assert trainer.fit() == 0
    after = trainer.evaluate()["accuracy"]
    assert before == pytest.approx(1 / config.task.num_classes, abs=0.1)
    assert after > 0.7
