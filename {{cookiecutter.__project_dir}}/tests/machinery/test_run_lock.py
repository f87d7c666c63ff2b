"""One job per run directory: a second job is refused naming the first, a dead job's lock is
taken over (by exactly one of the jobs that race for it), and a live job's never is."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from dataclasses import asdict
from pathlib import Path

import pytest

from {{ cookiecutter.package_name }}.checkpointing import run_lock
from {{ cookiecutter.package_name }}.checkpointing.run_lock import (
    EXIT_RUN_DIR_BUSY,
    LOCK_FILE,
    Holder,
    RunDirBusyError,
    RunLock,
    owned_run_dir,
)
from {{ cookiecutter.package_name }}.cluster.distributed import DistEnv
from {{ cookiecutter.package_name }}.train import main

from ..helpers import FAST, run_torchrun

pytestmark = pytest.mark.timeout(120)

ELSEWHERE = Holder(
    host="node17",
    pid=4242,
    job="81234",
    attempt=(0, 0),
    started="2026-01-02T03:04:05+00:00",
    heartbeat_s=run_lock.HEARTBEAT_S,
    machine="another-machine",
)


def _plant(run_dir: Path, holder: Holder, age_s: float = 0.0) -> Path:
    """A lock file of `holder` in `run_dir`, last touched `age_s` seconds ago."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    path.write_text(json.dumps(asdict(holder)))
    stamped = path.stat().st_mtime - age_s
    os.utime(path, (stamped, stamped))
    return path


def _token(run_dir: Path) -> str:
    return json.loads((run_dir / LOCK_FILE).read_text())["token"]


def _files(run_dir: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(run_dir)): path.read_bytes()
        for path in sorted(run_dir.rglob("*"))
        if path.is_file()
    }


def test_the_lock_names_this_process_and_is_gone_after_release(tmp_path: Path) -> None:
    lock = RunLock(tmp_path)
    lock.acquire()
    recorded = json.loads((tmp_path / LOCK_FILE).read_text())
    assert (recorded["host"], recorded["pid"]) == (socket.gethostname(), os.getpid())
    assert recorded["started"] and recorded["token"] == lock.me.token
    lock.release()
    assert list(tmp_path.iterdir()) == []


def test_a_live_job_s_lock_is_refused_naming_its_holder_and_left_alone(tmp_path: Path) -> None:
    lock_file = _plant(tmp_path, ELSEWHERE, age_s=30)  # younger than 6 heartbeats: alive
    before = lock_file.read_bytes()
    with pytest.raises(RunDirBusyError) as refused:
        RunLock(tmp_path).acquire()
    message = str(refused.value)
    for fact in ("host node17", "pid 4242", "job 81234", "started 2026-01-02T03:04:05"):
        assert fact in message
    assert "last heartbeat 30 s ago" in message and "use another run.dir" in message
    assert lock_file.read_bytes() == before
    assert [path.name for path in tmp_path.iterdir()] == [LOCK_FILE]


def test_a_lock_held_by_a_live_process_of_this_machine_is_refused(tmp_path: Path) -> None:
    holder = RunLock(tmp_path)
    holder.acquire()
    try:
        with pytest.raises(RunDirBusyError, match=f"pid {os.getpid()}"):
            RunLock(tmp_path).acquire()
        assert _token(tmp_path) == holder.me.token
    finally:
        holder.release()


def test_a_lock_without_a_heartbeat_for_six_periods_is_taken_over(tmp_path: Path) -> None:
    _plant(tmp_path, ELSEWHERE, age_s=6 * run_lock.HEARTBEAT_S + 5)
    lock = RunLock(tmp_path)
    lock.acquire()
    try:
        assert _token(tmp_path) == lock.me.token
        assert lock.replaced is not None and lock.replaced[0] == ELSEWHERE
        assert sorted(path.name for path in tmp_path.iterdir()) == [LOCK_FILE]
    finally:
        lock.release()


def test_the_lock_of_a_process_gone_from_this_machine_is_taken_over_at_once(
    tmp_path: Path,
) -> None:
    finished = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    me = Holder.of_this_process(run_lock.HEARTBEAT_S)
    dead = Holder(**{**asdict(me), "pid": int(finished.stdout), "token": "dead"})
    _plant(tmp_path, dead, age_s=0)  # a fresh heartbeat: only the pid tells
    lock = RunLock(tmp_path)
    lock.acquire()
    try:
        assert _token(tmp_path) == lock.me.token
    finally:
        lock.release()


def race(locks: list[RunLock], monkeypatch: pytest.MonkeyPatch) -> dict[int, str]:
    """Each lock acquired in a thread of its own, every one of them judging the holder before
    any replaces it; returns "won" or the refusal's message, by index."""
    all_judged = threading.Barrier(len(locks), timeout=30)
    judged = threading.local()
    is_dead = RunLock._is_dead

    def judge_together(self: RunLock, holder: Holder, age: float) -> bool:
        dead = is_dead(self, holder, age)
        if not getattr(judged, "once", False):
            judged.once = True
            all_judged.wait()
        return dead

    monkeypatch.setattr(RunLock, "_is_dead", judge_together)
    outcomes: dict[int, str] = {}

    def contend(index: int) -> None:
        try:
            locks[index].acquire()
            outcomes[index] = "won"
        except RunDirBusyError as error:
            outcomes[index] = str(error)

    threads = [threading.Thread(target=contend, args=(index,)) for index in range(len(locks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def test_of_jobs_racing_for_one_dead_lock_exactly_one_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every contender has judged the lock dead before any of them replaces it."""
    _plant(tmp_path, ELSEWHERE, age_s=6 * run_lock.HEARTBEAT_S + 5)
    contenders = 8
    locks = [RunLock(tmp_path) for _ in range(contenders)]
    outcomes = race(locks, monkeypatch)
    winners = [index for index, outcome in outcomes.items() if outcome == "won"]
    try:
        assert len(winners) == 1, outcomes
        assert len(outcomes) == contenders
        assert _token(tmp_path) == locks[winners[0]].me.token
        assert sorted(path.name for path in tmp_path.iterdir()) == [LOCK_FILE]
    finally:
        for index in winners:
            locks[index].release()


def test_a_restarted_job_takes_its_previous_attempt_s_lock_once_its_heartbeat_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun restarted the job and its rank 0 now runs on another host: the previous rank 0
    is gone, but only its silence tells, so the new attempt waits for it instead of failing."""
    previous = Holder(**{**asdict(ELSEWHERE), "job": "run-7", "heartbeat_s": 0.05})
    _plant(tmp_path, previous, age_s=0)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    lock = RunLock(tmp_path)
    lock.acquire()
    try:
        assert _token(tmp_path) == lock.me.token
    finally:
        lock.release()


def test_the_heartbeat_touches_the_lock(tmp_path: Path) -> None:
    lock = RunLock(tmp_path)
    lock.acquire()
    try:
        lock_file = tmp_path / LOCK_FILE
        os.utime(lock_file, (1.0, 1.0))
        lock._refresh()
        assert lock_file.stat().st_mtime > 1.0
    finally:
        lock.release()


def test_a_lock_removed_by_hand_is_taken_again_by_its_live_holder(tmp_path: Path) -> None:
    lock = RunLock(tmp_path)
    lock.acquire()
    try:
        (tmp_path / LOCK_FILE).unlink()
        lock._refresh()
        assert _token(tmp_path) == lock.me.token
    finally:
        lock.release()


def test_a_job_whose_lock_another_job_took_over_exits_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It was silent for six heartbeats (stopped, say): the other job now trains there."""
    exits: list[int] = []

    def record_exit(status: int) -> None:
        exits.append(status)
        raise SystemExit(status)

    monkeypatch.setattr(os, "_exit", record_exit)
    lock = RunLock(tmp_path)
    lock.acquire()
    try:
        _plant(tmp_path, ELSEWHERE)
        with pytest.raises(SystemExit):
            lock._refresh()
        assert exits == [EXIT_RUN_DIR_BUSY]
    finally:
        lock.release()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == ELSEWHERE.token


def test_a_file_system_without_hard_links_gets_one_lock_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_hard_links(*args: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_hard_links)
    lock = RunLock(tmp_path)
    lock.acquire()
    try:
        assert _token(tmp_path) == lock.me.token
        with pytest.raises(RunDirBusyError):
            RunLock(tmp_path).acquire()
    finally:
        lock.release()


def test_the_lock_is_released_when_training_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError), owned_run_dir(tmp_path, DistEnv()) as lock:
        assert lock is not None and (tmp_path / LOCK_FILE).exists()
        raise ValueError("a failure in training")
    assert not (tmp_path / LOCK_FILE).exists()


@pytest.mark.faults  # a whole launch: run once, not with every option pair
def test_a_launch_takes_over_a_dead_job_s_run_and_removes_its_unfinished_save(
    tmp_path: Path,
) -> None:
    """The dead job left a save in flight (a full disk, a kill): it is removed before the
    run directory is read, and the launch trains to its end."""
    run_dir = tmp_path / "run"
    _plant(run_dir, ELSEWHERE, age_s=6 * run_lock.HEARTBEAT_S + 5)
    staging = run_dir / "checkpoints" / ".step_00000008.node17-4242-20260102T030405.tmp"
    staging.mkdir(parents=True)
    (staging / "state.pt.partial").write_bytes(b"cut short")
    assert main([*FAST, f"run.dir={run_dir}", "train.max_steps=4"]) == 0
    log = (run_dir / "train.log").read_text()
    assert "took over" in log and "host node17, pid 4242, job 81234" in log
    assert not staging.exists() and f"removed {staging}" in log
    assert not (run_dir / LOCK_FILE).exists()


@pytest.mark.distributed
@pytest.mark.faults
def test_a_second_job_on_a_live_run_directory_is_refused_on_every_rank_and_writes_nothing(
    tmp_path: Path,
) -> None:
    """A double submission: the first job (here, this process) goes on owning its run; both
    ranks of the second refuse, which exits with status 4 naming the first; the run's files are
    byte for byte as they were (metrics, config.yaml, train.log, checkpoints)."""
    run_dir = tmp_path / "run"
    overrides = [*FAST, f"run.dir={run_dir}", "train.max_steps=4"]
    assert main(overrides) == 0
    holder = RunLock(run_dir)
    holder.acquire()
    try:
        before = _files(run_dir)
        result = run_torchrun(2, [*overrides, "train.max_steps=8", "run.seed=5"])
        after = _files(run_dir)
    finally:
        holder.release()
    output = result.stderr
    assert result.returncode != 0
    assert f"{run_dir} is in use by another job: host {socket.gethostname()}" in output
    assert f"pid {os.getpid()}" in output and "last heartbeat" in output
    assert "rank 0's message names it" in output  # rank 1 refused too
    assert f"exitcode  : {EXIT_RUN_DIR_BUSY} " in output, output[-3000:]
    assert after == before
