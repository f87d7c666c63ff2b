"""The benchmark scripts run under torchrun on 2 gloo ranks and report figures that add up.

Tiny sizes: these check that the scripts work and compute what they claim, not the speed.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..helpers import FAST, run_torchrun

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

pytestmark = pytest.mark.distributed


def test_allreduce_reports_bus_bandwidth_as_nccl_tests_define_it(tmp_path: Path) -> None:
    report = tmp_path / "allreduce.json"
    options = ["--min-size=4K", "--max-size=64K", "--iters=3", "--warmup=1", f"--json={report}"]
    result = run_torchrun(2, options, timeout=120, entry=BENCHMARKS / "allreduce.py")
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(report.read_text())
    n = record["world_size"]
    assert n == 2
    assert [row["bytes"] for row in record["results"]] == [4096, 16384, 65536]
    for row in record["results"]:
        assert row["backend"] == "gloo"
        assert row["time_us"] > 0
        assert row["algbw_gbps"] == pytest.approx(row["bytes"] / row["time_us"] / 1e3)
        assert math.isclose(row["busbw_gbps"], row["algbw_gbps"] * 2 * (n - 1) / n)
    assert "busbw (GB/s)" in result.stdout


def test_overhead_trains_the_same_weights_with_the_trainer_and_the_plain_loop(
    tmp_path: Path,
) -> None:
    report = tmp_path / "overhead.json"
    # 21 steps of 16 per epoch: the second epoch's order is compared too.
    options = ["--warmup-steps=10", "--steps=10", "--repeats=1", f"--json={report}"]
    options += [f"--run-dir={tmp_path / 'runs'}", *FAST]
    result = run_torchrun(2, options, timeout=120, entry=BENCHMARKS / "overhead.py")
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(report.read_text())
    assert record["weights_bitwise_equal"] is True
    for figure in ("median_step_s", "mean_step_s", "cpu_step_s"):
        trainer, plain = record["trainer"][figure], record["plain"][figure]
        assert trainer > 0 and plain > 0
        assert record["ratios"][figure] == pytest.approx(trainer / plain)
    assert "final weights bitwise equal: yes" in result.stdout


def test_checkpoint_stall_reports_the_pause_of_both_kinds_of_save_and_their_ratio(
    tmp_path: Path,
) -> None:
    report = tmp_path / "stall.json"
    command = [sys.executable, str(BENCHMARKS / "checkpoint_stall.py"), "--state-gb=0.05"]
    command += ["--repeats=1", "--speed-s=0.1", f"--json={report}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(report.read_text())
    assert record["state_bytes"] == pytest.approx(5e7, rel=0.1)
    assert record["sync_save_s"] > 0 and record["async_stall_s"] > 0
    assert record["stall_ratio"] == pytest.approx(record["async_stall_s"] / record["sync_save_s"])
    assert record["steps_per_s_idle"] > 0 and record["steps_per_s_during_save"] > 0
