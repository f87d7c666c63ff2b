"""ema.decay: a moving average of the weights, evaluated beside them and kept in checkpoints
(its resume through a killed rank on 2 ranks is in test_restart.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }}.config import load_config
from {{ cookiecutter.package_name }}.monitoring.metrics import read_metrics
from {{ cookiecutter.package_name }}.training.trainer import Trainer

from ..helpers import FAST, make_trainer, train_steps


def _trainer(run_dir: Path, *extra: str) -> Trainer:
    return make_trainer(
        load_config(None, [*FAST, f"run.dir={run_dir}", "train.max_steps=8", *extra])
    )


def _floating(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in state.items() if value.is_floating_point()}


def test_the_average_follows_the_weights_with_the_configured_decay(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, "ema.decay=0.75")
    first = _floating(train_steps(trainer, 1))
    average = trainer.ema.module.state_dict()
    for name, value in first.items():
        assert torch.equal(average[name], value), name  # the first update copies
    second = _floating(train_steps(trainer, 1))
    average = trainer.ema.module.state_dict()
    for name, value in second.items():
        expected = 0.75 * first[name] + 0.25 * value
        torch.testing.assert_close(
            average[name], expected, msg=lambda default, name=name: f"{name}: {default}"
        )


def test_each_evaluation_also_reports_the_average(tmp_path: Path) -> None:
    _trainer(tmp_path, "ema.decay=0.9").fit()
    records = [r for r in read_metrics(tmp_path) if any(key.startswith("eval/") for key in r)]
    assert records
    for record in records:
        own = {key.removeprefix("eval/") for key in record if key.startswith("eval/")}
        averaged = {key.removeprefix("eval_ema/") for key in record if key.startswith("eval_ema/")}
        assert own == averaged


def test_without_ema_nothing_is_averaged_or_reported(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path)
    trainer.fit()
    assert trainer.ema is None and trainer.state_dict()["ema"] is None
    assert not any(key.startswith("eval_ema/") for r in read_metrics(tmp_path) for key in r)


def test_turning_ema_on_at_resume_starts_the_average_from_the_resumed_weights(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _trainer(tmp_path, "train.max_steps=4").fit()
    with caplog.at_level(logging.INFO):
        resumed = _trainer(tmp_path, "ema.decay=0.9")
        assert resumed.resume()
    assert "ema.decay is on from now" in caplog.text
    assert resumed.ema.n_averaged == 0  # the next update copies the weights, then averages
    after_one_step = _floating(train_steps(resumed, 1))
    average = resumed.ema.module.state_dict()
    for name, value in after_one_step.items():
        assert torch.equal(average[name], value), name
