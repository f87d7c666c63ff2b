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
import torch

from ..helpers import BENCHMARKS, FAST, UPDATES, load_benchmark, run_torchrun

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
    options = ["--warmup-steps=10", "--steps=10", "--block-steps=5", "--rounds=2"]
    options += [f"--json={report}", f"--run-dir={tmp_path / 'runs'}", *FAST]
    result = run_torchrun(2, options, timeout=300, entry=BENCHMARKS / "overhead.py")
    if UPDATES:  # a model trained in parts has no plain loop of one optimizer to compare with
        assert result.returncode != 0 and "the task trains its model in updates" in result.stderr
        return
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(report.read_text())
    assert record["weights_bitwise_equal"] is True and record["deterministic"] is True
    assert "final weights bitwise equal: yes" in result.stdout
    assert (record["world_size"], record["rounds"], record["steps"]) == (2, 2, 10)
    for ratio, numerator in (("ratios", "trainer"), ("control", "plain_again")):
        for figure in ("median_step_s", "mean_step_s", "cpu_step_s", "process_cpu_step_s"):
            blocks = [record[loop]["blocks"] for loop in (numerator, "plain")]
            assert all(len(loop_blocks) == 4 for loop_blocks in blocks)  # 2 per round
            assert all(block[figure] > 0 for loop_blocks in blocks for block in loop_blocks)
            paired = [mine[figure] / plain[figure] for mine, plain in zip(*blocks, strict=True)]
            interval = record[ratio][figure]
            assert interval["ratio"] == pytest.approx(math.prod(paired) ** 0.25)
            assert interval["low"] <= interval["ratio"] <= interval["high"]


def test_the_interval_is_over_rounds_whose_blocks_move_together() -> None:
    """Four rounds of two blocks, each round's blocks alike: four repeats, not eight."""
    overhead = load_benchmark("overhead")
    blocks = [1.0, 1.0, 2.0, 2.0] * 2
    by_round = overhead.paired_ratio(blocks, [1.0] * 8, confidence=0.95, per_round=2)
    assert by_round == pytest.approx({"ratio": 2**0.5, "low": 1.0, "high": 2.0})
    by_block = overhead.paired_ratio(blocks, [1.0] * 8, confidence=0.95)
    assert by_block["ratio"] == pytest.approx(2**0.5)
    assert by_block["low"] > 1.0 and by_block["high"] < 2.0


def _turn_taker(name: str, steps: int, log: list[str]):
    """A loop for overhead.Turns: `steps` steps, each logging its name and drawing one random
    number from torch's global stream (as dropout does); returns its draws."""

    def run(clock) -> dict[str, torch.Tensor]:
        torch.manual_seed(len(name))
        draws = []
        for _ in range(steps):
            log.append(name)
            draws.append(torch.rand(()))
            clock.tick()
        return {"draws": torch.stack(draws)}

    return run


def test_loops_taking_turns_step_once_per_cycle_in_a_drawn_order_with_their_own_streams() -> None:
    overhead = load_benchmark("overhead")
    cpu = torch.device("cpu")
    names = ["trainer", "plain", "plain_again"]

    def play(seed: int) -> tuple[list[str], dict[str, dict[str, torch.Tensor]]]:
        log: list[str] = []
        runners = {name: _turn_taker(name, 6, log) for name in names}
        clocks = {name: overhead.StepClock(cpu, 2, 4) for name in names}
        return log, overhead.Turns(names, seed, cpu).run(runners, clocks)

    log, weights = play(seed=3)
    cycles = [log[start : start + 3] for start in range(0, len(log), 3)]
    assert len(cycles) == 6 and all(sorted(cycle) == sorted(names) for cycle in cycles)
    assert len({tuple(cycle) for cycle in cycles}) > 1  # an order drawn per cycle, not one
    assert play(seed=3)[0] == log  # the same seed, the same turns: every rank alike
    for name in names:  # each drew what it draws alone, though the others drew in between
        torch.manual_seed(len(name))
        assert torch.equal(weights[name]["draws"], torch.rand(6))


def test_a_loop_that_fails_ends_the_turns_and_its_error_is_raised() -> None:
    overhead = load_benchmark("overhead")
    cpu = torch.device("cpu")
    log: list[str] = []

    def failing(clock) -> dict[str, torch.Tensor]:
        clock.tick()
        raise ValueError("the loop's own error")

    runners = {"plain": _turn_taker("plain", 50, log), "failing": failing}
    clocks = {name: overhead.StepClock(cpu, 1, 1) for name in runners}
    with pytest.raises(ValueError, match="the loop's own error"):
        overhead.Turns(list(runners), 0, cpu).run(runners, clocks)
    assert len(log) < 5  # the other loop stopped at its next step


def test_the_step_clock_times_each_step_from_its_turn_and_reports_whole_blocks() -> None:
    overhead = load_benchmark("overhead")
    clock = overhead.StepClock(torch.device("cpu"), warmup_steps=2, steps=4)
    for _ in range(7):
        clock.begin()
        clock.tick()
    assert len(clock.steps) == 7 and all(min(step) >= 0 for step in clock.steps)
    clock.steps = [(float(step), 0.5 * step, 0.25 * step) for step in range(1, 8)]
    assert clock.blocks(2) == [
        {"median_step_s": 3.5, "mean_step_s": 3.5, "cpu_step_s": 1.75, "process_cpu_step_s": 0.875},
        {"median_step_s": 5.5, "mean_step_s": 5.5, "cpu_step_s": 2.75, "process_cpu_step_s": 1.375},
    ]
    assert [block["mean_step_s"] for block in clock.blocks(3)] == [4.0]  # whole blocks only


@pytest.mark.parametrize(
    ("trainer_equal", "plain_equal", "status"),
    [(True, True, 0), (False, True, 1), (False, False, 0)],
)
def test_overhead_fails_only_when_the_trainer_alone_ends_in_other_weights(
    trainer_equal: bool, plain_equal: bool, status: int
) -> None:
    """On a device whose kernels are not deterministic the plain loop differs from itself: no
    run compares bitwise there, and that is no failure of the Trainer."""
    overhead = load_benchmark("overhead")
    record = {"weights_bitwise_equal": trainer_equal and plain_equal, "deterministic": plain_equal}
    assert overhead.exit_status(record) == status


def test_the_overhead_ratio_of_paired_runs_has_an_interval_that_narrows_with_rounds() -> None:
    """The geometric mean of the paired ratios, with a bootstrap interval over the pairs: one
    that shrinks as the same spread of ratios comes from more rounds."""
    overhead = load_benchmark("overhead")
    ratios = [1.01, 1.03, 0.99, 1.02]
    few = overhead.paired_ratio(ratios, [1.0] * 4, confidence=0.95)
    many = overhead.paired_ratio(ratios * 8, [1.0] * 32, confidence=0.95)
    assert few["ratio"] == pytest.approx(math.prod(ratios) ** 0.25)
    assert many["ratio"] == pytest.approx(few["ratio"])
    assert few["low"] < many["low"] <= many["ratio"] <= many["high"] < few["high"]
    assert overhead.paired_ratio([2.0, 4.0], [1.0, 2.0], 0.95) == pytest.approx(
        {"ratio": 2.0, "low": 2.0, "high": 2.0}
    )


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
    assert (record["device"], record["pin_memory"]) == ("cpu", False)
