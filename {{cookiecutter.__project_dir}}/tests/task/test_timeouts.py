"""A hung rank ends the job after `dist.timeout_s` (a checkpoint write that takes longer is
waited for: tests/task/test_restart.py), and is named: the log says which rank did not arrive, and
every rank leaves its Python stacks in the run directory. A rank that waits at start-up for a
peer that never comes ends after the start-up timeout, or at once on a stop signal or when its
launcher dies, instead of waiting in a connect that no Python handler interrupts. A rank ended
by a fatal signal (NCCL's watchdog aborts a rank whose collective timed out) leaves its stacks
in its log."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from {{ cookiecutter.package_name }}.cluster.distributed import DistEnv
from {{ cookiecutter.package_name }}.faults import watchdog

from ..helpers import FAST, run_torchrun, write_fault_entry

pytestmark = [pytest.mark.distributed, pytest.mark.faults, pytest.mark.timeout(300)]

#: Long enough for the slowest collective of a loaded test machine, each rank with its loader
#: workers, yet a short wait for the hung rank.
TIMEOUT_S = 8

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
    # Stop checks every 0.2 s: the hung rank's stop deadline counts two of them. Loader workers
    # as on a real node (they inherit what the rank has open when they start).
    return [
        *FAST,
        f"run.dir={run_dir}",
        "train.max_steps=6",
        f"dist.timeout_s={TIMEOUT_S}",
        "checkpoint.stop_check_s=0.2",
        "data.num_workers=2",
    ]


def test_a_hung_rank_is_named_leaves_its_stacks_and_ends_without_being_killed(
    tmp_path: Path,
) -> None:
    """The waiting rank fails after dist.timeout_s and names rank 1 as missing; torchrun's
    SIGTERM then reaches the hung rank, which writes its stacks and exits within its stop
    deadline, before torchrun would kill it. Its loader workers, forked with what it had open,
    hold none of it up."""
    run_dir = tmp_path / "run"
    result = run_torchrun(2, _overrides(run_dir), entry=write_fault_entry(tmp_path, HANG))
    assert result.returncode != 0
    assert "rank 1 hangs in step 6" in result.stderr
    assert f"rank 1 on {socket.gethostname()} did not answer" in result.stderr
    assert "forcefully exiting" not in result.stderr  # no SIGKILL from torchrun
    hung = (run_dir / "stacks" / "rank_00001.txt").read_text()
    assert "in hanging_train_step" in hung
    waiting = (run_dir / "stacks" / "rank_00000.txt").read_text()
    assert "Timed out" in waiting


#: Rank 1 aborts in step 3, as NCCL's watchdog aborts a rank whose collective timed out.
ABORT = """
train_step = Trainer.train_step


def aborting_train_step(self, batches):
    if self.env.rank == 1 and self.step + 1 == 3:
        os.abort()
    return train_step(self, batches)


Trainer.train_step = aborting_train_step
"""


def test_a_rank_ended_by_a_fatal_signal_leaves_its_python_stacks_in_its_log(
    tmp_path: Path,
) -> None:
    """SIGABRT, where no Python handler runs: faulthandler writes the stacks of the rank's
    threads to its log file first."""
    run_dir = tmp_path / "run"
    result = run_torchrun(2, _overrides(run_dir), entry=write_fault_entry(tmp_path, ABORT))
    assert result.returncode != 0
    log = (run_dir / "train.rank1.log").read_text()
    assert "Fatal Python error: Aborted" in log
    assert "in aborting_train_step" in log


def _rank_0_of_two(tmp_path: Path, *overrides: str) -> tuple[list[str], dict[str, str]]:
    """The command and environment of rank 0 of a job of two whose rank 1 never starts."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    command = [
        sys.executable,
        "-m",
        "{{ cookiecutter.package_name }}.train",
        *FAST,
        f"run.dir={tmp_path / 'run'}",
        *overrides,
    ]
    return command, env


def _wait_until_listening(port: int, process: subprocess.Popen) -> None:
    """Until rank 0 hosts the rendezvous store: it is then waiting for rank 1."""
    while process.poll() is None:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)


def test_a_peer_that_never_starts_ends_the_start_up_naming_it(tmp_path: Path) -> None:
    command, env = _rank_0_of_two(tmp_path, "dist.timeout_s=2")
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "the 2 ranks did not all reach the rendezvous store" in result.stderr
    assert "within dist.timeout_s=2 s" in result.stderr
    assert not (tmp_path / "run").exists()


def test_sigterm_while_the_process_group_starts_ends_the_rank_with_75(tmp_path: Path) -> None:
    command, env = _rank_0_of_two(tmp_path, "dist.timeout_s=120")
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    _wait_until_listening(int(env["MASTER_PORT"]), process)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 75, stderr[-3000:]
    assert "SIGTERM arrived while the process group was still starting" in stderr


def test_a_rank_whose_launcher_dies_while_it_starts_exits(tmp_path: Path) -> None:
    """The launcher (a shell here) ends while its rank waits for a peer: the rank notices
    within a second, and exits as on SIGTERM, with nothing to save."""
    command, env = _rank_0_of_two(tmp_path, "dist.timeout_s=120")
    log, pid_file = tmp_path / "rank0.log", tmp_path / "rank0.pid"
    launcher = f'"$@" 2>{log} & echo $! >{pid_file}; wait'
    process = subprocess.Popen(["bash", "-c", launcher, "launcher", *command], env=env)
    _wait_until_listening(int(env["MASTER_PORT"]), process)
    process.kill()
    process.wait()
    pid = int(pid_file.read_text())
    while _running(pid):
        time.sleep(0.2)
    text = log.read_text()
    assert "the launcher (pid" in text
    assert "SIGTERM arrived while the process group was still starting" in text


def _running(pid: int) -> bool:
    """Whether `pid` runs (an ended process that nobody reaped yet does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


class _SilentStore:
    """A store in which the keys waited for never appear: counts the polls."""

    def __init__(self) -> None:
        self.polls = 0

    def wait(self, keys: list[str], timeout: object) -> None:
        self.polls += 1
        raise dist.DistStoreError("Timeout")


def test_rank_0_waits_the_whole_naming_bound_for_an_answer_while_no_stop_signal_came() -> None:
    store = _SilentStore()
    waited = watchdog._wait_for_answers(store, ["alive/1"], 2.0, stopped=lambda: False)
    assert (waited, store.polls) == (2.0, 2.0 / watchdog.NAMING_POLL_S)


def test_rank_0_stops_waiting_for_answers_soon_after_a_stop_signal() -> None:
    """torchrun ends the others as soon as a worker dies: rank 0 names who is missing then,
    instead of waiting the whole bound for a rank that is gone."""
    store = _SilentStore()
    waited = watchdog._wait_for_answers(store, ["alive/1"], 600.0, stopped=lambda: True)
    assert waited == watchdog.NAMING_AFTER_STOP_S
    assert store.polls == watchdog.NAMING_AFTER_STOP_S / watchdog.NAMING_POLL_S


def test_a_rank_that_never_answers_is_named_with_the_time_rank_0_waited(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(watchdog, "rendezvous_store", dist.HashStore)
    error = RuntimeError("Connection closed by peer [10.0.0.2]:41234")
    env = DistEnv(rank=0, local_rank=0, world_size=2, launcher="torchrun")
    watchdog.name_missing_ranks(error, env, tmp_path, wait_s=600, stopped=lambda: True)
    assert "rank 1 on an unknown host did not answer within 1 s: hung, gone" in caplog.text
