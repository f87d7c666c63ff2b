"""Checkpoint faults on 2 ranks (gloo): a full disk on one rank, one rank out of memory while
loading, a directory listing that lags on one rank, a rank hung in a save. Every rank ends or
resumes alike, and no earlier checkpoint or metric is lost."""

from __future__ import annotations

import errno
import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }}.checkpointing import checkpoint as checkpoint_module
from {{ cookiecutter.package_name }}.checkpointing import newest_intact
from {{ cookiecutter.package_name }}.checkpointing.checkpoint import CheckpointSaveError
from {{ cookiecutter.package_name }}.checkpointing.layout import complete_checkpoints
from {{ cookiecutter.package_name }}.checkpointing.resume import ResumeError
from {{ cookiecutter.package_name }}.config import Config, load_config
from {{ cookiecutter.package_name }}.monitoring.metrics import read_metrics
from {{ cookiecutter.package_name }}.training.trainer import Trainer

from ..helpers import FAST, env_for, make_trainer, spawn, train_steps

pytestmark = [pytest.mark.distributed, pytest.mark.faults, pytest.mark.timeout(120)]


def _trainer(rank: int, world_size: int, run_dir: Path) -> tuple[Config, Trainer]:
    config = load_config(None, [*FAST, f"run.dir={run_dir}"])
    return config, make_trainer(config, env_for(rank, world_size))


def _checkpoints_of_steps_2_and_4(rank: int, world_size: int, run_dir: Path) -> Config:
    config, trainer = _trainer(rank, world_size, run_dir)
    for step in (2, 4):
        train_steps(trainer, 2)
        trainer.metrics.log(step, {"train/loss": float(step)})
        trainer.save()
    trainer.metrics.log(6, {"train/loss": 6.0})  # a step after the last checkpoint
    return config


def _resume(config: Config, rank: int, world_size: int) -> int | str:
    """The step a new launch resumes at, or the message it ends with."""
    try:
        resumed = make_trainer(config, env_for(rank, world_size))
        resumed.resume()
    except ResumeError as error:
        return str(error)
    return resumed.step


@contextmanager
def full_disk_on(this_rank: bool) -> Iterator[None]:
    """While inside, every write of a checkpoint file on this rank (when `this_rank`) fails as
    on a full disk."""
    write = checkpoint_module._HashingWriter.write

    def full_disk_write(self: object, data: bytes) -> int:
        self.error = OSError(errno.ENOSPC, "No space left on device")
        raise self.error

    if this_rank:
        checkpoint_module._HashingWriter.write = full_disk_write
    try:
        yield
    finally:
        checkpoint_module._HashingWriter.write = write


def _full_disk_on_rank_1_in_the_second_save(
    rank: int, world_size: int, run_dir: Path
) -> tuple[str, int | str]:
    config, trainer = _trainer(rank, world_size, run_dir)
    train_steps(trainer, 2)
    trainer.save()
    with full_disk_on(rank == 1):
        train_steps(trainer, 2)
        try:
            trainer.save()
            outcome = "saved"
        except CheckpointSaveError as error:
            outcome = str(error)
    # Space was freed: launch again.
    return outcome, _resume(config, rank, world_size)


def test_a_full_disk_on_one_rank_fails_the_save_on_every_rank_and_the_next_launch_resumes(
    tmp_path: Path,
) -> None:
    """The failed save's staging directory is gone and the previous checkpoint is resumed."""
    run_dir = tmp_path / "run"
    results = spawn(2, _full_disk_on_rank_1_in_the_second_save, run_dir, workdir=tmp_path)
    for outcome, resumed_at in results:
        assert "cannot save checkpoint step_00000004 (rank 1: [Errno 28] No space left" in outcome
        assert "the previous checkpoint, step_00000002, takes" in outcome and "free in" in outcome
        assert resumed_at == 2
    assert [path.name for path in (run_dir / "checkpoints").iterdir()] == ["step_00000002"]


def _rank_1_out_of_memory_while_loading(rank: int, world_size: int, run_dir: Path) -> int | str:
    config = _checkpoints_of_steps_2_and_4(rank, world_size, run_dir)
    if rank == 1:

        def out_of_memory(*args: object, **kwargs: object) -> None:
            raise RuntimeError(
                "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
                "you tried to allocate 34359738368 bytes."
            )

        torch.load = out_of_memory
    return _resume(config, rank, world_size)


def test_out_of_memory_on_one_rank_while_loading_ends_every_rank_and_touches_nothing(
    tmp_path: Path,
) -> None:
    """Not damage: no checkpoint is set aside, no metric is cut back, no rank starts over."""
    run_dir = tmp_path / "run"
    messages = spawn(2, _rank_1_out_of_memory_while_loading, run_dir, workdir=tmp_path)
    newest = run_dir / "checkpoints" / "step_00000004"
    for message in messages:
        assert f"rank 1: cannot read {newest / 'state.pt'}: RuntimeError" in str(message)
        assert "can't allocate memory" in str(message)
    assert [path.name for path in complete_checkpoints(run_dir)] == [
        "step_00000002",
        "step_00000004",
    ]
    assert len(list((run_dir / "checkpoints").iterdir())) == 2
    assert [record["step"] for record in read_metrics(run_dir)] == [2, 4, 6]


def _rank_1_listing_lags(
    rank: int, world_size: int, run_dir: Path, lagging_listings: int
) -> int | str:
    """Rank 1's first `lagging_listings` listings miss the newest checkpoint, as a client of
    NFS shows a directory from its attribute cache."""
    config = _checkpoints_of_steps_2_and_4(rank, world_size, run_dir)
    if rank == 1:
        listings = itertools.count()
        complete = newest_intact.complete_checkpoints

        def lagging(run_dir: Path) -> list[Path]:
            found = complete(run_dir)
            return found[:-1] if next(listings) < lagging_listings else found

        newest_intact.complete_checkpoints = lagging
        newest_intact.LISTING_WAIT_S = 1.0
    return _resume(config, rank, world_size)


def test_every_rank_resumes_the_checkpoint_rank_0_chose_when_one_ranks_listing_lags(
    tmp_path: Path,
) -> None:
    steps = spawn(2, _rank_1_listing_lags, tmp_path / "run", 2, workdir=tmp_path)
    assert steps == [4, 4]


def test_a_checkpoint_one_rank_never_sees_ends_every_rank_naming_the_file_system(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    messages = spawn(2, _rank_1_listing_lags, run_dir, 10**6, workdir=tmp_path)
    for message in messages:
        assert "rank 1: " in str(message) and "step_00000004 is listed on rank 0" in str(message)
        assert "not on a file system that every node shares" in str(message)
    assert len(complete_checkpoints(run_dir)) == 2  # nothing set aside


def _rank_1_hangs_in_its_second_save(rank: int, world_size: int, run_dir: Path) -> str:
    """Rank 1 hangs in its write until rank 0 has given up on it (or for a minute at most)."""
    checkpoint_module.SAVE_TIMEOUT_FLOOR_S = 1.0
    _, trainer = _trainer(rank, world_size, run_dir)
    train_steps(trainer, 2)
    trainer.save()
    given_up = run_dir / "rank_0_gave_up"
    if rank == 1:

        def hung_save(obj: object, path: Path) -> None:
            deadline = time.monotonic() + 60
            while not given_up.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            raise RuntimeError("released" if given_up.exists() else "never released")

        checkpoint_module._atomic_save = hung_save
    train_steps(trainer, 2)
    try:
        trainer.save()
    except CheckpointSaveError as error:
        given_up.touch()
        return str(error)
    except RuntimeError as error:
        return str(error)
    return "saved"


def test_a_rank_hung_in_a_save_ends_the_job_by_the_bound_from_the_previous_write_and_is_named(
    tmp_path: Path,
) -> None:
    """Rank 0 stops waiting while rank 1 still hangs, long before dist.barrier_timeout_s."""
    rank_0, rank_1 = spawn(2, _rank_1_hangs_in_its_second_save, tmp_path / "run", workdir=tmp_path)
    assert rank_1 == "released"
    assert "checkpoint step_00000004: not every rank finished its part of the save" in rank_0
    assert "Ranks 1 failed to pass monitoredBarrier" in rank_0
