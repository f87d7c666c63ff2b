"""The {{ cookiecutter.tracker }} tracker receives the same metrics as metrics.jsonl."""

from __future__ import annotations

from pathlib import Path
{%- if cookiecutter.tracker == "wandb" %}

import pytest
{%- elif cookiecutter.tracker == "mlflow" %}

import mlflow
{%- endif %}

from {{ cookiecutter.package_name }}.train import main

from .helpers import FAST
{%- if cookiecutter.tracker == "wandb" %}


@pytest.fixture(autouse=True)
def offline_wandb(monkeypatch: pytest.MonkeyPatch) -> None:
    """Log to local files only: tests need no account and no network."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
{%- endif %}


def test_training_writes_to_the_tracker(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert main([*FAST, f"run.dir={run_dir}", "train.max_steps=4"]) == 0
{%- if cookiecutter.tracker == "tensorboard" %}
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
{%- elif cookiecutter.tracker == "wandb" %}
    assert (run_dir / "wandb_run_id").is_file()
    assert list((run_dir / "wandb").glob("offline-run-*"))
{%- elif cookiecutter.tracker == "mlflow" %}
    run_id = (run_dir / "mlflow_run_id").read_text()
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{(run_dir / 'mlflow.db').resolve()}")
    history = client.get_metric_history(run_id, "train/loss")
    assert [point.step for point in history] == [2, 4]
{%- endif %}


def test_tracker_can_be_switched_off(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert main([*FAST, f"run.dir={run_dir}", "train.max_steps=2", "tracker.enabled=false"]) == 0
{%- if cookiecutter.tracker == "tensorboard" %}
    assert not (run_dir / "tensorboard").exists()
{%- elif cookiecutter.tracker == "wandb" %}
    assert not (run_dir / "wandb_run_id").exists()
{%- elif cookiecutter.tracker == "mlflow" %}
    assert not (run_dir / "mlflow_run_id").exists()
{%- endif %}
