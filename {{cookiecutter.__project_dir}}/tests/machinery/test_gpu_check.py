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
import torch

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
        Row("doctor", "failed", "1 FAIL (fabric | x),\n0 WARN", "torch 2.13.0, H100"),
    ]
    assert gpu_check.table("1 x H100", rows).splitlines() == [
        "1 x H100",
        "",
        "| check | result | figures | measured with |",
        "| --- | --- | --- | --- |",
        "| GPU tests (`pytest -m gpu`) | passed | 5 passed, 2 skipped, 0 failed in 95 s |  |",
        "| doctor | failed | 1 FAIL (fabric \\| x), 0 WARN | torch 2.13.0, H100 |",
    ]


def test_every_row_says_which_torch_and_gpu_it_was_measured_with(tmp_path: Path) -> None:
    def piece(check: str, workdir: Path, limit_s: float) -> list:
        return [Row(check, "measured", "1 tokens/s"), Row(f"{check}, again", "measured")]

    rows = gpu_check.run_pieces(tmp_path, 10, [("a", 1.0, piece)], "torch 2.13.0+cu130, H200")
    assert [row.measured_with for row in rows] == ["torch 2.13.0+cu130, H200"] * 2


def test_a_torch_older_than_the_projects_floor_is_refused() -> None:
    """Its figures would not stand for the project (they were once measured with 2.11)."""
    floor = gpu_check.TORCH_FLOOR
    assert gpu_check.below_floor("2.11.0+cu130")
    assert not gpu_check.below_floor(f"{floor}.0+cu130")
    assert not gpu_check.below_floor(f"{floor}.1")
    assert not gpu_check.below_floor(f"{floor}.0a0+ecf3bae40a.nv25.10")  # NVIDIA's containers


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


#: What `torchfrtrace -v` lists for the NCCL failure row's dump (its Collectives line, cut).
FR_TRACE_COLLECTIVES = (
    "Collectives\n[Collective(id=0, group_id='0', pass_check=True, collective_seq_id=1, "
    "p2p_seq_id=0, record_id=0, pg_desc='0:default_pg', collective_name='nccl:all_reduce', "
    "input_sizes=[[1048576]], output_sizes=[[1048576]], expected_ranks={0}, "
    "collective_state='completed', collective_frames=[]), Collective(id=1, group_id='0', "
    "pass_check=True, collective_seq_id=2, p2p_seq_id=0, record_id=1, "
    "pg_desc='0:default_pg', collective_name='nccl:all_reduce', input_sizes=[[1048576]], "
    "output_sizes=[[1048576]], expected_ranks={0}, collective_state='scheduled', "
    "collective_frames=[{'name': 'hang_in_nccl', 'filename': 'gpu_check.py', 'line': 316}])]"
)


def _failed_run(run_dir: Path, dump: bool = True, stacks: bool = True) -> None:
    """What NCCL's watchdog leaves in the row's run directory."""
    if dump:
        (run_dir / "comm_traces").mkdir(parents=True)
        (run_dir / "comm_traces" / "rank_0").write_bytes(b"pickled entries")
    log = "Fatal Python error: Aborted\n\nCurrent thread 0x7f (most recent call first):\n"
    log += '  File "benchmarks/gpu_check.py", line 316 in hang_in_nccl\n'
    (run_dir / "train.log").write_text(log if stacks else "")


def test_the_nccl_timeout_row_passes_on_the_dump_the_named_collective_and_the_stacks(
    tmp_path: Path,
) -> None:
    _failed_run(tmp_path)
    finished = gpu_check.Finished(status=-6, output="", seconds=27.4)
    row = gpu_check.nccl_failure_row("NCCL timeout", finished, tmp_path, FR_TRACE_COLLECTIVES)
    assert row == Row(
        "NCCL timeout",
        "passed",
        "exit status -6 after 27 s (timeout 10 s); comm_traces/rank_0 written; torchfrtrace "
        "names nccl:all_reduce #2 (scheduled); the stacks in train.log",
    )


def test_the_nccl_timeout_row_names_each_thing_missing(tmp_path: Path) -> None:
    _failed_run(tmp_path, dump=False, stacks=False)
    finished = gpu_check.Finished(status=-6, output="", seconds=75.0)
    row = gpu_check.nccl_failure_row("NCCL timeout", finished, tmp_path, "no dump found")
    assert row.result == "failed"
    assert row.figures == (
        f"the process did not end within 60 s; no flight recorder dump at "
        f"{tmp_path}/comm_traces/rank_0; torchfrtrace names no unfinished collective; the "
        "rank's Python stacks are not in train.log"
    )


def test_the_nccl_timeout_row_skips_saying_why_on_a_torch_without_nccl(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(gpu_check.dist, "is_nccl_available", lambda: False)
    [row] = gpu_check.nccl_failure("NCCL timeout", tmp_path, 75.0)
    assert (row.result, row.figures) == (
        "skipped",
        f"this torch ({torch.__version__}) is built without NCCL",
    )


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
    rows = gpu_check.gpt_left_out("`gpt` as GPT-2 124M", tmp_path, 0.0)
    assert rows == [
        Row(
            "`gpt` as GPT-2 124M",
            "left out",
            "this project's example is the classifier; a project rendered with example=gpt "
            "measures it",
        )
    ]
{%- endif %}
