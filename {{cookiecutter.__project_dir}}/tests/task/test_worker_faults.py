"""With loader worker processes on, as on any real node, every way a run stops keeps its
documented outcome.

The signals are sent as launchers and terminals send them: torchrun passes a SIGTERM or SIGINT
on to each rank's whole process group, loader workers included; `scancel` and container
runtimes signal every process of the job; a terminal's Ctrl-C reaches torchrun, twice when
pressed twice. The workers never act on them: the ranks stop together at one step, with a
checkpoint there. A worker that dies for its own reason (an error in the data set, the
out-of-memory killer) ends the job on every rank, named. The other fault tests pin
`data.num_workers` too (test_divergence.py, test_timeouts.py, test_restart.py,
test_parent_death.py), at 2 where workers change what happens.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from {{ cookiecutter.package_name }}.checkpointing.layout import latest_checkpoint
from {{ cookiecutter.package_name }}.checkpointing.run_lock import LOCK_FILE

from ..helpers import FAST, run_torchrun, write_fault_entry

pytestmark = [pytest.mark.distributed, pytest.mark.faults, pytest.mark.timeout(300)]

#: Loader workers per rank, kept from epoch to epoch (data.persistent_workers, the default).
WORKERS = "data.num_workers=2"
TOTAL_STEPS = 400  # far more than a stop needs: a run that reaches the end did not stop
SIGNAL_IN_STEP = 6

#: Rank 0 has a signal sent by SEND (Python source using `launcher`, torchrun's pid, and
#: `job`, every process under it) in Trainer.MOMENT (a step or an evaluation) once it reaches
#: step SIGNAL_IN_STEP. Every step takes 20 ms or more, so that training would run on for 8 s.
SIGNALLING = """
import subprocess
from pathlib import Path


def descendants(pid):
    children = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            children += [int(child) for child in (task / "children").read_text().split()]
    except FileNotFoundError:  # a process or thread that ended meanwhile
        pass
    return children + [grandchild for child in children for grandchild in descendants(child)]


original, train_step, sent = Trainer.MOMENT, Trainer.train_step, []


def signalling(self, *args, **kwargs):
    if self.env.rank == 0 and self.step + 1 >= SIGNAL_IN_STEP and not sent:
        sent.append(True)
        launcher = os.getppid()
        job = [launcher, *descendants(launcher)]
        subprocess.Popen(["sh", "-c", f"SEND"], start_new_session=True)
    return original(self, *args, **kwargs)


def slow_train_step(self, batches):
    time.sleep(0.02)
    return train_step(self, batches)


Trainer.train_step = slow_train_step
Trainer.MOMENT = signalling
"""

#: How each is sent: by a process outside the job, as a launcher, a scheduler or a terminal is.
SENDERS = {
    "sigterm-to-torchrun": "kill -TERM {launcher}",
    "sigterm-to-every-process": "kill -TERM {' '.join(map(str, job))}",
    "ctrl-c-twice": "kill -INT {launcher}; sleep 0.3; kill -INT {launcher}",
}


def _overrides(run_dir: Path, *extra: str) -> list[str]:
    # The ranks check for a stop every second, as by default: a second Ctrl-C or torchrun's
    # next signal arrives while they train on towards the stop.
    return [*FAST, f"run.dir={run_dir}", f"train.max_steps={TOTAL_STEPS}", WORKERS, *extra]


@pytest.mark.parametrize(
    ("sender", "moment", "settings"),
    [
        ("sigterm-to-torchrun", "evaluate", ("checkpoint.async=true",)),
        ("sigterm-to-every-process", "train_step", ()),
        ("ctrl-c-twice", "train_step", ()),
    ],
    ids=[
        "sigterm-to-torchrun-in-an-evaluation-with-background-saves",
        "sigterm-to-every-process-in-a-step",
        "ctrl-c-twice-in-a-step",
    ],
)
def test_a_stop_signal_sent_as_launchers_send_it_stops_every_rank_with_a_checkpoint(
    tmp_path: Path, sender: str, moment: str, settings: tuple[str, ...]
) -> None:
    run_dir = tmp_path / "run"
    fault = SIGNALLING.replace("SIGNAL_IN_STEP", str(SIGNAL_IN_STEP)).replace("MOMENT", moment)
    fault = fault.replace("SEND", SENDERS[sender])
    overrides = _overrides(run_dir, *settings)
    result = run_torchrun(2, overrides, entry=write_fault_entry(tmp_path, fault))
    log = (run_dir / "train.log").read_text()
    stopped = re.search(rf"stopped at step (\d+) of {TOTAL_STEPS} on SIG\w+", log)
    assert stopped, result.stderr[-4000:]
    assert "(exit status 75)" in log
    assert "DataLoader worker" not in result.stderr
    step = int(stopped.group(1))
    assert SIGNAL_IN_STEP <= step < TOTAL_STEPS
    assert latest_checkpoint(run_dir).name == f"step_{step:08d}"
    assert not (run_dir / LOCK_FILE).exists()


#: In rank 1's first loader worker, the 20th sample it reads fails: WHAT is Python source that
#: raises (a damaged file) or ends the process (the out-of-memory killer's SIGKILL).
FAILING_WORKER = """
from torch.utils.data import get_worker_info

from {{ cookiecutter.package_name }}.task import Task

build_datasets = Task.build_datasets


class FailsInRankOnesFirstWorker:
    def __init__(self, dataset):
        self.dataset, self.read = dataset, 0

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        worker = get_worker_info()
        if os.environ["RANK"] == "1" and worker is not None and worker.id == 0:
            self.read += 1
            if self.read == 20:
                WHAT
        return self.dataset[index]


def failing_build_datasets(self):
    train, evaluation = build_datasets(self)
    return FailsInRankOnesFirstWorker(train), evaluation


Task.build_datasets = failing_build_datasets
"""


@pytest.mark.parametrize(
    ("what", "named"),
    [
        (
            'raise OSError("read error on the data disk")',
            r"rank 1 on \S+: loader worker 0 \(pid \d+\) could not load sample \d+ of the "
            r"training set: OSError: read error on the data disk",
        ),
        (
            "os.kill(os.getpid(), signal.SIGKILL)",
            r"rank 1 on \S+: its loader worker \(pid \d+\) (is killed by signal: Killed|exited "
            r"unexpectedly): the out-of-memory killer",
        ),
    ],
    ids=["error-in-the-data-set", "killed"],
)
def test_a_worker_that_dies_ends_every_rank_naming_it(
    tmp_path: Path, what: str, named: str
) -> None:
    run_dir = tmp_path / "run"
    fault = FAILING_WORKER.replace("WHAT", what)
    overrides = _overrides(run_dir, "dist.timeout_s=20")
    result = run_torchrun(2, overrides, entry=write_fault_entry(tmp_path, fault))
    assert result.returncode != 0
    assert re.search(named, (run_dir / "train.rank1.log").read_text()), result.stderr[-4000:]
    assert "rank 1 on" in (run_dir / "train.log").read_text()  # rank 0 names who is gone
    assert not (run_dir / LOCK_FILE).exists()
