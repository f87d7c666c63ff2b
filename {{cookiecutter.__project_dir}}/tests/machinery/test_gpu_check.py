"""`make gpu-check` (benchmarks/gpu_check.py) on CPU: it refuses at once without a GPU, and
the table it prints comes out right from what its pieces report (fakes of them here: the
pieces themselves need a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..helpers import BENCHMARKS, load_benchmark

gpu_check = load_benchmark("gpu_check")
Row = gpu_check.Row


def test_without_a_gpu_it_says_so_and_exits_2_at_once() -> None:
    command = [sys.executable, str(BENCHMARKS / "gpu_check.py")]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith("gpu-check: no CUDA GPU is visible (torch ")
    assert result.stdout == ""


def test_the_table_has_a_line_on_the_machine_then_a_row_per_check() -> None:
    rows = [
        Row("GPU tests (`pytest -m gpu`)", "passed", "5 passed, 2 skipped, 0 failed in 95 s"),
        Row("doctor", "failed", "1 FAIL (fabric | x),\n0 WARN"),
    ]
    assert gpu_check.table("1 x H100", rows).splitlines() == [
        "1 x H100",
        "",
        "| check | result | figures |",
        "| --- | --- | --- |",
        "| GPU tests (`pytest -m gpu`) | passed | 5 passed, 2 skipped, 0 failed in 95 s |",
        "| doctor | failed | 1 FAIL (fabric \\| x), 0 WARN |",
    ]


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="5">
<testcase classname="tests.task.test_gpu" name="test_one_gpu_trains" time="9.1"/>
<testcase classname="tests.task.test_gpu" name="test_one_gpu_trains_in_each_precision[bf16]"/>
<testcase classname="tests.task.test_gpu" name="test_one_gpu_trains_in_each_precision[fp16]">
<failure message="AssertionError: assert False">traceback</failure></testcase>
<testcase classname="tests.task.test_gpu"
 name="test_a_rank_hung_under_nccl_leaves_every_rank_s_flight_recorder_and_the_stacks">
<skipped type="pytest.skip" message="needs 2 GPUs, found 1">skip</skipped></testcase>
<testcase classname="tests.task.test_gpu" name="test_two_gpus_train_checkpoint_and_resume">
<skipped type="pytest.skip" message="needs 2 GPUs, found 1">skip</skipped></testcase>
</testsuite></testsuites>
"""


def test_the_gpu_tests_are_counted_and_the_named_ones_shown_from_pytests_report() -> None:
    outcomes = gpu_check.junit_outcomes(JUNIT)
    assert gpu_check.gpu_test_rows("GPU tests", outcomes, 41.2) == [
        Row("GPU tests", "failed", "2 passed, 2 skipped, 1 failed in 41 s"),
        Row("bitwise resume on CUDA", "failed", "not in the report"),
        Row("bf16 steps", "passed", ""),
        Row("fp16 steps (loss scaling)", "failed", "AssertionError: assert False"),
        Row(
            "a slow rank named from CUDA events, with the GPU's readings",
            "failed",
            "not in the report",
        ),
        Row(
            "NCCL hang: every rank's flight recorder and stacks",
            "skipped",
            "needs 2 GPUs, found 1",
        ),
    ]


def test_a_piece_past_its_time_limit_is_stopped_and_reported() -> None:
    sleeper = "import time; print('started', flush=True); time.sleep(60)"
    finished = gpu_check.run_limited([sys.executable, "-c", sleeper], limit_s=3)
    assert finished.status is None
    assert "started" in finished.output
    assert gpu_check.failure("doctor", finished, 3) == Row(
        "doctor", "timed out", "stopped after 3 s"
    )


def test_a_piece_that_fails_is_reported_with_its_exit_status(
    capsys: pytest.CaptureFixture[str],
) -> None:
    finished = gpu_check.Finished(status=1, output="Traceback: the cause", seconds=12.4)
    assert gpu_check.failure("checkpoint stall", finished, 50) == Row(
        "checkpoint stall", "failed", "exit status 1 after 12 s"
    )
    assert "Traceback: the cause" in capsys.readouterr().err


def test_the_pieces_share_the_budget_and_those_past_it_are_not_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Each piece runs within its share, at most what is left; pieces take their whole share."""
    now = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    limits = []

    def piece(check: str, workdir: Path, limit_s: float) -> list:
        limits.append(limit_s)
        now[0] += limit_s
        return [Row(check, "passed")]

    pieces = [("a", 100.0, piece), ("b", 100.0, piece), ("c", 100.0, piece)]
    rows = gpu_check.run_pieces(tmp_path, 150, pieces)
    assert limits == [100.0, 50.0]
    assert rows[2] == Row("c", "not run", "the 150 s budget was spent")


def test_the_checkpoint_stall_rows_give_the_synchronous_wait_and_the_background_pause() -> None:
    record = {
        "state_bytes": 1.01e9,
        "sync_save_s": 4.4,
        "async_stall_s": 0.132,
        "async_first_stall_s": 0.79,
        "async_write_s": 3.39,
        "stall_ratio": 0.03,
        "pin_memory": True,
    }
    assert gpu_check.stall_rows("checkpoint stall", record) == [
        Row("checkpoint stall, synchronous", "measured", "training waits 4.40 s for 1.01 GB"),
        Row(
            "checkpoint stall, in the background (pinned memory)",
            "measured",
            "training pauses 0.132 s (3.0% of the synchronous save; the first save 0.79 s), "
            "the write takes 3.39 s",
        ),
    ]


def test_the_doctor_row_counts_the_verdicts_and_names_the_checks_that_did_not_pass() -> None:
    checks = [{"name": "fabric", "verdict": "FAIL"}, {"name": "data", "verdict": "WARN"}]
    checks += [{"name": "compute", "verdict": "PASS"}, {"name": "network", "verdict": "PASS"}]
    document = {"status": 1, "checks": checks}
    assert gpu_check.doctor_row("doctor", document, gpus=1) == Row(
        "doctor", "failed", "1 FAIL (fabric), 1 WARN (data), 2 PASS; 1 rank(s), one per GPU"
    )
{%- if cookiecutter.example == "gpt" %}


def test_the_gpt_throughput_is_the_median_after_the_first_log_line() -> None:
    """The first log line holds the warm-up (and the compilation, with torch.compile)."""
    records = [{"step": 0, "train/loss": 5.0}]
    records += [
        {"train/tokens_per_s": rate, "train/mfu": mfu}
        for rate, mfu in [(1000.0, 0.01), (300000.0, 0.40), (310000.0, 0.41), (290000.0, 0.39)]
    ]
    assert gpu_check.throughput_figures(records) == "300,000 tokens/s, MFU 40.0%"


def test_the_mfu_of_a_gpu_whose_peak_is_not_listed_is_said_to_be_unknown() -> None:
    records = [{"train/tokens_per_s": rate} for rate in (1000.0, 2000.0)]
    assert gpu_check.throughput_figures(records) == (
        "2,000 tokens/s; MFU unknown: this GPU's peak is not listed (see above)"
    )
{%- else %}


def test_the_gpt_throughput_is_left_out_of_a_classifier_project_saying_why(
    tmp_path: Path,
) -> None:
    rows = gpu_check.gpt_left_out("`gpt` at GPT-2 124M's shape", tmp_path, 0.0)
    assert rows == [
        Row(
            "`gpt` at GPT-2 124M's shape",
            "left out",
            "this project's example is the classifier; a project rendered with example=gpt "
            "measures it",
        )
    ]
{%- endif %}
