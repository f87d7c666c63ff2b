"""The {{ cookiecutter.tracker }} tracker receives the same metrics as metrics.jsonl, each step once."""

from __future__ import annotations

{% if cookiecutter.tracker == "mlflow" -%}
import os
{% endif -%}
from pathlib import Path
{% if cookiecutter.tracker == "mlflow" %}
import mlflow
{%- endif %}
import pytest
{%- if cookiecutter.tracker == "tensorboard" %}
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
{%- endif %}

from {{ cookiecutter.package_name }}.monitoring.metrics import TRACKER_STEP_FILE, MetricsLogger, read_metrics
{%- if cookiecutter.tracker == "wandb" %}
from {{ cookiecutter.package_name }}.monitoring.tracker import Tracker
{%- endif %}
from {{ cookiecutter.package_name }}.train import main
from {{ cookiecutter.package_name }}.training.trainer import Trainer

from ..helpers import FAST, TRAINING_LOSS

TOTAL_STEPS = 10
CRASH_AT_STEP = 7  # checkpoint at 4; steps 5-6 are trained and logged (loss at 6), then lost
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
    assert _tracked_steps(run_dir, TRAINING_LOSS) == [2, 4]
{%- endif %}


{%- if cookiecutter.tracker == "mlflow" %}


def test_the_mlflow_store_is_mlflow_tracking_uri_else_one_in_the_run_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "shared.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}")
    assert main([*FAST, f"run.dir={tmp_path / 'shared'}", "train.max_steps=2"]) == 0
    assert store.is_file()
    assert not (tmp_path / "shared" / "mlflow.db").exists()
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert main([*FAST, f"run.dir={tmp_path / 'own'}", "train.max_steps=2"]) == 0
    assert (tmp_path / "own" / "mlflow.db").is_file()
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


class Crash(RuntimeError):
    pass


{%- if cookiecutter.tracker == "wandb" %}


@pytest.fixture(autouse=True)
def wandb_steps(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """Metric name -> the steps it was sent to W&B at (an offline run cannot be read back)."""
    steps: dict[str, list[int]] = {}
    log = Tracker.log

    def recording_log(self: Tracker, step: int, values: dict[str, float]) -> None:
        for name in values:
            steps.setdefault(name, []).append(step)
        log(self, step, values)

    monkeypatch.setattr(Tracker, "log", recording_log)
    return steps
{%- endif %}


@pytest.fixture
def crashed_and_resumed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A run that crashes 3 steps after its last checkpoint, then resumes and finishes."""
    run_dir = tmp_path / "run"
    overrides = [*FAST, f"run.dir={run_dir}", f"train.max_steps={TOTAL_STEPS}"]
    train_step = Trainer.train_step

    def crash_at_step(self: Trainer, batches: object) -> object:
        if self.step + 1 == CRASH_AT_STEP:
            raise Crash
        return train_step(self, batches)

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "train_step", crash_at_step)
        with pytest.raises(Crash):
            main(overrides)
    assert main(overrides) == 0
    return run_dir
{%- if cookiecutter.tracker == "tensorboard" %}


def _tracked_steps(run_dir: Path, name: str) -> list[int]:
    """The steps of `name` in every event file, the files in the order they were written.

    Each launch writes a file of its own, named `...<host>.<pid>.<counter>`: launches in one
    second of one process (a test's crash and resume) differ by the counter alone, which
    TensorBoard's directory reader sorts as text (.10 before .9).
    """
    files = sorted(
        (run_dir / "tensorboard").glob("events.out.tfevents.*"),
        key=lambda path: int(path.name.rsplit(".", 1)[-1]),
    )
    steps = []
    for path in files:
        events = EventAccumulator(str(path))
        events.Reload()
        if name in events.Tags()["scalars"]:
            steps += [event.step for event in events.Scalars(name)]
    return steps
{%- elif cookiecutter.tracker == "mlflow" %}


def _tracked_steps(run_dir: Path, name: str) -> list[int]:
    local_store = f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
    client = mlflow.MlflowClient(tracking_uri=os.environ.get("MLFLOW_TRACKING_URI", local_store))
    history = client.get_metric_history((run_dir / "mlflow_run_id").read_text(), name)
    return sorted(point.step for point in history)
{%- endif %}


def _metric(records: list[dict], kind: str) -> str:
    """The training loss, or the first of the metrics the task's evaluation reports."""
    if kind == "train":
        return TRAINING_LOSS
    return min(key for record in records for key in record if key.startswith("eval/"))


@pytest.mark.parametrize("kind", ["train", "eval"])
{%- if cookiecutter.tracker == "wandb" %}
def test_a_resumed_run_sends_each_step_once(
    crashed_and_resumed: Path, kind: str, wandb_steps: dict[str, list[int]]
) -> None:
{%- else %}
def test_a_resumed_run_sends_each_step_once(crashed_and_resumed: Path, kind: str) -> None:
{%- endif %}
    records = read_metrics(crashed_and_resumed)
    name = _metric(records, kind)
    in_jsonl = [record["step"] for record in records if name in record]
    assert in_jsonl == (list(range(2, 11, 2)) if kind == "train" else [4, 8, 10])
{%- if cookiecutter.tracker == "wandb" %}
    assert wandb_steps[name] == in_jsonl
    assert len(list((crashed_and_resumed / "wandb").glob("offline-run-*"))) == 2
{%- else %}
    assert _tracked_steps(crashed_and_resumed, name) == in_jsonl
{%- endif %}


# --- what the tracker is sent, and when ----------------------------------------------------


class RecordingTracker:
    def __init__(self) -> None:
        self.steps: list[int] = []

    def log(self, step: int, values: dict[str, float]) -> None:
        self.steps.append(step)


def _logger(run_dir: Path, steps: list[int], tracker_step: int | None = None) -> MetricsLogger:
    """A logger whose metrics.jsonl holds `steps`, as after a resume."""
    run_dir.mkdir(parents=True, exist_ok=True)
    logger = MetricsLogger(run_dir, is_main=True)
    for step in steps:
        logger.log(step, {"train/loss": 1.0})
    if tracker_step is not None:
        (run_dir / TRACKER_STEP_FILE).write_text(f"{tracker_step}\n")
    return logger


def test_records_reach_the_tracker_once_a_checkpoint_covers_them(tmp_path: Path) -> None:
    logger, tracker = _logger(tmp_path, []), RecordingTracker()
    logger.attach(tracker)
    logger.log(2, {"train/loss": 1.0})
    logger.log(4, {"train/loss": 1.0})
    assert tracker.steps == []
    logger.flush()
    assert tracker.steps == [2, 4]
    assert (tmp_path / TRACKER_STEP_FILE).read_text() == "4\n"


def test_a_resume_first_sends_the_checkpointed_records_the_tracker_missed(tmp_path: Path) -> None:
    """A crash between a checkpoint write and the flush after it."""
    logger, tracker = _logger(tmp_path, [2, 4, 6, 8], tracker_step=4), RecordingTracker()
    logger.attach(tracker)
    assert tracker.steps == [6, 8]


def test_steps_the_tracker_holds_are_not_sent_again(tmp_path: Path) -> None:
    """A resume from an older checkpoint, because the newest could not be loaded."""
    logger, tracker = _logger(tmp_path, [2, 4], tracker_step=8), RecordingTracker()
    logger.attach(tracker)
    for step in (6, 8, 10):
        logger.log(step, {"train/loss": 1.0})
    logger.flush()
    assert tracker.steps == [10]
    assert (tmp_path / TRACKER_STEP_FILE).read_text() == "10\n"
