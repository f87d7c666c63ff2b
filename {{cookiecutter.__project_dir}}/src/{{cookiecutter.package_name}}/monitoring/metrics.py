"""Metrics sink: rank 0 appends one JSON object per line to `<run.dir>/metrics.jsonl`{% if cookiecutter.tracker != "none" %}
and forwards the same values to the experiment tracker{% endif %}.

Values arrive already reduced across ranks; this module never communicates.
{%- if cookiecutter.tracker != "none" %}

The tracker receives a record only once a checkpoint covers its step (`flush()`, after every
checkpoint write). A run that dies between checkpoints has then sent the tracker nothing that the
resumed run replays, so the tracker holds every step once, with the values of the run that went
on; no tracker has to forget or overwrite a step (W&B ignores a step it has seen, MLflow keeps
both). The price: the tracker's charts move in jumps of `checkpoint.every_steps`, while
metrics.jsonl and the log are written as the steps happen. `<run.dir>/tracker_step` holds the
newest step the tracker has: a resumed run first sends the checkpointed records a crash right
after a checkpoint left unsent, and never sends a step again (after a resume from an older
checkpoint because the newest was unusable, the tracker keeps the values it has for those steps).
{%- endif %}
"""

from __future__ import annotations

import json
import os
from pathlib import Path
{%- if cookiecutter.tracker != "none" %}

from .tracker import Tracker
{%- endif %}

METRICS_FILE = "metrics.jsonl"
{%- if cookiecutter.tracker != "none" %}
TRACKER_STEP_FILE = "tracker_step"
#: What a run on an object store copies into each checkpoint, to continue on another node.
RUN_FILES = (METRICS_FILE, TRACKER_STEP_FILE)
{%- else %}
#: What a run on an object store copies into each checkpoint, to continue on another node.
RUN_FILES = (METRICS_FILE,)
{%- endif %}


class MetricsLogger:
    """Writes on rank 0 only; on the other ranks every call is a no-op."""

    def __init__(self, run_dir: Path, is_main: bool) -> None:
        self.path = run_dir / METRICS_FILE
        self.is_main = is_main
{%- if cookiecutter.tracker != "none" %}
        self.tracker: Tracker | None = None
        self.tracker_step_path = run_dir / TRACKER_STEP_FILE
        self.tracker_step = 0
        self.held: list[tuple[int, dict[str, float]]] = []

    def attach(self, tracker: Tracker) -> None:
        """Send records to `tracker` from now on, first those of metrics.jsonl it lacks.

        Call after resuming: metrics.jsonl then ends at the resumed checkpoint, so every record
        in it is covered by a checkpoint.
        """
        self.tracker = tracker
        if self.tracker_step_path.exists():
            self.tracker_step = int(self.tracker_step_path.read_text())
        self.held = [(record.pop("step"), record) for record in read_metrics(self.path.parent)]
        self.flush()
{%- endif %}

    def log(self, step: int, values: dict[str, float]) -> None:
        """Append one record; `values` uses names such as "train/loss" or "eval/accuracy"."""
        if not self.is_main:
            return
        with open(self.path, "a") as handle:
            handle.write(json.dumps({"step": step, **values}) + "\n")
{%- if cookiecutter.tracker != "none" %}
        if self.tracker is not None:
            self.held.append((step, dict(values)))
{%- endif %}

    def flush(self, through: int | None = None) -> None:
{%- if cookiecutter.tracker != "none" %}
        """Send the records held back, up to step `through` (default: all of them), to the
        tracker; call once a checkpoint covers them. A checkpoint written in the background
        completes while later steps are logged: those stay held."""
        if self.tracker is None:
            return
        covered = [record for record in self.held if through is None or record[0] <= through]
        if not covered:
            return
        for step, values in covered:
            if step > self.tracker_step:
                self.tracker.log(step, values)
        self.tracker_step = max(self.tracker_step, covered[-1][0])
        self.held = self.held[len(covered) :]
        tmp = self.tracker_step_path.with_name(TRACKER_STEP_FILE + ".partial")
        tmp.write_text(f"{self.tracker_step}\n")
        os.replace(tmp, self.tracker_step_path)
{%- else %}
        """Nothing is held back: without a tracker, each record is written as it comes."""
{%- endif %}

    def truncate_after(self, step: int) -> None:
        """Drop records past `step`, written by a run that died before its next checkpoint.

        A resumed run replays those steps; without this, metrics.jsonl would hold them twice.
        """
        if not self.is_main or not self.path.exists():
            return
        records = [record for record in read_metrics(self.path.parent) if record["step"] <= step]
        tmp = self.path.with_name(self.path.name + ".partial")
        tmp.write_text("".join(json.dumps(record) + "\n" for record in records))
        os.replace(tmp, self.path)

    def set_aside(self, label: str) -> Path | None:
        """Keep the records of an earlier run under `metrics.<label>.jsonl` (a new run starts
        in this run directory); returns where they are, or None when there were none."""
        if not self.is_main or not self.path.exists():
            return None
        kept = self.path.with_name(f"{self.path.stem}.{label}{self.path.suffix}")
        os.replace(self.path, kept)
{%- if cookiecutter.tracker != "none" %}
        if self.tracker_step_path.exists():
            os.replace(
                self.tracker_step_path,
                self.tracker_step_path.with_name(f"{TRACKER_STEP_FILE}.{label}"),
            )
{%- endif %}
        return kept

    def close(self) -> None:
{%- if cookiecutter.tracker != "none" %}
        """End the tracker's run; records no checkpoint covers are dropped, a resume sends them."""
        if self.tracker is not None:
            self.tracker.close()
{%- else %}
        """Nothing to release: every record is flushed as it is written."""
{%- endif %}


def read_metrics(run_dir: Path) -> list[dict]:
    """All records of a run, in order (for tests, notebooks and plots)."""
    path = run_dir / METRICS_FILE
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a crash mid-write
    return records
