{%- if cookiecutter.tracker == "tensorboard" -%}
"""TensorBoard event files in `<run.dir>/tensorboard` (view with `tensorboard --logdir runs`)."""

from __future__ import annotations

from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

from ..config import Config


class Tracker:
    """Created on rank 0 only; a resumed run adds events to the same directory.

    It receives each step once (see metrics.py), so no purge of replayed steps is needed.
    """

    def __init__(self, config: Config, run_dir: Path) -> None:
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
{%- elif cookiecutter.tracker == "wandb" -%}
"""Weights & Biases run; resumed runs continue the same W&B run.

Set `WANDB_MODE=offline` to log without an account (sync later with `wandb sync`).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import wandb

from ..config import Config

RUN_ID_FILE = "wandb_run_id"


class Tracker:
    """Created on rank 0 only. The run id is kept in the run directory: a restart resumes it."""

    def __init__(self, config: Config, run_dir: Path) -> None:
        id_file = run_dir / RUN_ID_FILE
        if not id_file.exists():
            id_file.write_text(uuid.uuid4().hex[:16])
        self.run = wandb.init(
            project=config.tracker.project,
            id=id_file.read_text().strip(),
            resume="allow",
            dir=str(run_dir),
            config=config.to_dict(),
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()
{%- elif cookiecutter.tracker == "mlflow" -%}
"""MLflow run; resumed runs continue the same MLflow run.

The store is `tracker.tracking_uri`, else the MLFLOW_TRACKING_URI environment variable (as
for any MLflow client), else the SQLite file `<run.dir>/mlflow.db` (view with
`mlflow ui --backend-store-uri sqlite:///<run.dir>/mlflow.db`).
"""

from __future__ import annotations

import os
from pathlib import Path

import mlflow

from ..config import Config, flatten

RUN_ID_FILE = "mlflow_run_id"


class Tracker:
    """Created on rank 0 only. The run id is kept in the run directory: a restart resumes it."""

    def __init__(self, config: Config, run_dir: Path) -> None:
        local_store = f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
        environment = os.environ.get("MLFLOW_TRACKING_URI", "")
        mlflow.set_tracking_uri(config.tracker.tracking_uri or environment or local_store)
        mlflow.set_experiment(config.tracker.project)
        id_file = run_dir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else None
        self.run = mlflow.start_run(run_id=run_id)
        if run_id is None:
            id_file.write_text(self.run.info.run_id)
            mlflow.log_params(flatten(config.to_dict()))

    def log(self, step: int, values: dict[str, float]) -> None:
        mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        mlflow.end_run()

{%- endif %}
