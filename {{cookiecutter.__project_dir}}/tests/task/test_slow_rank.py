"""A rank slow at its own work is named in the log, with its host; ranks alike are not.

Rank 1 sleeps in its backward of every micro-batch, far longer than a step of the task takes
(20 times its fastest forward, at least 0.2 s), and the threshold is loose: a loaded machine
slows a step by less than the margin between them, whatever the task.
"""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from {{ cookiecutter.package_name }}.cluster.agreement import agree_on_launch, identity
from {{ cookiecutter.package_name }}.config import load_config
from {{ cookiecutter.package_name }}.monitoring.metrics import read_metrics
from {{ cookiecutter.package_name }}.task import Task
from {{ cookiecutter.package_name }}.training import trainer as trainer_module

from ..helpers import FAST, TRAINING_LOSS, env_for, make_trainer, spawn

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

#: Rank 1's sleep after each forward: at least this many seconds, and this many forwards.
SLEEP_S, SLEEP_FORWARDS = 0.2, 20
#: Warn past this excess over the other rank: loose, as the margins above allow.
THRESHOLD = 2.0


class SlowOnRankOne(Task):
    """The project's task; when `slow`, rank 1 sleeps in each backward, far longer than its
    fastest forward so far (a busy machine stretches some).

    In the backward, where the first parameter gets its gradient: after what the loss may
    exchange between ranks itself (negatives gathered from every rank), so that the other rank
    waits for it in DDP's all-reduce. A sleep in the forward would keep it waiting in that
    exchange instead, which the log counts as its own compute.
    """

    rank = 0
    slow = False
    fastest_s = float("inf")
    backward_sleeps = False

    def training_loss(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        loss = super().training_loss(*args, **kwargs)
        self.fastest_s = min(self.fastest_s, time.perf_counter() - started)
        self.backward_sleeps = self.slow and self.rank == 1
        return loss

    def slow_down(self, model: torch.nn.Module) -> None:
        """Sleep in the backward of every micro-batch, as `training_loss` arranged."""
        for param in model.parameters():
            if param.requires_grad:
                param.register_hook(self._sleep_once)

    def _sleep_once(self, grad: torch.Tensor) -> None:
        if self.backward_sleeps:
            self.backward_sleeps = False
            time.sleep(max(SLEEP_S, SLEEP_FORWARDS * self.fastest_s))


class Lines(logging.Handler):
    """The log lines of a logger, as `LEVEL message`."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def train_ranks(
    rank: int,
    world_size: int,
    run_dir: Path,
    slow: bool,
    steps: int,
    log_every: int,
    device: str = "cpu",
    more: tuple[str, ...] = (),
) -> tuple[list[str], list[dict]]:
    """Train on ranks that met as train.py has them meet (the roster names their hosts), on
    `device` (every rank on the same one), with `more` overrides; the log lines and warnings of
    the trainer, and the metrics."""
    store = dist.FileStore(str(run_dir.parent / "launch-store"), world_size)
    agree_on_launch(store, rank, world_size, identity(None, torch.device(device)), timeout_s=60)
    overrides = [
        f"run.dir={run_dir}",
        f"train.max_steps={steps}",
        f"train.log_every={log_every}",
        f"train.straggler_threshold={THRESHOLD}",
        *more,
    ]
    config = load_config(None, [*FAST, *overrides])
    task = SlowOnRankOne(config.task, seed=config.run.seed)
    task.rank, task.slow = rank, slow
    lines = Lines()
    logger = logging.getLogger(trainer_module.__name__)
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    trainer = make_trainer(config, env_for(rank, world_size), task, device=torch.device(device))
    task.slow_down(trainer.model)
    trainer.fit()
    return lines.lines, read_metrics(run_dir)


def slowest_warnings(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("WARNING") and "is the slowest" in line]


def rank_one_named_slowest(lines: list[str], records: list[dict]) -> tuple[list[str], list[dict]]:
    """Rank 1 is named in the warnings and in the records of both log windows; it computes for
    most of a step, and the other rank waits for it about as long. Returns the warnings and the
    training records."""
    warnings = slowest_warnings(lines)
    assert warnings and all(line.startswith("WARNING rank 1 on ") for line in warnings), lines
    train = [record for record in records if TRAINING_LOSS in record]
    assert [record["train/slowest_rank"] for record in train] == [1, 1]
    assert all(record["train/compute_max_s"] > SLEEP_S for record in train)
    assert all(record["train/collective_wait_max_s"] > SLEEP_S / 2 for record in train)
    return warnings, train


def test_a_rank_slow_at_its_own_work_is_named_with_its_host_within_two_log_windows(
    tmp_path: Path,
) -> None:
    lines, records = spawn(2, train_ranks, tmp_path / "run", True, 4, 2, workdir=tmp_path)[0]
    warnings, train = rank_one_named_slowest(lines, records)
    assert all(
        line.startswith(f"WARNING rank 1 on {socket.gethostname()} is the slowest")
        for line in warnings
    )
    assert any(record["train/slowest_excess"] > THRESHOLD for record in train)


def test_ranks_alike_name_nobody(tmp_path: Path) -> None:
    lines, records = spawn(2, train_ranks, tmp_path / "run", False, 8, 4, workdir=tmp_path)[0]
    assert slowest_warnings(lines) == []
    train = [record for record in records if TRAINING_LOSS in record]
    assert len(train) == 2
    assert all(record["train/slowest_excess"] < THRESHOLD for record in train)
