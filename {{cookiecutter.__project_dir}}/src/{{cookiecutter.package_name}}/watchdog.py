"""Hangs end in bounded time and say where they are: stacks files and the ranks that are missing.

- A collective fails (gloo gives up after `dist.timeout_s`, or a peer is gone): every rank that
  sees the error writes its Python stacks to `<run.dir>/stacks/rank_<N>.txt`, then all wait a
  short monitored barrier on the control group, and rank 0's log names the ranks that did not
  arrive: hung, or dead.
- A rank got a stop signal (torchrun ending the job after that failure, a preemption) and has
  not exited in time: it is hung, and its Python handler may never run (a wait in C code). A
  thread reads the signal from signal.set_wakeup_fd, which works whatever the main thread does,
  and arms faulthandler's timer; past the deadline, faulthandler writes the stacks of every
  thread to the rank's stacks file and exits with status 1. The job ends then, not after the
  launcher's whole grace period (torchrun --shutdown-timeout, Slurm's KillWait) with a SIGKILL
  that says nothing.

The deadline follows the run: `dist.timeout_s` (a healthy rank waiting for a hung peer gets its
error by then) plus two stop checks plus twice the longest step seen, evaluations and saves
included, once a checkpoint has been saved in this launch. Until then nothing measured says how
long the stop's save takes, and the rank waits until KILL_MARGIN_S before the launcher's SIGKILL
(TORCH_ELASTIC_SHUTDOWN_TIMEOUT, which the launchers export; else DEFAULT_GRACE_S). Always
before that SIGKILL, so that the stacks are written.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import re
import signal
import socket
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TextIO

import torch.distributed as dist

from .config import Config
from .distributed import DistEnv, barrier, is_distributed
from .signals import stop_signals
from .stopping import StopRequests

log = logging.getLogger(__name__)

#: The launcher's grace from its SIGTERM to its SIGKILL when it does not say: torchrun's
#: default, and Slurm's KillWait unless the cluster sets another.
DEFAULT_GRACE_S = 30.0
#: A rank that has not stopped writes its stacks this long before the launcher's SIGKILL.
KILL_MARGIN_S = 5.0
#: The longest wait for the other ranks after a collective failed: they failed at about the
#: same moment, since they were waiting in the same collective.
NAMING_WAIT_S = 10.0
# What gloo's errors say when a collective timed out or a peer is gone.
_COLLECTIVE_FAILURES = ("Timed out", "timed out", "Connection closed by peer", "Connection reset")
_MISSING_RANKS = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")

_wakeup_writer: socket.socket | None = None


def stacks_file(run_dir: Path, rank: int) -> Path:
    """Where a rank writes its Python stacks when it fails in a collective or hangs."""
    return run_dir / "stacks" / f"rank_{rank:05d}.txt"


def launcher_grace_s() -> float:
    """Seconds from the launcher's SIGTERM to its SIGKILL."""
    with suppress(ValueError):
        return float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", DEFAULT_GRACE_S))
    return DEFAULT_GRACE_S


def stop_deadline_s(
    stop: StopRequests, timeout_s: float, every_steps: int, grace_s: float
) -> float:
    """Seconds a rank may take from its first stop signal to its exit (see the module's doc)."""
    latest = max(grace_s - KILL_MARGIN_S, 1.0)
    if stop.steps_taken < every_steps:  # no save timed yet in this launch
        return latest
    return min(latest, timeout_s + 2 * stop.check_s + 2 * stop.longest_step_s)


@contextmanager
def stop_deadline(
    stop: StopRequests, env: DistEnv, run_dir: Path, config: Config
) -> Iterator[None]:
    """Inside the block, a rank that has not left it within the stop deadline after a stop
    signal writes its stacks and exits 1. A single process is left alone: no launcher kills it,
    and a second Ctrl-C ends it."""
    global _wakeup_writer
    main_thread = threading.current_thread() is threading.main_thread()
    if not stop.enabled or env.launcher == "single" or not main_thread:
        yield
        return
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    numbers = {int(signum) for signum in stop_signals()}
    stacks: list[TextIO] = []

    def arm() -> None:
        every_steps = config.checkpoint.every_steps
        seconds = stop_deadline_s(stop, config.dist.timeout_s, every_steps, launcher_grace_s())
        path = stacks_file(run_dir, env.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = path.open("w")
        handle.write(
            f"rank {env.rank} got a stop signal and had not exited {seconds:.0f} s later; it "
            "exited with status 1. Its Python stacks then, every thread, most recent call "
            "first:\n\n"
        )
        handle.flush()
        stacks.append(handle)
        faulthandler.dump_traceback_later(seconds, exit=True, file=handle)

    def watch() -> None:
        while data := reader.recv(64):  # empty once the block is left
            if numbers.intersection(data):
                arm()
                return

    previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    _wakeup_writer = writer
    watcher = threading.Thread(target=watch, name="stop-deadline", daemon=True)
    if stop.received:  # recorded earlier, even while torch was imported
        arm()
    else:
        watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        _wakeup_writer = None
        writer.close()
        if watcher.is_alive():
            watcher.join()
        reader.close()
        if stacks:  # it stopped in time: no stacks to show
            faulthandler.cancel_dump_traceback_later()
            stacks[0].close()
            path = Path(stacks[0].name)
            path.unlink(missing_ok=True)
            with suppress(OSError):  # left only when another rank's stacks are in it
                path.parent.rmdir()


def _forget_wakeup_fd() -> None:
    """In a forked child (a DataLoader worker): its signals are not this process's stop."""
    if _wakeup_writer is not None:
        with suppress(ValueError):  # forked from another thread: nothing to undo
            signal.set_wakeup_fd(-1)


os.register_at_fork(after_in_child=_forget_wakeup_fd)


def is_collective_failure(error: BaseException) -> bool:
    """Whether `error` says that a collective timed out or lost a peer."""
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and any(
        text in str(error) for text in _COLLECTIVE_FAILURES
    )


@contextmanager
def hangs_reported(run_dir: Path, env: DistEnv, timeout_s: float) -> Iterator[None]:
    """On a collective failure inside the block, write this rank's stacks and name the ranks
    that are missing; the error then propagates. Enter it inside the process group."""
    try:
        yield
    except Exception as error:
        if is_distributed() and is_collective_failure(error):
            write_stacks(stacks_file(run_dir, env.rank), error)
            name_missing_ranks(error, min(timeout_s, NAMING_WAIT_S), run_dir / "stacks")
        raise


def write_stacks(path: Path, error: BaseException) -> None:
    """The error's traceback and the Python stacks of every thread of this process."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        handle.write("".join(traceback.format_exception(error)))
        handle.write("\nPython stacks of every thread, most recent call first:\n\n")
        handle.flush()
        faulthandler.dump_traceback(file=handle, all_threads=True)


def name_missing_ranks(error: BaseException, wait_s: float, stacks: Path) -> None:
    """Log the ranks that do not answer on the control group within `wait_s` seconds."""
    found = _MISSING_RANKS.search(str(error))  # a monitored barrier failed: it named them
    if found is None:
        try:
            barrier(timeout_s=wait_s)
        except RuntimeError as missing:
            found = _MISSING_RANKS.search(str(missing))
            if found is None:  # another rank than 0: only rank 0 learns who is missing
                log.error(
                    "a collective failed, and rank 0 did not confirm within %.0f s that every "
                    "rank is alive: rank 0's log names the missing ranks. Stacks: %s",
                    wait_s,
                    stacks,
                )
                return
        else:
            log.error("a collective failed, but every rank still answers: %s", error)
            return
    log.error(
        "a collective failed (%s): rank(s) %s did not arrive: hung, or gone. A hung rank writes "
        "its Python stacks to %s once the launcher stops it; the others have written theirs.",
        str(error).splitlines()[0][:200],
        found.group(1).strip(),
        stacks,
    )
