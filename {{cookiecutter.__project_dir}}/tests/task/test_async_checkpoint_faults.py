"""Faults of checkpoints written in the background (checkpoint.async) on 2 ranks (gloo): a
save that fails while training goes on is raised at the next wait on every rank. A rank killed
in the middle of a background write: tests/task/test_object_store.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from {{ cookiecutter.package_name }}.checkpointing.checkpoint import CheckpointSaveError
from {{ cookiecutter.package_name }}.config import load_config

from ..helpers import FAST, env_for, make_trainer, spawn, train_steps
from .test_checkpoint_faults import full_disk_on

pytestmark = [pytest.mark.distributed, pytest.mark.faults, pytest.mark.timeout(240)]


def _full_disk_on_rank_1_in_a_background_save(
    rank: int, world_size: int, run_dir: Path
) -> tuple[str, int]:
    config = load_config(None, [*FAST, f"run.dir={run_dir}", "checkpoint.async=true"])
    trainer = make_trainer(config, env_for(rank, world_size))
    train_steps(trainer, 2)
    trainer.save_in_background()
    trainer.wait_for_save()
    with full_disk_on(rank == 1):
        train_steps(trainer, 2)
        trainer.save_in_background()  # fails in the background
        train_steps(trainer, 2)  # while training goes on
        trainer.background.poll()
        try:
            trainer.save_in_background()  # the next wait
            outcome = "saved"
        except CheckpointSaveError as error:
            outcome = str(error)
    return outcome, trainer.step


def test_a_background_save_that_fails_is_raised_at_the_next_wait_on_every_rank(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    results = spawn(2, _full_disk_on_rank_1_in_a_background_save, run_dir, workdir=tmp_path)
    assert results[0][0] == results[1][0]
    for outcome, step in results:
        assert "cannot save checkpoint step_00000004 (rank 1: [Errno 28] No space left" in outcome
        assert step == 6
    assert [path.name for path in (run_dir / "checkpoints").iterdir()] == ["step_00000002"]
