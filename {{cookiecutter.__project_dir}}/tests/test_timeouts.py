"""A hung rank ends the job after `dist.timeout_s` (a checkpoint write that takes longer is
waited for: tests/test_restart.py), and is named: the log says which rank did not arrive, and
every rank leaves its Python stacks in the run directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import FAST, run_torchrun, write_fault_entry

pytestmark = [pytest.mark.distributed, pytest.mark.faults, pytest.mark.timeout(300)]

TIMEOUT_S = 4

#: Rank 1 stops making progress in step 6 (after the checkpoint of step 4, which times a save),
#: as a rank stuck in a driver call or a data loader.
HANG = """
train_step = Trainer.train_step


def hanging_train_step(self, batches):
    if self.env.rank == 1 and self.step + 1 == 6:
        print("rank 1 hangs in step 6", file=sys.stderr, flush=True)
        while True:
            time.sleep(1)
    return train_step(self, batches)


Trainer.train_step = hanging_train_step
"""


def _overrides(run_dir: Path) -> list[str]:
    # Stop checks every 0.2 s: the hung rank's stop deadline counts two of them.
    return [
        *FAST,
        f"run.dir={run_dir}",
        "train.max_steps=6",
        f"dist.timeout_s={TIMEOUT_S}",
        "checkpoint.stop_check_s=0.2",
    ]


def test_a_hung_rank_is_named_leaves_its_stacks_and_ends_without_being_killed(
    tmp_path: Path,
) -> None:
    """The waiting rank fails after dist.timeout_s and names rank 1 as missing; torchrun's
    SIGTERM then reaches the hung rank, which writes its stacks and exits within its stop
    deadline, before torchrun would kill it."""
    run_dir = tmp_path / "run"
    result = run_torchrun(2, _overrides(run_dir), entry=write_fault_entry(tmp_path, HANG))
    assert result.returncode != 0
    assert "rank 1 hangs in step 6" in result.stderr
    assert "rank(s) 1 did not arrive" in result.stderr
    assert "forcefully exiting" not in result.stderr  # no SIGKILL from torchrun
    hung = (run_dir / "stacks" / "rank_00001.txt").read_text()
    assert "in hanging_train_step" in hung
    waiting = (run_dir / "stacks" / "rank_00000.txt").read_text()
    assert "Timed out" in waiting
