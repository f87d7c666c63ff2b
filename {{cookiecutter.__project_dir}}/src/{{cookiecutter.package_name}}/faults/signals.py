"""The stop signals, recorded from the first lines of the training entry point.

Importing torch takes seconds. A SIGTERM in that time (a preemption as the job starts, torchrun
ending its workers) would kill the process by default, exit status -15 instead of the documented
75. train.py calls `record_early()` before its heavy imports; StopRequests (stopping.py) later
takes over what was recorded, and every rank then stops at start-up with that signal's status.
This module imports nothing heavy, so that it can run first.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

#: What a stop signal asks for, agreed on by MAX across ranks: any of the terminating ones
#: outweighs a stop request. SIGINT is Ctrl-C; SIGHUP a closed terminal or ssh session.
REQUESTED, TERMINATED = 1, 2
STOP_SIGNALS = {
    "SIGTERM": TERMINATED,
    "SIGINT": TERMINATED,
    "SIGHUP": TERMINATED,
    "SIGUSR1": REQUESTED,
    "SIGUSR2": REQUESTED,
}

#: A second SIGINT this soon after the first is the same Ctrl-C: a terminal sends SIGINT to
#: its whole foreground process group, and a launcher (torchrun, srun, mpirun) passes the
#: SIGINT it got on to its workers, milliseconds apart. A person who presses Ctrl-C again to
#: exit at once does so after seeing that the first did not stop the run at once.
SAME_PRESS_S = 1.0

#: (signal number, wall-clock time) of each stop signal recorded before StopRequests takes over.
_received: list[tuple[int, float]] = []
_previous: dict[int, Any] = {}


def stop_signals() -> list[signal.Signals]:
    """The stop signals this platform has (Windows lacks SIGHUP, SIGUSR1 and SIGUSR2)."""
    return [getattr(signal, name) for name in STOP_SIGNALS if hasattr(signal, name)]


def record_early() -> None:
    """Record the stop signals from now on, until StopRequests takes them over.

    A second Ctrl-C interrupts at once (KeyboardInterrupt), as it does later in training.
    Python sets handlers from the main thread only; elsewhere this does nothing.
    """
    if _previous or threading.current_thread() is not threading.main_thread():
        return
    for signum in stop_signals():
        _previous[signum] = signal.signal(signum, _record)


def _record(signum: int, frame: object) -> None:
    now = time.time()
    if is_second_press(signum, _received, now):
        raise KeyboardInterrupt
    _received.append((signum, now))


def is_second_press(signum: int, received: list[tuple[int, float]], now: float) -> bool:
    """Whether a SIGINT at `now` is a second Ctrl-C: an earlier SIGINT was `received`, and not
    within SAME_PRESS_S (then it is the same press, passed on by a launcher)."""
    if signum != signal.SIGINT:
        return False
    first = next((at for number, at in received if number == signal.SIGINT), None)
    return first is not None and now - first >= SAME_PRESS_S


def take_over() -> tuple[list[tuple[int, float]], dict[int, Any]]:
    """The signals recorded so far, with the time each arrived, and the handlers from before
    `record_early()`, after which nothing more is recorded here. Call it once the caller's own
    handlers are set, so that no signal falls between the two. Empty when `record_early()`
    never ran."""
    received, previous = list(_received), dict(_previous)
    _received.clear()
    _previous.clear()
    return received, previous


def release_early() -> None:
    """Give the stop signals back their earlier handlers, and deliver what arrived meanwhile to
    them: with checkpoint.stop_on_signals=false a signal keeps its usual effect."""
    received, previous = take_over()
    for signum, handler in previous.items():
        signal.signal(signum, handler)
    for signum in dict.fromkeys(number for number, _ in received):
        signal.raise_signal(signum)
