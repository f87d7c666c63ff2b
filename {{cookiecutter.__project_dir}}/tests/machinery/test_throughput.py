"""What each log interval reports: step time, throughput, data wait, memory, MFU, stragglers."""

from __future__ import annotations

import io
import json
import logging
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from {{ cookiecutter.package_name }}.checkpointing import checkpoint as checkpoint_module
from {{ cookiecutter.package_name }}.config import BestConfig, load_config
from {{ cookiecutter.package_name }}.contract import defines
from {{ cookiecutter.package_name }}.monitoring import throughput
from {{ cookiecutter.package_name }}.monitoring.logs import ProgressBar
from {{ cookiecutter.package_name }}.monitoring.metrics import read_metrics
from {{ cookiecutter.package_name }}.monitoring.throughput import StepMeter, peak_flops, window_figures
from {{ cookiecutter.package_name }}.task import Task
from {{ cookiecutter.package_name }}.training.trainer import best_evaluation

from ..helpers import FAST, TRAIN_PREFIX, TRAINING_LOSS, env_for, make_trainer, spawn

TRAIN_KEYS = {
    TRAINING_LOSS,
    f"{TRAIN_PREFIX}lr",
    f"{TRAIN_PREFIX}grad_norm",
    "train/step_time_s",
    "train/step_time_min_s",
    "train/step_time_max_s",
    "train/data_wait_share",
    "train/data_wait_share_max",
    "train/data_wait_max_rank",
    "train/peak_memory_gb",
}


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_meter_leaves_paused_time_out(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(throughput.time, "perf_counter", clock)
    meter = StepMeter(torch.device("cpu"))
    meter.start()
    clock.now += 2.0  # training
    meter.pause()
    clock.now += 30.0  # evaluation or a checkpoint
    meter.resume()
    clock.now += 1.0  # training
    meter.steps = 3
    window = meter.window()
    assert (window.steps, window.train_s) == (3, 3.0)
    assert (meter.total_steps, meter.total_train_s) == (3, 3.0)
    assert meter.steps == 0  # the next window starts empty


def test_figures_use_the_slowest_rank_and_show_the_spread() -> None:
    # Two ranks, 10 steps: rank 1 took twice as long and waited for data most of that time.
    rows = torch.tensor([[1.0, 0.1, 2e9], [2.0, 1.5, 3e9]], dtype=torch.float64)
    figures = window_figures(rows, 10, "samples", 10 * 64, flops_per_step=1e12, peak=1e13)
    assert figures["train/samples_per_s"] == pytest.approx(10 * 64 / 2.0)
    assert figures["train/samples_per_s_per_device"] == pytest.approx(10 * 64 / 2.0 / 2)
    assert figures["train/step_time_min_s"] == pytest.approx(0.1)
    assert figures["train/step_time_max_s"] == pytest.approx(0.2)
    assert figures["train/step_time_s"] == pytest.approx(0.15)
    assert figures["train/data_wait_share"] == pytest.approx((0.1 + 0.75) / 2)
    assert figures["train/data_wait_share_max"] == pytest.approx(0.75)
    assert figures["train/data_wait_max_rank"] == 1
    assert figures["train/peak_memory_gb"] == pytest.approx(3.0)
    # 10 steps x 1e12 FLOPs in 2 s on 2 devices of 1e13 FLOP/s peak each.
    assert figures["train/mfu"] == pytest.approx(10 * 1e12 / 2.0 / (2 * 1e13))


def test_mfu_is_left_out_where_the_peak_is_unknown() -> None:
    rows = torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64)
    assert "train/mfu" not in window_figures(rows, 1, "tokens", 1, 1.0, peak=None)


def test_peak_flops_come_from_the_table_the_override_or_nowhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert peak_flops(cpu, "bf16", override_tflops=0) is None
    assert peak_flops(cpu, "fp32", override_tflops=2.5) == 2.5e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert peak_flops(gpu, "bf16", 0) == 989e12
    assert peak_flops(gpu, "tf32", 0) == 494e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 PCIe")
    assert peak_flops(gpu, "bf16", 0) == 756e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Some Future GPU")
    assert peak_flops(gpu, "bf16", 0) is None


FLOPS_PER_SAMPLE = 1e6


class KnownFlops(Task):
    """The project's task with a FLOPs count of its own: MFU is then reported for any task."""

    def flops_per_sample(self, model: torch.nn.Module) -> float:
        return FLOPS_PER_SAMPLE


def test_every_log_interval_records_the_figures(tmp_path: Path) -> None:
    """Also the gradient norm with clipping off, and MFU once a peak is given."""
    overrides = ["optim.grad_clip=0", "train.max_steps=4", "train.peak_tflops=1"]
    config = load_config(None, [*FAST, f"run.dir={tmp_path}", *overrides])
    trainer = make_trainer(config, task=KnownFlops(config.task, seed=config.run.seed))
    assert trainer.fit() == 0
    records = [r for r in read_metrics(tmp_path) if TRAINING_LOSS in r]
    assert [r["step"] for r in records] == [2, 4]
    unit_rate = f"train/{trainer.task.throughput_unit}_per_s"
    flops_per_step = FLOPS_PER_SAMPLE * config.train.global_batch_size
    for record in records:
        assert TRAIN_KEYS | {unit_rate, f"{unit_rate}_per_device", "train/mfu"} <= set(record)
        assert record[f"{TRAIN_PREFIX}grad_norm"] > 0
        assert record[unit_rate] > 0
        achieved = flops_per_step / record["train/step_time_s"]
        assert record["train/mfu"] == pytest.approx(achieved / 1e12)  # of a 1 TFLOP/s peak
        assert record["train/peak_memory_gb"] > 0.01  # this process's peak resident memory


def test_evaluation_and_checkpoint_time_is_not_counted_as_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the meter's fake clock a step takes 0.25 s, and each evaluation batch and each file of
    a checkpoint 64 s: the steps after the evaluation and checkpoint of step 4 still log 0.25 s,
    and, for a task that does not count its batches' units, the global batch's per 0.25 s."""
    step_s, pause_s = 0.25, 64.0  # binary fractions: the clock's sums are exact
    clock = FakeClock()
    monkeypatch.setattr(throughput, "time", SimpleNamespace(perf_counter=clock))
    config = load_config(None, [*FAST, f"run.dir={tmp_path}", "train.max_steps=8"])
    task = Task(config.task, seed=config.run.seed)
    trainer = make_trainer(config, task=task)
    paused: set[tuple[str, int]] = set()
    train_step, evaluation_sums = trainer.train_step, task.evaluation_sums
    atomic_save = checkpoint_module._atomic_save

    def timed_train_step(batches: object) -> object:
        clock.now += step_s
        return train_step(batches)

    def slow_evaluation_sums(model: torch.nn.Module, batch: object) -> object:
        clock.now += pause_s
        paused.add(("evaluation", trainer.step))
        return evaluation_sums(model, batch)

    def slow_atomic_save(obj: object, path: Path) -> None:
        clock.now += pause_s
        paused.add(("checkpoint", trainer.step))
        atomic_save(obj, path)

    trainer.train_step, task.evaluation_sums = timed_train_step, slow_evaluation_sums
    monkeypatch.setattr(checkpoint_module, "_atomic_save", slow_atomic_save)
    assert trainer.fit() == 0
    assert {("evaluation", 4), ("checkpoint", 4)} <= paused  # inside the window of steps 5-6
    records = [r for r in read_metrics(tmp_path) if TRAINING_LOSS in r]
    assert [r["step"] for r in records] == [2, 4, 6, 8]
    assert [r["train/step_time_s"] for r in records] == pytest.approx([step_s] * 4)
    if not defines(task, "units"):  # a task's own count: test_contract.py
        adopted = trainer.task  # with the contract's defaults for what the task lacks
        units_per_step = config.train.global_batch_size * adopted.units_per_sample
        rates = [r[f"train/{adopted.throughput_unit}_per_s"] for r in records]
        assert rates == pytest.approx([units_per_step / step_s] * 4)


class SlowDataOnRankOne(Task):
    """Rank 1's samples take 20 ms each to load: a starved DataLoader on one rank."""

    rank = 0

    def build_datasets(self) -> tuple:
        train, evaluation = super().build_datasets()
        return SlowDataset(train, delay=0.02 if self.rank == 1 else 0.0), evaluation


class SlowDataset(torch.utils.data.Dataset):
    def __init__(self, dataset: torch.utils.data.Dataset, delay: float) -> None:
        self.dataset, self.delay = dataset, delay

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> object:
        time.sleep(self.delay)
        return self.dataset[index]


def _train_with_a_slow_loader(rank: int, world_size: int, run_dir: Path) -> list[dict]:
    overrides = [f"run.dir={run_dir}", "train.max_steps=4", "train.micro_batch_size=4"]
    config = load_config(None, [*FAST, *overrides])
    task = SlowDataOnRankOne(config.task, seed=config.run.seed)
    task.rank = rank
    make_trainer(config, env_for(rank, world_size), task).fit()
    return read_metrics(run_dir)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_rank_starved_for_data_is_named_in_the_log(tmp_path: Path) -> None:
    records = spawn(2, _train_with_a_slow_loader, tmp_path / "run", workdir=tmp_path)[0]
    train = [r for r in records if TRAINING_LOSS in r]
    assert train and all(r["train/data_wait_max_rank"] == 1 for r in train)
    # Rank 1 waits for most of every step; rank 0 waits for rank 1 in the all-reduce instead.
    assert all(r["train/data_wait_share_max"] > 0.5 for r in train)
    assert all(r["train/data_wait_share"] < 0.75 * r["train/data_wait_share_max"] for r in train)


def test_the_run_ends_with_a_summary(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = load_config(None, [*FAST, f"run.dir={tmp_path}", "train.max_steps=8"])
    trainer = make_trainer(config)
    with caplog.at_level(logging.INFO):
        assert trainer.fit() == 0
    summary = [r.getMessage() for r in caplog.records if r.getMessage().startswith("summary:")]
    assert len(summary) == 1
    assert "steps 1..8 of 8" in summary[0]
    assert best_evaluation(read_metrics(tmp_path), config.best) in summary[0]
    assert "newest: step_00000008" in summary[0]


RECORDS = [
    {"step": 2, "eval/loss": 0.5, "eval/accuracy": 0.7},
    {"step": 4, "eval/loss": 0.4, "eval/accuracy": 0.9},
    {"step": 6, "eval/loss": 0.45, "eval/accuracy": 0.8},
]


@pytest.mark.parametrize(
    ("records", "best", "said"),
    [
        (RECORDS, BestConfig(), "best eval/loss 0.4000 at step 4"),
        (RECORDS, BestConfig("eval/accuracy", "max"), "best eval/accuracy 0.9000 at step 4"),
        ([{"step": 2, "eval/f1": 0.5}], BestConfig(), "evaluated, without eval/loss"),
        ([{"step": 2, "train/loss": 1.0}], BestConfig(), "no evaluation yet"),
    ],
    ids=["eval-loss", "best-metric-max", "no-loss-metric", "no-evaluation"],
)
def test_the_summary_names_the_best_evaluation_of_the_metric_that_picks_the_best(
    records: list, best: BestConfig, said: str
) -> None:
    assert best_evaluation(records, best).startswith(said)


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_bar_is_drawn_only_on_a_terminal() -> None:
    log_file = io.StringIO()
    ProgressBar(0, 10, enabled=True, stream=log_file).update(5)
    assert log_file.getvalue() == ""
    terminal = FakeTerminal()
    ProgressBar(0, 10, enabled=True, stream=terminal).update(5)
    assert "step 5/10" in terminal.getvalue()
    terminal = FakeTerminal()
    ProgressBar(0, 10, enabled=False, stream=terminal).update(5)
    assert terminal.getvalue() == ""


def test_log_lines_clear_the_progress_bar_first() -> None:
    terminal = FakeTerminal()
    handler = logging.StreamHandler(terminal)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        bar = ProgressBar(0, 10, enabled=True, stream=terminal)
        bar.update(5)
        logging.getLogger("test").warning("a log line")
        bar.close()
    finally:
        root.removeHandler(handler)
    assert terminal.getvalue().endswith("left\033[K\r\033[Ka log line\n\r\033[K")
    assert handler.filters == []  # closed: log lines go out untouched again


def test_the_bar_shows_progress_speed_and_time_left() -> None:
    bar = ProgressBar(first=100, total=200, enabled=False)
    assert bar.render(150, elapsed=10.0) == (
        "step 150/200 [###############...............]  50% 5.0 steps/s, 0:10 left"
    )


def test_the_profiler_writes_a_trace_of_the_chosen_steps(tmp_path: Path) -> None:
    overrides = ["profile.enabled=true", "profile.wait_steps=1", "profile.active_steps=2"]
    config = load_config(None, [*FAST, f"run.dir={tmp_path}", "train.max_steps=6", *overrides])
    assert make_trainer(config).fit() == 0
    trace = json.loads((tmp_path / "profile" / "trace_rank0.json").read_text())
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("Profiler")}
    assert len(steps) == 2, steps  # one ProfilerStep#N span per recorded step
    assert "Self CPU" in (tmp_path / "profile" / "summary.txt").read_text()
