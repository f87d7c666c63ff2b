"""SIGUSR1 stops training cleanly: every rank finishes the same step, a checkpoint is saved, and
the next launch continues from it (Slurm sends the signal ahead of a job's time limit)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from {{ cookiecutter.package_name }}.checkpoint import latest_checkpoint
from {{ cookiecutter.package_name }}.config import load_config
from {{ cookiecutter.package_name }}.trainer import Trainer

from .helpers import FAST, env_for, make_trainer, spawn

pytestmark = pytest.mark.timeout(300)

TOTAL_STEPS = 12
SIGNAL_DURING_STEP = 6  # not a checkpoint step (every 4): the stop must save its own


def _overrides(run_dir: Path, *extra: str) -> list[str]:
    return [*FAST, f"run.dir={run_dir}", f"train.max_steps={TOTAL_STEPS}", *extra]


def _signal_self_during_step(trainer: Trainer, step: int) -> None:
    """Make `trainer` send itself SIGUSR1 in the middle of optimizer step `step`."""
    train_step = trainer.train_step

    def signalling_train_step(batches: object) -> tuple:
        if trainer.step + 1 == step:
            os.kill(os.getpid(), signal.SIGUSR1)
        return train_step(batches)

    trainer.train_step = signalling_train_step


def _stop_on_one_rank_then_continue(rank: int, world_size: int, workdir: Path) -> dict:
    config = load_config(None, _overrides(workdir / "run"))
    env = env_for(rank, world_size)
    first = make_trainer(config, env)
    if rank == 1:
        _signal_self_during_step(first, SIGNAL_DURING_STEP)
    first.fit()
    newest = latest_checkpoint(first.run_dir)

    second = make_trainer(config, env)
    second.resume()
    resumed_at = second.step
    second.fit()
    return {
        "stopped_at": first.step,
        "newest_checkpoint": newest.name,
        "resumed_at": resumed_at,
        "finished_at": second.step,
    }


@pytest.mark.distributed
def test_sigusr1_on_one_rank_stops_every_rank_after_the_same_step_with_a_checkpoint(
    tmp_path: Path,
) -> None:
    results = spawn(2, _stop_on_one_rank_then_continue, tmp_path, workdir=tmp_path)
    for result in results:
        assert result["stopped_at"] == SIGNAL_DURING_STEP
        assert result["newest_checkpoint"] == f"step_{SIGNAL_DURING_STEP:08d}"
        assert result["resumed_at"] == SIGNAL_DURING_STEP
        assert result["finished_at"] == TOTAL_STEPS


def test_the_previous_sigusr1_handler_is_back_after_training(tmp_path: Path) -> None:
    trainer = make_trainer(load_config(None, _overrides(tmp_path)))
    _signal_self_during_step(trainer, 3)
    before = signal.getsignal(signal.SIGUSR1)
    trainer.fit()
    assert trainer.step == 3
    assert signal.getsignal(signal.SIGUSR1) is before


def test_with_stop_on_sigusr1_off_the_signal_is_left_alone(tmp_path: Path) -> None:
    config = load_config(None, _overrides(tmp_path, "checkpoint.stop_on_sigusr1=false"))
    trainer = make_trainer(config)
    train_step = trainer.train_step
    handlers = []

    def recording_train_step(batches: object) -> tuple:
        handlers.append(signal.getsignal(signal.SIGUSR1))
        return train_step(batches)

    trainer.train_step = recording_train_step
    before = signal.getsignal(signal.SIGUSR1)
    trainer.fit()
    assert trainer.step == TOTAL_STEPS
    assert set(handlers) == {before}
