"""Plot a run without a tracker: `python -m <package>.plot RUN_DIR [--out FILE]`.

Reads `RUN_DIR/metrics.jsonl` and writes one PNG (default `RUN_DIR/metrics.png`) with a panel
each for the train and eval loss, the learning rate and the throughput, against the step. Needs
matplotlib, an optional extra (`pip install -e '.[plot]'`), so that training never depends on it.
It draws with the Agg renderer: no display is needed, on a login node or in a batch job.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .monitoring.metrics import METRICS_FILE, read_metrics

if TYPE_CHECKING:
    from matplotlib.axes import Axes

#: The PNG's size in pixels (width, height), at DPI dots per inch.
SIZE_PX = (800, 900)
DPI = 100
#: The job's throughput, in the task's unit (`train/samples_per_s`, `train/tokens_per_s`).
THROUGHPUT_KEY = re.compile(r"train/(\w+)_per_s")


class PlotError(Exception):
    """What is wrong with the run directory or the environment, and how to fix it."""


def plot_run(run_dir: Path, out: Path) -> Path:
    """Write the plot of the run in `run_dir` to `out`; returns `out`."""
    records = read_metrics(run_dir)
    if not records:
        raise PlotError(
            f"no metrics in {run_dir / METRICS_FILE} (missing or empty): pass a run directory "
            "(the run.dir of a training run) that has logged at least one step"
        )
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise PlotError("plotting needs matplotlib: pip install -e '.[plot]'") from error

    figure = Figure(figsize=(SIZE_PX[0] / DPI, SIZE_PX[1] / DPI), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    loss, lr, speed = figure.subplots(3, 1, sharex=True)
    _draw(loss, records, "train/loss", "train")
    _draw(loss, records, "eval/loss", "eval", style="o-")
    loss.set_ylabel("loss")
    loss.legend()
    _draw(lr, records, "train/lr")
    lr.set_ylabel("learning rate")
    throughput = next((key for r in records for key in r if THROUGHPUT_KEY.fullmatch(key)), None)
    if throughput is not None:
        _draw(speed, records, throughput)
        speed.set_ylabel(throughput.removeprefix("train/").replace("_per_s", "/s"))
    speed.set_xlabel("step")
    figure.suptitle(str(run_dir))
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, format="png")
    return out


def _draw(axes: Axes, records: list[dict], key: str, label: str = "", style: str = "-") -> None:
    points = [(record["step"], record[key]) for record in records if key in record]
    if points:
        steps, values = zip(*points, strict=True)
        axes.plot(steps, values, style, label=label or key)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__package__}.plot",
        description="Plot loss, learning rate and throughput of a run from its metrics.jsonl.",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run's run.dir")
    parser.add_argument("--out", type=Path, help="PNG to write (default: RUN_DIR/metrics.png)")
    args = parser.parse_args(argv)
    try:
        out = plot_run(args.run_dir, args.out or args.run_dir / "metrics.png")
    except PlotError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
