"""Loader worker processes that never act on a stop signal: the training process stops.

A stop signal reaches a rank's loader workers as well as the rank: torchrun signals each
rank's whole process group, a terminal's Ctrl-C its whole foreground group, Slurm's `scancel`
and container runtimes every process of the job. By default a worker dies of it (torch's own
handler re-raises SIGTERM; SIGHUP, SIGUSR1 and SIGUSR2 terminate), the rank's loader then
raises "DataLoader worker ... is killed by signal", and the checkpoint of the stop is lost.
The rank alone acts on a stop (stopping.py), and ends its own workers when it exits.

So a worker starts with the stop signals blocked: the rank blocks them in its own thread while
the loader forks its workers (`StopSafeLoader`), and a child inherits that mask, before any of
its code runs. In the worker, a thread takes them with sigwaitinfo and drops each, but for a
SIGTERM from the rank itself: the loader ending a worker that did not finish in time, or
Python's exit ending its daemon processes. That one ends the worker, as it would have.
Where sigwaitinfo is missing (macOS), the worker ignores every stop signal but SIGTERM.

Blocking in the rank's thread loses nothing: a signal that arrives meanwhile is taken by
another thread of the rank, and Python runs the rank's handler as usual.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch.utils.data import DataLoader

from ..faults.signals import stop_signals

#: The exit status of a worker that the rank ended with SIGTERM: as if the signal had.
_TERMINATED = 128 + signal.SIGTERM


#: What a DataLoader raises when one of its workers died: "DataLoader worker (pid 123) is killed
#: by signal: Killed.", "DataLoader worker (pid(s) 123) exited unexpectedly".
_WORKER_DIED = re.compile(r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\) ([^.]+)")
#: Why a worker may have died, by the signal that ended it; else the out-of-memory killer.
_LIKELY_CAUSE = {
    "Bus error": "its shared memory ran out (a container's /dev/shm: docker run --shm-size or "
    "--ipc=host)",
    "Segmentation fault": "a crash in C code of the data set or a library it calls",
}


def describe_worker_death(error: BaseException) -> str | None:
    """A loader worker's death in one line, with its likely cause and what to change; None
    when `error` says nothing of a dead worker."""
    found = _WORKER_DIED.search(str(error))
    if found is None:
        return None
    pids, how = found.groups()
    signal_name = how.rsplit(": ", 1)[-1] if "signal" in how else None
    cause = _LIKELY_CAUSE.get(
        signal_name or "",
        "the out-of-memory killer ends the largest process when memory runs out (`dmesg` says "
        "so), or something killed it",
    )
    return (
        f"its loader worker (pid {pids.strip()}) {how.strip()}: {cause}. Lower "
        "data.num_workers or data.prefetch_factor, or what a sample holds in memory; "
        "data.num_workers=0 loads in the training process, where an error shows its traceback"
    )


class StopSafeLoader(DataLoader):
    """A DataLoader whose worker processes start with the stop signals blocked."""

    def __iter__(self) -> Iterator[Any]:
        if self.num_workers == 0:
            return super().__iter__()
        with stop_signals_blocked():
            return super().__iter__()


@contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Block the stop signals in this thread inside the block (where the platform can)."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no signals to forward
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals())
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def drop_stop_signals(worker_id: int) -> None:
    """The loader's `worker_init_fn`: from here on this worker never acts on a stop signal but
    a SIGTERM from the rank, which ends it."""
    wanted = stop_signals()
    if not hasattr(signal, "sigwaitinfo"):
        for signum in wanted:
            if signum != signal.SIGTERM:
                signal.signal(signum, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, wanted)
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, wanted)  # a worker started without StopSafeLoader
    parent = multiprocessing.parent_process()  # the rank, whatever started the worker
    rank = parent.pid if parent is not None else os.getppid()

    def take() -> None:
        while True:
            received = signal.sigwaitinfo(wanted)
            if received.si_signo == signal.SIGTERM and received.si_pid == rank:
                os._exit(_TERMINATED)

    threading.Thread(target=take, name="stop-signals-dropped", daemon=True).start()
