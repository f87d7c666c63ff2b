"""`python -m <package>.plot RUN_DIR` draws a run's metrics.jsonl into one PNG."""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
from pathlib import Path

import pytest

from {{ cookiecutter.package_name }}.config import load_config
from {{ cookiecutter.package_name }}.monitoring.metrics import METRICS_FILE
from {{ cookiecutter.package_name }}.plot import SIZE_PX, main

from ..helpers import FAST, make_trainer

needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None,
    reason="matplotlib is an optional extra: pip install -e '.[plot]'",
)


def _png_size(path: Path) -> tuple[int, int]:
    """Width and height from the PNG signature and header chunk; fails on anything else."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@needs_matplotlib
def test_a_trained_run_plots_to_a_png_of_the_documented_size(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    make_trainer(load_config(None, [*FAST, f"run.dir={run_dir}", "train.max_steps=4"])).fit()
    out = tmp_path / "plots" / "run.png"
    assert main([str(run_dir), "--out", str(out)]) == 0
    assert _png_size(out) == SIZE_PX


@needs_matplotlib
def test_a_run_without_evaluation_still_plots(tmp_path: Path) -> None:
    records = [
        {"step": step, "train/loss": 1 / step, "train/lr": 1e-3, "train/samples_per_s": 100.0}
        for step in (10, 20, 30)
    ]
    (tmp_path / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main([str(tmp_path)]) == 0
    assert _png_size(tmp_path / "metrics.png") == SIZE_PX


@pytest.mark.parametrize("content", [None, ""], ids=["missing", "empty"])
def test_a_run_without_metrics_is_an_error(
    tmp_path: Path, content: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    if content is not None:
        (tmp_path / METRICS_FILE).write_text(content)
    assert main([str(tmp_path)]) == 2
    assert f"error: no metrics in {tmp_path / METRICS_FILE}" in capsys.readouterr().err
    assert not (tmp_path / "metrics.png").exists()


def test_without_matplotlib_the_error_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for module in ("matplotlib", "matplotlib.backends.backend_agg", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, module, None)  # makes the import fail
    (tmp_path / METRICS_FILE).write_text(json.dumps({"step": 1, "train/loss": 1.0}) + "\n")
    assert main([str(tmp_path)]) == 2
    assert "pip install -e '.[plot]'" in capsys.readouterr().err
