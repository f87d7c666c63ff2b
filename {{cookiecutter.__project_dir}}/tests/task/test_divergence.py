"""Non-finite values never reach a checkpoint: weights that blow up stop the run at a log line;
a NaN loss on one rank stops every rank at one step with exit status 3, naming the step and the
rank (train.on_nonfinite=stop), or the step is skipped on every rank alike, buffers included
(train.on_nonfinite=skip); a non-finite buffer is named as one, with its module. The NaNs
injected into 2 ranks are marked `faults`; the blow-up, one process, runs wherever the task's
tests run."""

from __future__ import annotations

import inspect
import math
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from {{ cookiecutter.package_name }}.checkpointing.layout import complete_checkpoints
from {{ cookiecutter.package_name }}.config import load_config
from {{ cookiecutter.package_name }}.monitoring.metrics import read_metrics
from {{ cookiecutter.package_name }}.training.divergence import DivergenceError
from {{ cookiecutter.package_name }}.training.trainer import Trainer

from ..helpers import (
    FAST,
    TRAINING_LOSS,
    UPDATES,
    env_for,
    make_trainer,
    run_torchrun,
    spawn,
    write_fault_entry,
)
from ..tasks import FirstReleaseTask

pytestmark = pytest.mark.timeout(300)


def poison_the_next_micro_batch(losses):  # unannotated: a fault entry runs its source too
    """The next micro-batch's loss (the task's, and what is backpropagated) becomes NaN."""
    add = losses.add

    def poisoned(result, last):
        del losses.add  # once
        scaled = add(result, last)
        losses.values[-1] = losses.values[-1] * float("nan")
        return scaled * float("nan")

    losses.add = poisoned


#: The first micro-batch of step 10 on rank 1 gives a NaN loss, once.
NAN_ON_RANK_1_AT_STEP_10 = f"""
{inspect.getsource(poison_the_next_micro_batch)}
train_step = Trainer.train_step


def nan_once_on_rank_1(self, batches):
    if self.env.rank == 1 and self.step + 1 == 10 and not getattr(self, "poisoned", False):
        self.poisoned = True
        poison_the_next_micro_batch(self.updates[0].loss)
    return train_step(self, batches)


Trainer.train_step = nan_once_on_rank_1
"""


def _all_finite(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return not value.is_floating_point() or bool(value.isfinite().all())
    if isinstance(value, dict):
        return all(_all_finite(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return all(_all_finite(item) for item in value)
    return True


def _checkpoints_are_finite(run_dir: Path) -> bool:
    paths = complete_checkpoints(run_dir)
    states = [torch.load(path / "state.pt", weights_only=True) for path in paths]
    return all(_all_finite({key: state[key] for key in ("model", "optimizer")}) for state in states)


@pytest.mark.faults
@pytest.mark.distributed
def test_a_nan_loss_on_one_rank_stops_every_rank_before_any_checkpoint_holds_it(
    tmp_path: Path,
) -> None:
    """Logged every 50 steps, the NaN of step 10 is found by the check before the save at step
    12: checkpoints 4 and 8 stay, 12 is never written, and pruning kept the finite ones. Run
    through the project's launcher, which exits with the training's 3, with loader workers as
    on a real node: they must not keep the ranks from exiting."""
    run_dir = tmp_path / "run"
    overrides = [
        *FAST,
        f"run.dir={run_dir}",
        "train.max_steps=20",
        "train.log_every=50",
        "train.eval_every=50",
        "checkpoint.keep_last=2",
        "data.num_workers=2",
    ]
    entry = write_fault_entry(tmp_path, NAN_ON_RANK_1_AT_STEP_10)
    result = run_torchrun(2, overrides, entry=entry, launcher=True)
    assert result.returncode == 3, result.stderr[-4000:]  # the launcher's: torchrun says 1
    # The last lines are the training's message and its status; torchrun's report is in a file.
    *_, message, status = result.stderr.splitlines()
    assert "training diverged" in message
    assert status.startswith("launch: exit status 3 on ")
    assert "Traceback" not in result.stderr
    assert "exitcode" in (run_dir / f"torchrun_{socket.gethostname()}.log").read_text()
    # In a task with updates, those after the poisoned one read its weights, not finite now,
    # on every rank in the same step: rank 1 is named among them.
    ranks = r"(0, )?1" if UPDATES else "1"
    assert re.search(rf"the loss was not finite at step 10 on rank\(s\) {ranks} ", result.stderr)
    assert [path.name for path in complete_checkpoints(run_dir)] == [
        "step_00000004",
        "step_00000008",
    ]
    assert _checkpoints_are_finite(run_dir)
    assert "training complete" not in result.stderr


def blow_up(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    """Multiply the weights the optimizer steps by 1e10: they overflow within a few steps."""
    with torch.no_grad():
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.mul_(1e10)


def test_weights_that_blow_up_stop_the_run_at_a_log_line(tmp_path: Path) -> None:
    """After every optimizer step, whatever the task's optimizer: a learning rate far too high
    blows AdamW's weights up through its weight decay, but not Adam's, whose steps it bounds,
    nor an optimizer with a rate of its own. Not a fault injected under torchrun: every task
    runs it."""
    config = load_config(None, [*FAST, f"run.dir={tmp_path}", "train.max_steps=40"])
    trainer = make_trainer(config)
    for update in trainer.updates:
        update.optimizer.register_step_post_hook(blow_up)
    with pytest.raises(DivergenceError, match=r"training diverged: .* at step \d+"):
        trainer.fit()
    assert trainer.step < 40 and trainer.step % config.train.log_every == 0
    assert _checkpoints_are_finite(tmp_path)


class _NanOnRankOne(Trainer):
    """Rank 1's first micro-batch of step 3 gives a NaN loss."""

    def train_step(self, batches: Iterator[Any]) -> dict[str, torch.Tensor]:
        if self.env.rank == 1 and self.step + 1 == 3 and not getattr(self, "poisoned", False):
            self.poisoned = True
            poison_the_next_micro_batch(self.updates[0].loss)
        return super().train_step(batches)


def _skip_nan_step(rank: int, world_size: int, run_dir: Path, limit: int) -> dict[str, Any]:
    config = load_config(
        None,
        [
            *FAST,
            f"run.dir={run_dir}",
            "train.max_steps=6",
            "train.on_nonfinite=skip",
            "train.mixed_precision=none",  # fp16's loss scaler skips on its own: refused
            f"train.max_skipped_steps={limit}",
        ],
    )
    trainer = make_trainer(config, env_for(rank, world_size))
    trainer.__class__ = _NanOnRankOne
    try:
        status = trainer.fit()
    except DivergenceError as error:
        status = str(error)
    weights = torch.cat([param.detach().flatten() for param in trainer.model.parameters()])
    return {"status": status, "weights": weights, "skipped": trainer.skips.skipped}


def _skip_within_and_past_the_limit(rank: int, world_size: int, workdir: Path) -> list[dict]:
    return [_skip_nan_step(rank, world_size, workdir / f"limit_{limit}", limit) for limit in (1, 0)]


@pytest.fixture(scope="module")
def skipping(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[dict]]]:
    """One 2-rank launch: a run that may skip one step, then one that may skip none."""
    workdir = tmp_path_factory.mktemp("skip")
    return workdir, spawn(2, _skip_within_and_past_the_limit, workdir, workdir=workdir)


@pytest.mark.faults
@pytest.mark.distributed
def test_the_skip_policy_skips_a_nan_step_on_every_rank_alike(
    skipping: tuple[Path, list[list[dict]]],
) -> None:
    workdir, ranks = skipping
    within = [runs[0] for runs in ranks]
    assert [rank["status"] for rank in within] == [0, 0]
    assert [rank["skipped"] for rank in within] == [1, 1]
    assert torch.equal(within[0]["weights"], within[1]["weights"])
    assert bool(within[0]["weights"].isfinite().all())
    losses = [r[TRAINING_LOSS] for r in read_metrics(workdir / "limit_1") if TRAINING_LOSS in r]
    assert losses and all(map(torch.isfinite, torch.tensor(losses)))
    assert _checkpoints_are_finite(workdir / "limit_1")


@pytest.mark.faults
@pytest.mark.distributed
def test_the_skip_policy_stops_every_rank_past_its_limit(
    skipping: tuple[Path, list[list[dict]]],
) -> None:
    workdir, ranks = skipping
    for runs in ranks:
        of = r"( of \w+)?"  # in a task with updates, the update skipped
        skipped = rf"step 3: the gradient norm{of} is nan; the step{of} is skipped"
        assert re.search(skipped, runs[1]["status"])
        assert "too many" in runs[1]["status"]
    assert _checkpoints_are_finite(workdir / "limit_0")


class _InputTracker(nn.Module):
    """A moving average of its inputs in a buffer, as an input normaliser keeps one, assigned
    anew at each training forward (`self.mean = ...`); the inputs pass unchanged."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(width))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.mean = 0.9 * self.mean + 0.1 * inputs.detach().mean(dim=0)
        return inputs


class _BatchNormTask(FirstReleaseTask):
    """An MLP with buffers that its forward changes (an input tracker's, BatchNorm's running
    statistics and its count of batches); on rank `nan_rank`, its `nan_at`-th loss sees one
    NaN input sample."""

    nan_rank = 0
    nan_at = 0
    calls = 0

    def build_model(self) -> nn.Module:
        return nn.Sequential(
            _InputTracker(4), nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3)
        )

    def training_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        self.calls += 1
        inputs, labels = batch
        if self.calls == self.nan_at and torch.distributed.get_rank() == self.nan_rank:
            inputs = inputs.clone()
            inputs[0] = float("nan")
        return super().training_loss(model, (inputs, labels))


class _BuffersAroundStepThree(Trainer):
    """Keeps the model's buffers before and after step 3."""

    def train_step(self, batches: Iterator[Any]) -> dict[str, torch.Tensor]:
        if self.step + 1 != 3:
            return super().train_step(batches)
        self.before = {name: b.clone() for name, b in self.model.named_buffers()}
        norms = super().train_step(batches)
        self.after = {name: b.clone() for name, b in self.model.named_buffers()}
        return norms


def _skip_a_nan_sample(rank: int, world_size: int, run_dir: Path) -> dict[str, Any]:
    """6 steps of 2 micro-batches per rank; rank 0's first micro-batch of step 3 holds a NaN
    sample (rank 0's buffers are those DDP broadcasts at every forward, and those saved)."""
    settings = [
        *FAST,
        f"run.dir={run_dir}",
        "train.global_batch_size=32",
        "train.micro_batch_size=8",
        "train.max_steps=6",
        "train.on_nonfinite=skip",
        "train.mixed_precision=none",
    ]
    config = load_config(None, settings)
    task = _BatchNormTask(config.task, seed=config.run.seed)
    task.nan_at = 5
    trainer = make_trainer(config, env_for(rank, world_size), task)
    trainer.__class__ = _BuffersAroundStepThree
    status = trainer.fit()
    return {
        "status": status,
        "skipped": trainer.skips.skipped,
        "before": trainer.before,
        "after": trainer.after,
    }


@pytest.fixture(scope="module")
def nan_sample(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    workdir = tmp_path_factory.mktemp("nan_sample")
    return workdir / "run", spawn(2, _skip_a_nan_sample, workdir / "run", workdir=workdir)


@pytest.mark.distributed
def test_a_skipped_step_leaves_the_buffers_as_they_were(
    nan_sample: tuple[Path, list[dict[str, Any]]],
) -> None:
    """BatchNorm's running statistics and count of batches, and a buffer assigned anew by its
    module's forward, on every rank: the NaN sample's forward changed them all before the
    step was judged."""
    _, ranks = nan_sample
    for rank in ranks:
        assert rank["skipped"] == 1
        assert rank["before"].keys() == rank["after"].keys()
        for name, before in rank["before"].items():
            assert torch.equal(before, rank["after"][name]), name


@pytest.mark.distributed
def test_a_nan_sample_skipped_leaves_the_run_to_finish_with_finite_evaluations(
    nan_sample: tuple[Path, list[dict[str, Any]]],
) -> None:
    """Without its buffers put back, rank 0's NaN running mean (broadcast to every rank) made
    every evaluation NaN, and the run stopped at the next checkpoint with exit status 3."""
    run_dir, ranks = nan_sample
    assert [rank["status"] for rank in ranks] == [0, 0]
    losses = [record["eval/loss"] for record in read_metrics(run_dir) if "eval/loss" in record]
    assert losses and all(map(math.isfinite, losses))
    assert _checkpoints_are_finite(run_dir)


class _OverflowingBufferTask(_BatchNormTask):
    """Its loss multiplies the input tracker's buffer past float32's range at its 9th call
    (step 3): every loss and gradient stays finite."""

    def training_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        if self.calls == 8:
            with torch.no_grad():
                model[0].mean.mul_(1e30).mul_(1e30)
        return super().training_loss(model, batch)


def test_a_non_finite_buffer_is_named_with_its_module_and_the_data_not_the_learning_rate(
    tmp_path: Path,
) -> None:
    # 4 micro-batches a step, whatever the project's task trains with: the overflow is in step 3.
    batches = ["train.global_batch_size=32", "train.micro_batch_size=8"]
    config = load_config(None, [*FAST, f"run.dir={tmp_path}", "train.max_steps=8", *batches])
    trainer = make_trainer(config, task=_OverflowingBufferTask(config.task, seed=1))
    with pytest.raises(DivergenceError) as error:
        trainer.fit()
    message = str(error.value)
    assert "buffers held non-finite values at step 4, while every loss and gradient" in message
    assert "mean of 0 (_InputTracker) on rank(s) 0" in message
    assert "input samples" in message and "optim.lr" in message
    assert "a lower optim.lr" not in message
    assert [path.name for path in complete_checkpoints(tmp_path)] == []
