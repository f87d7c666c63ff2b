"""Straggler attribution: the verdict on every rank's figures, the wait a rank measures in the
gradient all-reduce, the GPU readings, and the NVTX ranges of a step (the slow rank named in
a real run: tests/task/test_slow_rank.py)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch
from torch.cuda import nvtx
from torch.nn.parallel import DistributedDataParallel

from {{ cookiecutter.package_name }}.config import Config, ProfileConfig
from {{ cookiecutter.package_name }}.monitoring import stragglers
from {{ cookiecutter.package_name }}.monitoring.profiling import StepRanges
from {{ cookiecutter.package_name }}.monitoring.stragglers import Stragglers, slowest_rank

from ..helpers import make_trainer, spawn, train_steps

pytestmark = pytest.mark.standalone

CPU = torch.device("cpu")


def test_the_slowest_rank_is_measured_against_the_median_of_the_others() -> None:
    straggler = slowest_rank([0.10, 0.30, 0.11, 0.12])
    assert straggler.rank == 1
    assert straggler.others_s == pytest.approx(0.11)
    assert straggler.excess_s == pytest.approx(0.19)
    assert straggler.excess == pytest.approx(0.19 / 0.11)


def test_two_ranks_alike_make_the_first_the_slowest_with_no_excess() -> None:
    straggler = slowest_rank([0.2, 0.2])
    assert (straggler.rank, straggler.excess) == (0, 0.0)


def _window(
    judge: Stragglers, own_s: list[float], readings: list[list[float]] | None = None
) -> tuple[dict[str, float], str | None]:
    """`judge`'s verdict on a window of 10 steps of ranks that spent `own_s` per step of their
    own, 2 ms of it waiting for data, and waited for the slowest in the all-reduce for the rest
    of its time."""
    steps, slowest = 10, max(own_s)
    timings = torch.tensor([[slowest * steps, 0.002 * steps] for _ in own_s], dtype=torch.float64)
    waits = [[slowest - own] for own in own_s]
    no_gpu = [[math.nan] * len(stragglers.READINGS) for _ in own_s]
    rows = torch.tensor(
        [wait + gpu for wait, gpu in zip(waits, readings or no_gpu, strict=True)],
        dtype=torch.float64,
    )
    return judge.report(timings, rows, steps)


def _report(
    threshold: float, own_s: list[float], readings: list[list[float]] | None = None
) -> tuple[dict[str, float], str | None]:
    """The verdict on the second of two alike windows (one alone never names a rank)."""
    judge = Stragglers(CPU, len(own_s), threshold)
    _window(judge, own_s, readings)
    return _window(judge, own_s, readings)


def _two_ranks(slowest: int, excess_ms: float, share: float) -> list[float]:
    """Two ranks' own time per step when `slowest` exceeds the other by `excess_ms`, `share`
    of the other's time."""
    other = excess_ms / 1e3 / share
    return [other + excess_ms / 1e3, other] if slowest == 0 else [other, other + excess_ms / 1e3]


#: Log windows of two healthy ranks sharing two busy CPU cores, as measured (the slowest rank,
#: its excess in ms, and as a share of the other's time): past the share, even twice in a row
#: for the same rank, but by milliseconds.
SHARED_CORES = [
    (0, 0.4, 0.05), (0, 1.1, 0.26), (0, 1.5, 0.46), (1, 0.6, 0.14), (0, 2.5, 1.50),
    (1, 3.3, 2.30), (1, 3.7, 0.79), (1, 2.0, 0.31), (0, 4.7, 0.43), (1, 5.0, 0.62),
    (1, 4.6, 0.69), (0, 3.7, 0.36), (0, 3.7, 2.12), (1, 2.9, 1.12),
]  # fmt: skip


def test_a_healthy_host_whose_ranks_share_busy_cores_names_nobody() -> None:
    judge = Stragglers(CPU, 2, 0.25)
    warnings = [_window(judge, _two_ranks(*window))[1] for window in SHARED_CORES]
    assert warnings == [None] * len(SHARED_CORES)


def test_a_rank_that_sleeps_is_named_at_its_second_window_and_while_it_stays_slow() -> None:
    judge = Stragglers(CPU, 2, 0.25)
    windows = [_window(judge, [0.010, 0.060])[1] for _ in range(3)]
    assert windows[0] is None
    assert all(warning and warning.startswith("rank 1 on") for warning in windows[1:])


def test_a_rank_slow_in_one_window_then_another_is_named_for_neither() -> None:
    judge = Stragglers(CPU, 2, 0.25)
    assert _window(judge, [0.060, 0.010])[1] is None
    assert _window(judge, [0.010, 0.060])[1] is None
    assert _window(judge, [0.010, 0.060])[1] is not None


def test_an_excess_under_ten_ms_is_not_named_whatever_its_share() -> None:
    assert _report(0.25, [0.004, 0.0135])[1] is None
    assert _report(0.25, [0.004, 0.0145])[1] is not None


def test_a_rank_past_the_threshold_is_named_with_its_excess() -> None:
    figures, warning = _report(0.25, [0.100, 0.104, 0.140, 0.098])
    assert figures["train/slowest_rank"] == 2
    assert figures["train/slowest_excess"] == pytest.approx(0.140 / 0.100 - 1)
    assert figures["train/compute_max_s"] == pytest.approx(0.138)
    assert figures["train/collective_wait_max_s"] == pytest.approx(0.042)
    assert warning is not None
    assert warning.startswith(
        "rank 2 on an unknown host is the slowest: 140.0 ms/step of its own (compute 138.0, "
        "data wait 2.0), 40.0 ms (40%) more than the median of the other ranks (100.0 ms)"
    )


def test_ranks_within_the_threshold_are_named_in_the_figures_only() -> None:
    figures, warning = _report(0.25, [0.100, 0.104, 0.120, 0.098])
    assert figures["train/slowest_rank"] == 2
    assert warning is None


def test_a_threshold_of_zero_never_warns() -> None:
    assert _report(0.0, [0.1, 1.0])[1] is None


def test_one_rank_has_no_straggler_figures() -> None:
    figures, warning = _report(0.25, [0.1])
    assert figures == {}
    assert warning is None


def test_gpu_readings_are_reported_where_every_rank_has_them() -> None:
    """Clock, temperature, power and utilisation; the temperature is missing on rank 1."""
    readings = [[1980.0, 60.0, 600.0, 99.0], [1410.0, math.nan, 300.0, 99.0]]
    figures, warning = _report(0.25, [0.1, 0.2], readings)
    assert figures["train/gpu_clock_mhz"] == pytest.approx(1695.0)
    assert figures["train/gpu_clock_mhz_slowest"] == 1410.0
    assert figures["train/gpu_power_w_slowest"] == 300.0
    assert not any("temperature" in name for name in figures)
    assert warning is not None
    assert "its GPU: 1410 MHz, 300 W, 99% busy (the others' median: 1980 MHz, 600 W" in warning


def test_a_gpu_reading_that_fails_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_library(device: torch.device) -> float:
        raise ModuleNotFoundError("nvidia-ml-py does not seem to be installed")

    readers = [("clock_mhz", no_library, 1.0, "{:.0f} MHz"), ("power_w", lambda d: 250e3, 1e-3, "")]
    monkeypatch.setattr(stragglers, "READINGS", readers)
    readings = stragglers.device_readings(torch.device("cuda", 0))
    assert math.isnan(readings[0])
    assert readings[1] == 250.0
    assert all(math.isnan(value) for value in stragglers.device_readings(CPU))


SLEEP_S = 0.3


def _waits(rank: int, world_size: int) -> float:
    """Three steps of a DDP model whose rank 1 sleeps before its backward; the wait per step
    each rank measured."""
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4)))
    )
    watch = Stragglers(CPU, world_size, threshold=0.25)
    for step in range(1, 4):
        watch.start_step(step)
        loss = model(torch.randn(8, 64)).square().mean()
        if rank == 1:
            time.sleep(SLEEP_S)
        with watch.timed_backward(loss, reduces=True):
            loss.backward()
    return watch.row()[0]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_the_other_ranks_wait_for_a_slow_one_in_the_all_reduce(tmp_path: Path) -> None:
    fast, slow = spawn(2, _waits, workdir=tmp_path)
    assert fast > SLEEP_S / 2  # most of rank 1's sleep
    assert slow < fast


def test_a_backward_that_does_not_reduce_is_not_timed() -> None:
    watch = Stragglers(CPU, 1, threshold=0.25)
    watch.start_step(1)
    loss = torch.nn.Linear(4, 1)(torch.ones(4)).sum()
    with watch.timed_backward(loss, reduces=False):
        loss.backward()
    assert watch.row()[0] == 0.0


def test_one_step_in_a_third_of_the_log_interval_is_timed() -> None:
    """log_every=10: steps 3, 6 and 9 of the window; their mean wait is the row's."""
    watch = Stragglers(CPU, 2, threshold=0.25, log_every=10)
    timed = []
    for step in range(1, 11):
        watch.start_step(step)
        loss = torch.nn.Linear(4, 1)(torch.ones(4)).sum()
        with watch.timed_backward(loss, reduces=True) as context:
            loss.backward()
        timed += [step] if context is watch else []
    assert timed == [3, 6, 9]
    assert 0 <= watch.row()[0] < 1


def test_a_window_without_a_timed_step_names_nobody() -> None:
    """The last window of a run (or the first after a resume) may hold no timed step."""
    watch = Stragglers(CPU, 2, threshold=0.25, log_every=10)
    watch.start_step(10)
    row = watch.row()
    assert math.isnan(row[0])
    timings = torch.tensor([[1.0, 0.0], [2.0, 0.0]], dtype=torch.float64)
    rows = torch.tensor([row, row], dtype=torch.float64)
    assert watch.report(timings, rows, steps=1) == ({}, None)


@pytest.fixture
def pushed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """NVTX's push and pop, recorded in order instead of sent to a profiler."""
    calls: list[str] = []
    monkeypatch.setattr(nvtx, "range_push", lambda name: calls.append(f"+{name}"))
    monkeypatch.setattr(nvtx, "range_pop", lambda: calls.append("-"))
    return calls


def test_profile_nvtx_marks_each_phase_of_a_step_in_order(
    fast_config: Config, pushed: list[str]
) -> None:
    """One update over 4 micro-batches (FAST's config on one rank), as a GPU run does."""
    trainer = make_trainer(fast_config)
    trainer.ranges = StepRanges(ProfileConfig(nvtx=True), torch.device("cuda", 0))
    train_steps(trainer, 1)
    micro_batch = ["+data wait", "-", "+forward", "-", "+backward", "-"]
    assert pushed == micro_batch * trainer.accumulation_steps + ["+optimizer", "-"]


def test_without_profile_nvtx_a_step_pushes_no_range(
    fast_config: Config, pushed: list[str]
) -> None:
    assert not StepRanges(ProfileConfig(nvtx=True), CPU).enabled  # no NVTX without a GPU
    trainer = make_trainer(fast_config)
    assert not trainer.ranges.enabled
    train_steps(trainer, 1)
    assert pushed == []


def test_the_gpu_busy_share_is_the_mean_over_the_window_not_the_reading_at_its_end() -> None:
    """Busy 90% through the window, 10% as the log line is written (the point the log line
    showed before): readings at steps 1/6 s apart, counted on a fake clock."""
    now = [0.0]
    busy = stragglers.BusyShare(
        torch.device("cuda", 0), read=lambda device: 90.0, clock=lambda: now[0]
    )
    for _ in range(12):  # a step every 0.05 s for 0.6 s: read at 0, 0.2 and 0.4 s
        busy.at_step()
        now[0] += 0.05
    assert busy.window_mean(at_log_line=10.0) == pytest.approx((3 * 90.0 + 10.0) / 4)
    assert busy.window_mean(at_log_line=50.0) == 50.0  # the next window starts empty


def test_a_gpu_without_nvml_is_read_no_more_after_the_first_failure() -> None:
    calls = []

    def no_library(device: torch.device) -> float:
        calls.append(device)
        raise ModuleNotFoundError("nvidia-ml-py does not seem to be installed")

    busy = stragglers.BusyShare(
        torch.device("cuda", 0), read=no_library, clock=iter(range(9)).__next__
    )
    for _ in range(5):
        busy.at_step()
    assert len(calls) == 1
    assert math.isnan(busy.window_mean(at_log_line=math.nan))
