"""Workers whose launcher dies stop as on SIGTERM: a checkpoint of every rank at one step, and
no process left training on as an orphan beside the next launch."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from {{ cookiecutter.package_name }}.checkpointing.layout import COMPLETE_MARKER, latest_checkpoint
from {{ cookiecutter.package_name }}.checkpointing.run_lock import LOCK_FILE

from ..helpers import FAST, run_torchrun, write_fault_entry

pytestmark = [pytest.mark.distributed, pytest.mark.faults, pytest.mark.timeout(180)]

KILL_IN_STEP = 3
TOTAL_STEPS = 400  # far more than the workers need to notice: they never get there

#: Each rank records its pid in PIDS; rank 0 SIGKILLs torchrun (its parent) in step 3. Every
#: step takes 20 ms or more, so that training would still run for 8 s.
KILL_THE_LAUNCHER = """
from {{ cookiecutter.package_name }}.faults import parent_watch

parent_watch.POLL_S = 0.1
with open(os.path.join(PIDS, f"rank_{os.environ['RANK']}.pid"), "w") as handle:
    handle.write(str(os.getpid()))
train_step = Trainer.train_step


def killing_train_step(self, batches):
    if self.env.rank == 0 and self.step + 1 == KILL_IN_STEP:
        os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(0.02)
    return train_step(self, batches)


Trainer.train_step = killing_train_step
"""


def _ended(pid: int) -> bool:
    """Whether `pid` has exited (a zombie that its new parent has not reaped yet counts)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


def _wait_until_ended(pids: list[int], timeout_s: float) -> list[int]:
    """The pids still running after up to `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while (running := [pid for pid in pids if not _ended(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return running


def test_killing_torchrun_stops_its_workers_with_a_checkpoint_at_one_step(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    fault = KILL_THE_LAUNCHER.replace("PIDS", repr(str(tmp_path))).replace(
        "KILL_IN_STEP", str(KILL_IN_STEP)
    )
    # Stop checks after every step: the stop comes a step or two after the launcher's death.
    steps = f"train.max_steps={TOTAL_STEPS}"
    workers = "data.num_workers=2"  # as on a real node
    overrides = [*FAST, f"run.dir={run_dir}", steps, "checkpoint.stop_check_s=0", workers]
    result = run_torchrun(2, overrides, entry=write_fault_entry(tmp_path, fault))
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    pids = [int((tmp_path / f"rank_{rank}.pid").read_text()) for rank in range(2)]
    orphans = _wait_until_ended(pids, timeout_s=60)
    for pid in orphans:  # never leave them behind, whatever the test finds
        os.kill(pid, signal.SIGKILL)
    assert not orphans, f"workers {orphans} still train with their launcher gone"

    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint is not None
    step = int(checkpoint.name.removeprefix("step_"))
    assert KILL_IN_STEP < step < TOTAL_STEPS
    marker = json.loads((checkpoint / COMPLETE_MARKER).read_text())
    assert marker["world_size"] == 2
    log = (run_dir / "train.log").read_text()
    assert "the launcher (pid" in log and f"stopped at step {step} of {TOTAL_STEPS}" in log
    assert "the launcher (pid" in (run_dir / "train.rank1.log").read_text()
    assert not (run_dir / LOCK_FILE).exists()
