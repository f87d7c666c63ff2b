"""Two timeouts: a hung rank ends the job after `dist.timeout_s`, while a checkpoint write that
takes longer than that is waited for (`dist.barrier_timeout_s`)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from {{ cookiecutter.package_name }}.checkpoint import latest_checkpoint

from .helpers import FAST, run_torchrun, write_fault_entry

pytestmark = [pytest.mark.distributed, pytest.mark.faults, pytest.mark.timeout(300)]

TIMEOUT_S = 4

#: Rank 1 stops making progress in step 3, as a rank stuck in a driver call or a data loader.
HANG = """
train_step = Trainer.train_step


def hanging_train_step(self, batches):
    if self.env.rank == 1 and self.step + 1 == 3:
        print("rank 1 hangs in step 3", file=sys.stderr, flush=True)
        while True:
            time.sleep(1)
    return train_step(self, batches)


Trainer.train_step = hanging_train_step
"""

#: Rank 0 takes {seconds} s to write the replicated state, as a large model on a slow disk.
SLOW_SAVE = """
atomic_save = checkpoint._atomic_save


def slow_atomic_save(obj, path):
    if path.name == checkpoint.STATE_FILE:
        time.sleep({seconds})
    return atomic_save(obj, path)


checkpoint._atomic_save = slow_atomic_save
"""


def _overrides(run_dir: Path) -> list[str]:
    return [*FAST, f"run.dir={run_dir}", "train.max_steps=6", f"dist.timeout_s={TIMEOUT_S}"]


def test_a_hung_rank_ends_the_job_after_the_collective_timeout(tmp_path: Path) -> None:
    """Not after the ten minutes of a single long timeout: the waiting rank fails after
    dist.timeout_s, and torchrun then ends the hung one (after its 30 s grace period)."""
    started = time.monotonic()
    result = run_torchrun(2, _overrides(tmp_path / "run"), entry=write_fault_entry(tmp_path, HANG))
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    assert "rank 1 hangs in step 3" in result.stderr
    assert elapsed < 120, f"the job took {elapsed:.0f} s to end"


def test_a_checkpoint_write_longer_than_the_collective_timeout_is_waited_for(
    tmp_path: Path,
) -> None:
    slow_save = SLOW_SAVE.format(seconds=2 * TIMEOUT_S)
    run_dir = tmp_path / "run"
    overrides = [*_overrides(run_dir), "checkpoint.every_steps=6"]  # one save, at the end
    result = run_torchrun(2, overrides, entry=write_fault_entry(tmp_path, slow_save))
    assert result.returncode == 0, result.stderr[-6000:]
    assert latest_checkpoint(run_dir).name == "step_00000006"
