"""Metrics sink: rank 0 appends one JSON object per line to `<run.dir>/metrics.jsonl`{% if cookiecutter.tracker != "none" %}
and forwards the same values to the experiment tracker{% endif %}.

Values arrive already reduced across ranks; this module never communicates.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
{%- if cookiecutter.tracker != "none" %}

from .tracker import Tracker
{%- endif %}

METRICS_FILE = "metrics.jsonl"


class MetricsLogger:
    """Writes on rank 0 only; on the other ranks every call is a no-op."""

    def __init__(self, run_dir: Path, is_main: bool{% if cookiecutter.tracker != "none" %}, tracker: Tracker | None = None{% endif %}) -> None:
        self.path = run_dir / METRICS_FILE
        self.is_main = is_main
{%- if cookiecutter.tracker != "none" %}
        self.tracker = tracker
{%- endif %}

    def log(self, step: int, values: dict[str, float]) -> None:
        """Append one record; `values` uses names such as "train/loss" or "eval/accuracy"."""
        if not self.is_main:
            return
        with open(self.path, "a") as handle:
            handle.write(json.dumps({"step": step, **values}) + "\n")
{%- if cookiecutter.tracker != "none" %}
        if self.tracker is not None:
            self.tracker.log(step, values)
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

    def close(self) -> None:
{%- if cookiecutter.tracker != "none" %}
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
