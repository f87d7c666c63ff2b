"""Loader worker processes never act on a stop signal, but end when their rank ends them, and
nothing of the rank's they inherit holds its signal watch open.

Launchers and terminals signal every process of a rank's group (torchrun), of the foreground
group (Ctrl-C) or of the job (scancel): the workers get the same signals as the rank. Signals
are sent here by another process (`kill`), as they are in production, and by this process,
which is the workers' rank.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import threading
from contextlib import suppress
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from {{ cookiecutter.package_name }}.cluster.distributed import DistEnv
from {{ cookiecutter.package_name }}.config import DataConfig
from {{ cookiecutter.package_name }}.faults import watchdog
from {{ cookiecutter.package_name }}.faults.signals import stop_signals
from {{ cookiecutter.package_name }}.loading.data import build_train_loader
from {{ cookiecutter.package_name }}.loading.workers import drop_stop_signals, stop_signals_blocked

pytestmark = pytest.mark.timeout(120)

#: The most looks at a process's pending signals before a test gives up on it.
LOOKS = 10_000


def _send_from_another_process(pid: int, signals: list[signal.Signals]) -> None:
    for signum in signals:
        subprocess.run(["kill", f"-{signum.name.removeprefix('SIG')}", str(pid)], check=True)


def _pending(pid: int) -> int:
    """The signals pending for process `pid` (its threads' and its own), as a bit mask."""
    fields = dict(
        line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)


def _taken(pid: int, signals: list[signal.Signals]) -> None:
    """Return once process `pid` has taken every one of `signals` (none left pending)."""
    mask = sum(1 << (int(signum) - 1) for signum in signals)
    for _ in range(LOOKS):
        if not _pending(pid) & mask:
            return
        os.sched_yield()
    pytest.fail(f"process {pid} left {signals} pending")


def _children() -> list[int]:
    """The processes this one started, still running."""
    pids = []
    for task in Path("/proc/self/task").iterdir():
        with suppress(FileNotFoundError):  # a thread that ended meanwhile
            pids += [int(pid) for pid in (task / "children").read_text().split()]
    return pids


def _wait_for_stop_signals(ready: multiprocessing.synchronize.Event) -> None:
    drop_stop_signals(0)
    ready.set()
    threading.Event().wait()


@pytest.mark.skipif(not hasattr(signal, "sigwaitinfo"), reason="Linux's sigwaitinfo only")
def test_a_worker_drops_every_stop_signal_from_others_and_ends_on_its_rank_s_sigterm() -> None:
    context = multiprocessing.get_context("fork")
    ready = context.Event()
    with stop_signals_blocked():  # as the loader starts its workers
        worker = context.Process(target=_wait_for_stop_signals, args=(ready,), daemon=True)
        worker.start()
    assert ready.wait(60)
    _send_from_another_process(worker.pid, stop_signals())
    _taken(worker.pid, stop_signals())
    assert worker.is_alive()
    os.kill(worker.pid, signal.SIGTERM)  # this process started it: its rank
    worker.join(60)
    assert worker.exitcode == 128 + signal.SIGTERM


def test_the_loader_blocks_the_stop_signals_only_while_it_starts_its_workers() -> None:
    with stop_signals_blocked():
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert set(stop_signals()) <= blocked
    assert not set(stop_signals()) & signal.pthread_sigmask(signal.SIG_BLOCK, [])


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "per-epoch"])
def test_loader_workers_outlive_stop_signals_sent_to_them_and_the_epoch_ends(
    persistent: bool,
) -> None:
    """The rank's loader reads its whole epoch while every stop signal reaches its workers;
    persistent workers stay for the next."""
    data = TensorDataset(torch.arange(64))
    config = DataConfig(num_workers=2, persistent_workers=persistent, pin_memory=False)
    loader, _ = build_train_loader(data, DistEnv(), config, 4, 0, torch.device("cpu"))
    before = set(_children())
    batches = iter(loader)
    first = next(batches)
    workers = sorted(set(_children()) - before)
    assert len(workers) == 2
    for pid in workers:
        _send_from_another_process(pid, stop_signals())
        _taken(pid, stop_signals())
    seen = torch.cat([first[0], *(batch[0] for batch in batches)])
    assert sorted(seen.tolist()) == list(range(64))
    assert (set(workers) <= set(_children())) == persistent


def test_leaving_a_signal_watch_ends_its_thread_while_a_copy_of_its_socket_is_open() -> None:
    """A child forked without the at-fork hook (or one that kept the socket) would have held
    the watch's thread forever, waiting for the end of a socket it never reads."""
    with watchdog.stop_signals_watched(lambda signum: None):
        copies = [os.dup(end.fileno()) for end in watchdog._watch_sockets]
        [watch] = [t for t in threading.enumerate() if t.name == "stop-signal-watch"]
    watch.join(60)
    assert not watch.is_alive()
    for copy in copies:
        os.close(copy)


def _report_watch_sockets(sockets: list, result: multiprocessing.queues.SimpleQueue) -> None:
    result.put([end.fileno() for end in sockets])


def test_a_forked_child_closes_its_copies_of_the_signal_watch() -> None:
    context = multiprocessing.get_context("fork")
    result = context.SimpleQueue()
    with watchdog.stop_signals_watched(lambda signum: None):
        sockets = list(watchdog._watch_sockets)
        child = context.Process(target=_report_watch_sockets, args=(sockets, result))
        child.start()
        child.join(60)
    assert len(sockets) == 2
    assert result.get() == [-1, -1]  # closed in the child
