"""Stopping on a signal: every rank finishes the same step, saves a checkpoint and exits.

- SIGTERM (Slurm on preemption, scancel and at the time limit; torchrun passing on its own;
  `docker stop`; Kubernetes), SIGINT (Ctrl-C) and SIGHUP (the terminal or ssh session closed):
  exit status 75, `EXIT_RESUMABLE`.
- SIGUSR1 or SIGUSR2 (the Slurm script ahead of the time limit, or you): exit status 0.

75 is EX_TEMPFAIL: "stopped with a checkpoint at the current step; launch the same command again
to continue". torchrun restarts the workers on it (when `--max-restarts` allows) and the Slurm
script requeues the job. 0 after SIGUSR1/SIGUSR2: the stop was asked for, whoever asked decides
what comes next. Ctrl-C and SIGHUP take 75, not 0: the training did not finish, so that
`train && next-step` does not go on as if it had. A second Ctrl-C interrupts at once
(KeyboardInterrupt; the entry point exits 130) without a checkpoint of the current step: an
interrupted save is never loaded, the newest complete checkpoint stays the one to resume from.
A SIGINT within a second of the first is the same Ctrl-C, reaching the process twice: from
the terminal and from a launcher that passes it on (signals.SAME_PRESS_S). The log says which
signals arrived, and when.
Signals that arrive before training starts (even while torch is imported: signals.py) stop
every rank at start-up with the same statuses.

The handler only records the signal: saving inside a signal handler can deadlock. About once
every `check_s` seconds of training, each rank starts an all-reduce (MAX) of what it has
received, and of its step time, on the CPU step group, and reads the result at the next
check, by which time it has long arrived. Every rank reads the same result after the same step,
so all of them stop together, about 2 x check_s after the first signal reached any of them,
without a blocking collective or a GPU sync in the step. The same result sets the next check's
step: as many steps as the slowest rank takes in check_s, so that an all-reduce costs the same
small share of time (a gloo all-reduce costs about a millisecond) whatever the step time.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from ..cluster.distributed import is_distributed, step_group
from . import signals

EXIT_RESUMABLE = 75
#: A second Ctrl-C: stopped at once, without a checkpoint of the current step (128 + SIGINT).
EXIT_INTERRUPTED = 130
#: The most steps between two checks, however short the steps.
MAX_CHECK_INTERVAL = 1000
#: The wall clock that stamps the signals' arrival.
_now = time.time

_NOTHING = 0


def _weight(signum: int) -> int:
    """What a rank has received, agreed on with MAX: a terminating signal anywhere outweighs a
    stop request; the signal number rides along (below 64), so that the log can name it."""
    return signals.STOP_SIGNALS[signal.Signals(signum).name] * 64 + signum


def _kind(weight: int) -> int:
    return weight // 64


class StopRequests:
    """Records stop signals in this process and lets all ranks agree on when to act on them."""

    def __init__(self, enabled: bool = True, check_s: float = 1.0) -> None:
        self.enabled = enabled
        self.check_s = check_s
        self.received = _NOTHING
        #: (signal number, wall-clock time) of every stop signal this process received.
        self.arrivals: list[tuple[int, float]] = []
        #: What the ranks agreed on; set once they stop.
        self.agreed = _NOTHING
        self._installed = False
        self._pending: tuple[dist.Work, torch.Tensor] | None = None
        #: Whether the ranks agree through a process group: learnt once, by `agreed_now` (which
        #: training calls first) or else at the first step, not asked again at every step.
        self._distributed: bool | None = None
        self._interval = 1  # steps from one check to the next: the same on every rank
        self._steps = 0
        self._since = time.perf_counter()
        self._last_step_end = self._since
        #: Steps taken since training started, and the longest time between two of them
        #: (evaluations and saves included): what the stop deadline is sized from (watchdog.py).
        self.steps_taken = 0
        self.longest_step_s = 0.0

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Record the stop signals inside the block, and restore the previous handlers after it.

        Re-entrant: an inner block inside an outer one changes nothing. Python sets signal
        handlers from the main thread only; elsewhere the signals keep their meaning. Takes over
        what signals.record_early() recorded, and restores the handlers from before it.
        """
        if (
            not self.enabled
            or self._installed
            or threading.current_thread() is not threading.main_thread()
        ):
            yield
            return
        previous: dict[int, Any] = {
            signum: signal.signal(signum, self._record) for signum in signals.stop_signals()
        }
        received_early, before_early = signals.take_over()
        previous.update(before_early)
        self._installed = True
        try:
            for signum, at in received_early:
                self.note(signum, at)
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self._installed = False

    def _record(self, signum: int, frame: object) -> None:
        # Only a note: logging or saving here could run in the middle of the same work.
        self.note(signum, _now())

    def note(self, signum: int, at: float) -> None:
        """Record the stop signal `signum`, which arrived at `at` (seconds since the epoch);
        raises KeyboardInterrupt at a second Ctrl-C (signals.is_second_press)."""
        if self.received == _weight(signal.SIGINT) and signals.is_second_press(
            signum, self.arrivals, at
        ):
            raise KeyboardInterrupt  # Ctrl-C twice: stop now, without a checkpoint
        self.arrivals.append((signum, at))
        self.received = max(self.received, _weight(signum))

    def describe_arrivals(self) -> str:
        """The stop signals this process received, and when: for the log line of the stop."""
        parts = []
        first_sigint: float | None = None
        for signum, at in self.arrivals:
            name = signal.Signals(signum).name
            when = time.strftime("%H:%M:%S", time.localtime(at)) + f".{int(at % 1 * 1000):03d}"
            if signum == signal.SIGINT and first_sigint is not None:
                parts.append(
                    f"{name} again at {when}, {at - first_sigint:.3f} s later: the same Ctrl-C "
                    "passed on by the launcher"
                )
                continue
            if signum == signal.SIGINT:
                first_sigint = at
            parts.append(f"{name} at {when}")
        return "; ".join(parts)

    def agreed_now(self) -> bool:
        """Whether any rank has received a stop signal so far; blocking, for before training.

        A collective: every rank calls it at the same point. It catches signals that arrived
        during start-up (process group, data, resume).
        """
        if not self.enabled:
            return False
        value = torch.tensor([self.received], dtype=torch.int32)
        self._distributed = is_distributed()
        if self._distributed:
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=step_group())
        self.agreed = int(value)
        self._since = self._last_step_end = time.perf_counter()
        return self.agreed != _NOTHING

    def agreed_after_step(self) -> bool:
        """Whether every rank stops now. Every rank calls this after every optimizer step.

        At a check, returns the answer to the all-reduce started at the previous check, then
        starts the next one with what this rank has received by now.
        """
        if not self.enabled:
            return False
        now = time.perf_counter()
        self.longest_step_s = max(self.longest_step_s, now - self._last_step_end)
        self._last_step_end = now
        self.steps_taken += 1
        if self._distributed is None:  # a loop that did not agree before its first step
            self._distributed = is_distributed()
        if not self._distributed:
            self.agreed = self.received
            return self.agreed != _NOTHING
        self._steps += 1
        if self._steps < self._interval:
            return False
        step_time = (now - self._since) / self._steps
        self._steps, self._since = 0, now
        agreed = self._finish_pending()
        value = torch.tensor([float(self.received), step_time], dtype=torch.float64)
        work = dist.all_reduce(value, op=dist.ReduceOp.MAX, group=step_group(), async_op=True)
        self._pending = (work, value)
        if agreed != _NOTHING:
            self.agreed = agreed
            self._finish_pending()
            return True
        return False

    def close(self) -> None:
        """Wait for the all-reduce in flight: every rank started it, so it completes."""
        self._finish_pending()

    def _finish_pending(self) -> int:
        """Wait for the all-reduce in flight; set the next interval from the slowest step time."""
        if self._pending is None:
            return _NOTHING
        work, value = self._pending
        self._pending = None
        work.wait()
        received, slowest_step = int(value[0]), float(value[1])
        if self.check_s > 0 and slowest_step > 0:
            self._interval = max(1, min(MAX_CHECK_INTERVAL, int(self.check_s / slowest_step)))
        return received

    @property
    def reason(self) -> str:
        """The agreed stop in words, for the log: the signal, e.g. SIGTERM."""
        name = signal.Signals(self.agreed % 64).name
        return name if _kind(self.agreed) == signals.TERMINATED else f"a stop request ({name})"

    @property
    def exit_status(self) -> int:
        """What the process exits with: EXIT_RESUMABLE after SIGTERM, SIGINT or SIGHUP, else 0."""
        return EXIT_RESUMABLE if _kind(self.agreed) == signals.TERMINATED else 0
