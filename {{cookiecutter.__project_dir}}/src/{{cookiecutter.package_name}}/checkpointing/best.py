"""The best checkpoint by an evaluation metric (best.*), and stopping early when it stalls.

The evaluation's metrics are reduced over every rank before they reach here, so every rank
comes to the same verdict at the same step without another collective: all of them save the
new best together, and all of them stop early together. The verdict's state (best value, its
step, evaluations since) is in every checkpoint, so a resumed run judges as the unbroken one
would; `<run.dir>/best.json` names the best checkpoint for people and scripts.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from ..config import BestConfig, ConfigError
from .checkpoint import atomic_write_text
from .layout import checkpoint_root

log = logging.getLogger(__name__)

BEST_FILE = "best.json"


class BestCheckpoint:
    """Which step's evaluation was the best so far, and how many evaluations since."""

    def __init__(self, config: BestConfig) -> None:
        self.config = config
        self.value: float | None = None
        self.step: int | None = None
        self.evaluations_since = 0

    @property
    def enabled(self) -> bool:
        return bool(self.config.metric)

    @property
    def checkpoint_name(self) -> str | None:
        """The directory name of the best step's checkpoint, which pruning keeps."""
        return None if self.step is None else f"step_{self.step:08d}"

    @property
    def exhausted(self) -> bool:
        """Whether `best.patience` evaluations in a row brought no improvement."""
        return 0 < self.config.patience <= self.evaluations_since

    def update(self, step: int, record: dict[str, float]) -> bool:
        """Whether the evaluation `record` (metrics.jsonl's names) is a new best.

        A non-finite value is never the best. Raises ConfigError when the record has no
        `best.metric`, listing those it has.
        """
        if not self.enabled:
            return False
        metric = self.config.metric
        if metric not in record:
            raise ConfigError(
                f"best.metric={metric} is not a metric of the evaluation, which records "
                f"{', '.join(sorted(record))}. Set best.metric to one of them."
            )
        value = record[metric]
        if self.value is None:
            improved = math.isfinite(value)
        else:
            gain = self.value - value if self.config.mode == "min" else value - self.value
            improved = gain > self.config.min_delta  # False for NaN
        if improved:
            self.value, self.step, self.evaluations_since = value, step, 0
        else:
            self.evaluations_since += 1
        return improved

    def write(self, run_dir: Path) -> None:
        """Name the best checkpoint in `<run.dir>/best.json` (rank 0, after it was saved)."""
        record = {
            "metric": self.config.metric,
            "mode": self.config.mode,
            "value": self.value,
            "step": self.step,
            "checkpoint": str(checkpoint_root(run_dir) / str(self.checkpoint_name)),
        }
        atomic_write_text(run_dir / BEST_FILE, json.dumps(record, indent=2) + "\n")

    def describe(self) -> str:
        return f"best {self.config.metric} {self.value:.4f} at step {self.step}"

    def state_dict(self) -> dict[str, Any]:
        return {
            "metric": self.config.metric,
            "mode": self.config.mode,
            "value": self.value,
            "step": self.step,
            "evaluations_since": self.evaluations_since,
        }

    def load_state_dict(self, state: dict[str, Any] | None, announce: bool) -> None:
        """The checkpoint's verdict, if it judged by the same metric and direction."""
        if not self.enabled or not state or not state.get("metric"):
            return
        if (state["metric"], state["mode"]) != (self.config.metric, self.config.mode):
            if announce:
                log.info(
                    "best.metric or best.mode changed since the checkpoint (%s, %s): the best "
                    "is chosen afresh from now",
                    state["metric"],
                    state["mode"],
                )
            return
        self.value, self.step = state["value"], state["step"]
        self.evaluations_since = state["evaluations_since"]
