"""A process whose launcher dies stops as on SIGTERM: a checkpoint at an agreed step, exit 75.

torchrun starts its workers in sessions of their own, so when torchrun itself is killed
(SIGKILL, out of memory, a node agent ending it) no signal reaches them: they would train on as
orphans, and a relaunch would train beside them in the same run directory. A daemon thread
compares the parent's pid with the one at start every POLL_S seconds; once the parent is gone
(the process was handed to another), it sends this process SIGTERM, and the stop protocol
(stopping.py) saves a checkpoint at a step every rank agrees on and exits. The ranks of one
launcher lose it together, so they stop together.

Polling rather than prctl(PR_SET_PDEATHSIG), which exists on Linux only and fires when the
parent *thread* that started the process ends. Only processes started by a launcher are
watched: a single process started from a shell (`nohup python -m ... &`) may outlive it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ..cluster.distributed import DistEnv

log = logging.getLogger(__name__)

#: Seconds between two looks at the parent process: a getppid() call, nothing more.
POLL_S = 1.0


@contextmanager
def launcher_watched(env: DistEnv) -> Iterator[None]:
    """Inside the block, stop this process (SIGTERM) if its launcher dies."""
    if env.launcher == "single":
        yield
        return
    parent = os.getppid()
    done = threading.Event()

    def watch() -> None:
        while not done.wait(POLL_S):
            if os.getppid() != parent:
                log.warning(
                    "the launcher (pid %d) is gone: stopping with a checkpoint, as on SIGTERM",
                    parent,
                )
                os.kill(os.getpid(), signal.SIGTERM)
                return

    watcher = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
