"""Hangs end in bounded time and say where they are: stacks files and the ranks that are missing.

- The process group starts (`startup_bounded`): a rank still starting after twice
  `dist.timeout_s` (each of its waits is bounded by that) writes its stacks to stderr and exits
  1; one that gets a stop signal meanwhile, or whose launcher dies, exits at once with the
  signal's status (nothing was trained in that launch, so nothing is lost), instead of waiting
  in a connect that no Python handler can interrupt.
- A collective fails (gloo gives up after `dist.timeout_s`, or a peer is gone): every rank that
  sees the error writes its Python stacks to `<run.dir>/stacks/rank_<N>.txt`, then tells the
  others through the rendezvous store that it is alive. Rank 0 waits for them NAMING_WAIT_S
  (at most dist.timeout_s), or NAMING_AFTER_STOP_S once the launcher stops the job (a worker
  died), and names the ranks that did not answer, with their hosts: hung, dead, or cut off;
  every other rank reads that answer, or, when rank 0 does not give it in time, names rank 0's
  host as the one it lost contact with. Every wait there is bounded, on every rank.
- A collective times out under NCCL: NCCL's watchdog, not Python, sees it. Every rank's flight
  recorder writes its last collectives to `<run.dir>/comm_traces/` (flight_recorder.py), then
  the watchdog aborts the process (SIGABRT), where no Python handler runs: faulthandler
  (`aborts_reported`) first appends the Python stacks of its threads to the rank's log file,
  as it does for any fatal signal (a crash in C code, SIGSEGV).
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
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from pathlib import Path
from typing import TextIO

import torch.distributed as dist

from ..cluster.agreement import describe_ranks, roster
from ..cluster.distributed import DistEnv, is_distributed, rendezvous_store
from ..config import Config
from . import signals
from .signals import stop_signals
from .stopping import EXIT_RESUMABLE, StopRequests

log = logging.getLogger(__name__)

#: The launcher's grace from its SIGTERM to its SIGKILL when it does not say: torchrun's
#: default, and Slurm's KillWait unless the cluster sets another.
DEFAULT_GRACE_S = 30.0
#: A rank that has not stopped writes its stacks this long before the launcher's SIGKILL.
KILL_MARGIN_S = 5.0
#: The longest wait for the other ranks after a collective failed: they failed at about the
#: same moment, since they were waiting in the same collective.
NAMING_WAIT_S = 10.0
#: The wait for them once a stop signal arrived: the launcher is ending the job, after a worker
#: died (torchrun stops the others within a fraction of a second).
NAMING_AFTER_STOP_S = 1.0
NAMING_POLL_S = 0.25
#: Start-up: the agreement and the group's start each wait at most dist.timeout_s; this is
#: added for everything else (a slow CUDA initialisation, a loaded machine).
STARTUP_MARGIN_S = 30.0
#: A stop signal during start-up: the seconds left for the start to finish, after which the
#: stop protocol could take over; otherwise the rank exits at once.
STARTUP_STOP_GRACE_S = 2.0
# What gloo's errors say when a collective timed out or a peer is gone.
_COLLECTIVE_FAILURES = ("Timed out", "timed out", "Connection closed by peer", "Connection reset")
# The address of the peer a gloo error names: "[10.0.0.2]:41234".
_PEER_ADDRESS = re.compile(r"\[([0-9a-fA-F.:]+)\]:\d+")

#: The longest wait for a signal watch's thread once its block is left: it may be running its
#: callback (startup_bounded's waits STARTUP_STOP_GRACE_S at most).
WATCH_END_S = STARTUP_STOP_GRACE_S + 1.0

#: Both sockets of every signal watch open in this process. A forked child (a loader worker)
#: closes its copies at once: they are this process's, not the child's.
_watch_sockets: list[socket.socket] = []


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
    main_thread = threading.current_thread() is threading.main_thread()
    if not stop.enabled or env.launcher == "single" or not main_thread:
        yield
        return
    stacks: list[TextIO] = []

    def arm(signum: int | None = None) -> None:
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

    if stop.received:  # recorded earlier, even while torch was imported
        arm()
    try:
        with stop_signals_watched(arm, enabled=not stop.received):
            yield
    finally:
        if stacks:  # it stopped in time: no stacks to show
            faulthandler.cancel_dump_traceback_later()
            stacks[0].close()
            path = Path(stacks[0].name)
            path.unlink(missing_ok=True)
            with suppress(OSError):  # left only when another rank's stacks are in it
                path.parent.rmdir()


@contextmanager
def stop_signals_watched(on_signal: Callable[[int], None], enabled: bool = True) -> Iterator[None]:
    """Inside the block, a thread calls `on_signal(signum)` at the first stop signal, whatever
    the main thread is doing: the signal's number reaches it through signal.set_wakeup_fd, even
    while the main thread waits in C code where no Python handler runs."""
    if not enabled:
        yield
        return
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    numbers = {int(signum) for signum in stop_signals()}

    def watch() -> None:
        while data := reader.recv(64):  # empty once the block is left
            if received := numbers.intersection(data):
                on_signal(min(received))
                return

    previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    _watch_sockets.extend((reader, writer))
    watcher = threading.Thread(target=watch, name="stop-signal-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        # Ends the watch's recv at once: closing the writer would not while a copy of it is
        # open elsewhere (a child forked without the at-fork hook below).
        reader.shutdown(socket.SHUT_RDWR)
        watcher.join(WATCH_END_S)
        for end in (reader, writer):
            _watch_sockets.remove(end)
            end.close()


@contextmanager
def startup_bounded(stop: StopRequests, env: DistEnv, timeout_s: float) -> Iterator[None]:
    """Inside the block (the process group's start), a rank does not wait longer than
    2 x timeout_s + STARTUP_MARGIN_S, and a stop signal ends it within STARTUP_STOP_GRACE_S
    with that signal's status: 75 after SIGTERM, SIGINT or SIGHUP, else 0. Both exits write
    to stderr what the rank was doing (its Python stacks, for the bound)."""
    main_thread = threading.current_thread() is threading.main_thread()
    if env.world_size == 1 or not main_thread:
        yield
        return
    started = threading.Event()
    exiting = threading.Lock()
    limit_s = 2 * timeout_s + STARTUP_MARGIN_S

    def leave(message: str, status: int, stacks: bool) -> None:
        with exiting:
            if started.is_set():
                return
            sys.stderr.write(f"rank {env.rank}: {message}\n")
            if stacks:
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
            os._exit(status)

    def signalled(signum: int) -> None:
        if started.wait(STARTUP_STOP_GRACE_S):
            return  # the group started meanwhile: the stop protocol takes over
        name = signal.Signals(signum).name
        status = EXIT_RESUMABLE if signals.STOP_SIGNALS[name] == signals.TERMINATED else 0
        leave(
            f"{name} arrived while the process group was still starting: exiting with status "
            f"{status}. Nothing was trained in this launch, so nothing is lost; the next launch "
            "resumes from the newest checkpoint.",
            status,
            stacks=False,
        )

    def overdue() -> None:
        leave(
            f"the process group did not start within {limit_s:.0f} s (2 x dist.timeout_s + "
            f"{STARTUP_MARGIN_S:.0f} s): exiting with status 1. A peer cannot be reached at "
            "the address it advertised (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME), or a port "
            "between the nodes is blocked (see the launching guide's list of ports); `python "
            f"-m {{ cookiecutter.package_name }}.doctor` names the cause. This rank's Python stacks:",
            1,
            stacks=True,
        )

    timer = threading.Timer(limit_s, overdue)
    timer.daemon = True
    timer.start()
    if stop.received:  # recorded before: even while torch was imported
        early = threading.Thread(target=signalled, args=(stop.received % 64,), daemon=True)
        early.start()
    try:
        with stop_signals_watched(signalled, enabled=not stop.received):
            yield
    finally:
        with exiting:
            started.set()
        timer.cancel()


def _close_watches_in_child() -> None:
    """In a forked child (a loader worker): this process's signal watches are not the child's.
    Its signals stop writing to their socket, and its copies of their sockets are closed."""
    if not _watch_sockets:
        return
    with suppress(ValueError):  # forked from another thread: nothing to undo
        signal.set_wakeup_fd(-1)
    for end in _watch_sockets:
        end.close()
    _watch_sockets.clear()


os.register_at_fork(after_in_child=_close_watches_in_child)


@contextmanager
def aborts_reported(log_file: Path) -> Iterator[None]:
    """Inside the block, a fatal signal (SIGABRT from NCCL's watchdog after a collective timed
    out, SIGSEGV, SIGBUS, SIGFPE, SIGILL) first appends the Python stacks of every thread to
    `log_file` (the rank's log: train.log, train.rank<N>.log), then ends the process as the
    signal would. Outside it they go to stderr (`@record`, on train.main, turns faulthandler
    on), where the launcher's output interleaves those of many ranks. A file that stayed empty
    (another rank's, which did not warn) is removed at the end, so that a healthy run leaves
    train.log only."""
    to_stderr = faulthandler.is_enabled()
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("a") as handle:
        faulthandler.enable(file=handle, all_threads=True)
        try:
            yield
        finally:
            faulthandler.disable()
            # The process's own stderr: sys.stderr may be a stand-in without a file descriptor
            # (a test's capture), which faulthandler cannot write to.
            if to_stderr and sys.__stderr__ is not None:
                faulthandler.enable(file=sys.__stderr__, all_threads=True)
    with suppress(OSError):  # written meanwhile by the rank's logging, or gone
        if log_file.stat().st_size == 0:
            log_file.unlink()


def is_collective_failure(error: BaseException) -> bool:
    """Whether `error` says that a collective timed out or lost a peer."""
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and any(
        text in str(error) for text in _COLLECTIVE_FAILURES
    )


@contextmanager
def hangs_reported(
    run_dir: Path, env: DistEnv, timeout_s: float, stop: StopRequests
) -> Iterator[None]:
    """On a collective failure inside the block, write this rank's stacks and name the ranks
    that are missing, with their hosts; the error then propagates. Enter it inside the process
    group. The ranks wait for each other at most `timeout_s` (dist.timeout_s) there too."""
    try:
        yield
    except Exception as error:
        if is_distributed() and is_collective_failure(error):
            write_stacks(stacks_file(run_dir, env.rank), error)
            name_missing_ranks(
                error,
                env,
                run_dir / "stacks",
                wait_s=min(timeout_s, NAMING_WAIT_S),
                stopped=lambda: bool(stop.received),
            )
        raise


def write_stacks(path: Path, error: BaseException) -> None:
    """The error's traceback and the Python stacks of every thread of this process."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        handle.write("".join(traceback.format_exception(error)))
        handle.write("\nPython stacks of every thread, most recent call first:\n\n")
        handle.flush()
        faulthandler.dump_traceback(file=handle, all_threads=True)


def name_missing_ranks(
    error: BaseException,
    env: DistEnv,
    stacks: Path,
    wait_s: float = NAMING_WAIT_S,
    stopped: Callable[[], bool] = lambda: False,
) -> None:
    """Log which ranks (and hosts) do not answer after a failed collective; bounded by `wait_s`
    on every rank.

    Each rank says it is alive in the rendezvous store. Rank 0 waits `wait_s` for the others and
    records who is missing; the others wait for that record a little longer. A rank that gets
    no record lost contact with rank 0 (the store is rank 0's, or its node's). Once a stop
    signal has arrived (`stopped()`: the launcher ends the job, as torchrun does as soon as a
    worker dies), rank 0 waits only NAMING_AFTER_STOP_S: the ranks that are alive answered
    within moments of the failure, which they saw too.
    """
    first_line = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
    peer = _peer_host(error)
    where = f" (the collective was talking to {peer})" if peer else ""
    store = rendezvous_store()
    if store is None:
        log.error("a collective failed%s: %s. Stacks: %s", where, first_line, stacks)
        return
    answers: list[tuple[list[int], float]] = []

    def ask() -> None:
        naming = dist.PrefixStore("naming", store)
        naming.set_timeout(timedelta(seconds=wait_s))
        naming.set(f"alive/{env.rank}", "1")
        if env.rank == 0:
            keys = [f"alive/{rank}" for rank in range(env.world_size)]
            waited_s = _wait_for_answers(naming, keys, wait_s, stopped)
            missing = [rank for rank, key in enumerate(keys) if not naming.check([key])]
            naming.set("missing", json.dumps([missing, waited_s]))
        else:
            naming.wait(["missing"], timedelta(seconds=wait_s + 2))
            missing, waited_s = json.loads(naming.get("missing"))
        answers.append((missing, waited_s))

    # In a thread, joined with a bound: a store on a node that is cut off can keep a client
    # retrying past any timeout it was given.
    asking = threading.Thread(target=_quietly(ask), name="name-missing-ranks", daemon=True)
    asking.start()
    asking.join(wait_s + 4)
    missing, waited_s = answers[0] if answers else (None, wait_s)
    if missing is None:
        lost = roster().host_of(0)
        log.error(
            "a collective failed (%s)%s, and rank 0 on %s did not answer within %.0f s: this "
            "host lost contact with %s (that node is down or cut off from this one), or rank 0 "
            "is hung. This rank's stacks: %s",
            first_line,
            where,
            lost,
            wait_s,
            lost,
            stacks,
        )
    elif missing:
        log.error(
            "a collective failed (%s)%s: %s did not answer within %.0f s: hung, gone, or cut "
            "off from rank 0's node. A hung rank writes its Python stacks to %s once the "
            "launcher stops it; the others have written theirs.",
            first_line,
            where,
            describe_ranks(missing, roster()),
            waited_s,
            stacks,
        )
    else:
        log.error("a collective failed%s, but every rank still answers: %s", where, first_line)


def _wait_for_answers(
    store: dist.Store, keys: list[str], wait_s: float, stopped: Callable[[], bool]
) -> float:
    """Wait until every key is set, at most `wait_s`, or NAMING_AFTER_STOP_S once `stopped()`;
    returns the seconds waited (counted in polls, which a store that is gone ends early)."""
    waited = 0.0
    while waited < wait_s and not (stopped() and waited >= NAMING_AFTER_STOP_S):
        poll = min(NAMING_POLL_S, wait_s - waited)
        try:
            store.wait(keys, timedelta(seconds=poll))
            break
        except dist.DistError:
            waited += poll
    return waited


def _quietly(function: Callable[[], None]) -> Callable[[], None]:
    """`function`, its store errors ignored: the caller reads what it found, if anything."""

    def call() -> None:
        with suppress(dist.DistError, RuntimeError):
            function()

    return call


def _peer_host(error: BaseException) -> str | None:
    """The host of the peer a gloo error names by its address, e.g. `node02 (10.0.0.2)`."""
    found = _PEER_ADDRESS.search(str(error))
    if found is None:
        return None
    address = found.group(1)
    host = roster().host_of_address(address)
    return f"{host} ({address})" if host else address
