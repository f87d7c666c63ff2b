"""Which rank holds the others back: each rank's compute and its wait for the other ranks in
every log window, its GPU's clock, temperature, power and utilisation, and a warning that
names the slowest rank.

The ranks of a DDP job meet once per optimizer step, in the gradient all-reduce that the
backward of the step's last micro-batch starts bucket by bucket, overlapped with the rest of
that backward. Megatron-LM's StragglerDetector and NVIDIA Resiliency Extension's straggler
detection time sections of a rank's own work and compare the ranks; here a step is split where
a rank starts to wait for the others:

- its *collective wait* runs from the end of its own backward (autograd has run every node of
  the graph: each gradient is computed, each bucket's all-reduce launched) to the end of the
  reduction (DDP's finalisation, which waits for every bucket: for the slowest rank's
  gradients, then the last bucket's transfer);
- its *compute* is the rest of its training time, less its wait for data: forward, backward,
  optimizer, and whatever else it does on its own.

A rank that is slow at its own work (a throttled GPU, a busy core) shows the larger compute,
and every other rank waits about as long as its excess. The slowest rank is the one with the
most time of its own (compute and data wait: a starved loader holds the others back too); its
excess is measured against the median of the other ranks. A wait in another collective of the
step counts as compute: DDP's bucket rebuild in the forward after the first step, its buffer
broadcast in the forward (dist.broadcast_buffers, for a model with buffers), SyncBatchNorm.

The end of a rank's own backward is an autograd callback: queued when the loss's gradient is
computed, the backward's first node, it runs once the graph is done and before the callback
that DDP queues later in the backward to wait for the reduction (autograd runs them in order;
torch's own DDP and FSDP queue theirs through the same engine call). Times come from the host
clock on CPU, and on GPUs from CUDA events recorded on the compute stream, so nothing in a
step waits for the device; they are read at the log line, after the step meter synchronised
the device, and ride in its all-gather.

Not every step is timed: one in `every`, a third of the log interval or less, so that a full
log window holds at least TIMED_PER_WINDOW timed steps. A rank's wait per step is the mean over
the window's timed steps (the same steps on every rank: they count the same optimizer steps),
and its own time per step its training time per step less that wait. The timing's cost (a hook
and a callback in the backward, two clock readings) falls by as much.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd import Variable

from ..cluster.agreement import roster

#: What each rank reads from its GPU at a log line, as torch.cuda reads it through NVML (or
#: amdsmi on ROCm): name, reader, factor to the unit recorded, and how the log shows it. The
#: utilisation is also read during the window, and the log shows their mean (BusyShare).
READINGS: list[tuple[str, Callable[[torch.device], float], float, str]] = [
    ("clock_mhz", torch.cuda.clock_rate, 1.0, "{:.0f} MHz"),
    ("temperature_c", torch.cuda.temperature, 1.0, "{:.0f} C"),
    # NVML reads milliwatts, amdsmi watts.
    ("power_w", torch.cuda.power_draw, 1.0 if torch.version.hip else 1e-3, "{:.0f} W"),
    ("utilization", torch.cuda.utilization, 1.0, "{:.0f}% busy"),
]
_UTILIZATION = [name for name, _, _, _ in READINGS].index("utilization")

_UNTIMED = nullcontext()
#: The fewest steps of a full log window whose wait is timed.
TIMED_PER_WINDOW = 3
#: A rank is named only when it is the slowest past the threshold in this many log windows in
#: a row, by at least MIN_EXCESS_S per step each time. Two ranks sharing two busy CPU cores
#: (a healthy laptop) take turns at being "slowest" by up to half their step: 26 of 60 windows
#: passed the share alone, 7 twice in a row, the largest excess 6 ms; none passed both rules
#: in 120 windows, with and without loader workers. A rank that is really slow is so in every
#: window.
PERSIST_WINDOWS = 2
MIN_EXCESS_S = 0.010


def device_readings(device: torch.device) -> list[float]:
    """This rank's GPU's `READINGS` now; NaN for each one that cannot be read (no GPU, no
    nvidia-ml-py or amdsmi, a device that does not report it)."""
    if device.type != "cuda":
        return [math.nan] * len(READINGS)
    values = []
    for _, read, factor, _ in READINGS:
        try:
            values.append(read(device) * factor)
        except Exception:  # the library's own errors, or ModuleNotFoundError: left out
            values.append(math.nan)
    return values


class BusyShare:
    """How busy a GPU was over a log window: the mean of its utilisation read during the window.

    NVML's utilisation is the share of its last sample period (1/6 s to 1 s, by GPU) in which a
    kernel ran. Read once at the log line it says how busy the GPU was in that last period,
    not over the window: the log line's "14% busy" beside an MFU of 37% was such a point. Read
    at every step it would cost an NVML call each (tens of microseconds: a lot for a step of a
    millisecond). So it is read at steps at least SAMPLE_S apart, NVML's shortest period, which
    tile the window with at most six calls a second, and at the log line.
    """

    #: Seconds between two readings during a window.
    SAMPLE_S = 1 / 6

    def __init__(
        self,
        device: torch.device,
        read: Callable[[torch.device], float] = torch.cuda.utilization,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.device = device
        self._read: Callable[[torch.device], float] | None = read
        self._clock = clock
        self._samples: list[float] = []
        self._last = -math.inf

    def at_step(self) -> None:
        """At each step: a reading, if SAMPLE_S has passed since the last one."""
        if self.device.type != "cuda" or self._read is None:
            return
        now = self._clock()
        if now - self._last < self.SAMPLE_S:
            return
        self._last = now
        try:
            self._samples.append(float(self._read(self.device)))
        except Exception:  # no NVML (as in device_readings): no more tries this run
            self._read = None

    def window_mean(self, at_log_line: float) -> float:
        """The window's mean utilisation, the reading `at_log_line` included (NaN when there
        is none); starts the next window."""
        samples = [value for value in (*self._samples, at_log_line) if not math.isnan(value)]
        self._samples.clear()
        return statistics.fmean(samples) if samples else math.nan


def _median(values: torch.Tensor) -> float:
    """The median of the ranks' figures: the mean of the two middle ones for an even count."""
    return statistics.median(values.tolist())


@dataclass(frozen=True)
class Straggler:
    """The rank with the most time of its own per step in a log window, against the others."""

    rank: int
    #: Its own time per step (compute and data wait), in seconds.
    own_s: float
    #: The median of the other ranks' own time per step, in seconds.
    others_s: float

    @property
    def excess_s(self) -> float:
        return self.own_s - self.others_s

    @property
    def excess(self) -> float:
        """Its excess as a share of the others' median (1.0: twice their time)."""
        return self.excess_s / max(self.others_s, 1e-9)


def slowest_rank(own_s: Sequence[float]) -> Straggler:
    """The rank with the most own time per step (the lowest such rank on a tie) and the median
    of the others' own time; at least two ranks."""
    rank = max(range(len(own_s)), key=own_s.__getitem__)
    others = [seconds for other, seconds in enumerate(own_s) if other != rank]
    return Straggler(rank, own_s[rank], statistics.median(others))


class Stragglers:
    """This rank's collective wait in the steps of a log window, and the log line's verdict on
    every rank's figures.

    The trainer calls `start_step(step)` before each optimizer step and wraps each backward in
    `timed_backward(loss, reduces)`, adds `row()` to the log line's gather, and hands every
    rank's rows to `report()`. A warning is due when the same rank's excess passes `threshold`
    (a share of the others' median; 0: never) and MIN_EXCESS_S in PERSIST_WINDOWS windows in a
    row. One step in `every` is timed:
    a third of `log_every` or less.
    """

    def __init__(
        self, device: torch.device, world_size: int, threshold: float, log_every: int = 1
    ) -> None:
        self.device = device
        self.world_size = world_size
        self.threshold = threshold
        self.every = max(1, log_every // TIMED_PER_WINDOW)
        self._timing = True
        self._timed_steps = 0
        self._wait_s = 0.0
        self._waits: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._spare: list[torch.cuda.Event] = []
        self._own_work_done: float | torch.cuda.Event | None = None
        #: The rank that was the slowest past the rules in the last windows, and in how many.
        self._suspect: int | None = None
        self._suspect_windows = 0
        self.busy = BusyShare(device)

    def start_step(self, step: int) -> None:
        """Before optimizer step `step` (counted from 1): whether its wait is timed; the GPU's
        utilisation read when it is due."""
        self._timing = step % self.every == 0
        self._timed_steps += self._timing
        self.busy.at_step()

    def timed_backward(self, loss: torch.Tensor, reduces: bool) -> AbstractContextManager:
        """Around `loss.backward()`: when that backward reduces the gradients (the last
        micro-batch of an update under DDP) in a timed step, times this rank's wait for the
        reduction."""
        if not (reduces and self._timing):
            return _UNTIMED
        loss.register_hook(self._at_backward_start)
        return self

    def __enter__(self) -> Stragglers:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: Any) -> None:
        started, self._own_work_done = self._own_work_done, None
        if kind is not None or started is None:
            return
        ended = self._stamp()
        if isinstance(started, float):
            self._wait_s += ended - started
        else:
            self._waits.append((started, ended))

    def _at_backward_start(self, grad: torch.Tensor) -> None:
        Variable._execution_engine.queue_callback(self._at_own_backward_end)

    def _at_own_backward_end(self) -> None:
        self._own_work_done = self._stamp()

    def _stamp(self) -> Any:
        """The time now: the host clock, or on a GPU an event on the current stream."""
        if self.device.type != "cuda":
            return time.perf_counter()
        event = self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def row(self) -> list[float]:
        """This rank's figures of the window, for the gather: its collective wait per timed
        step in seconds (NaN when no step of the window was timed), then its
        `device_readings`, the utilisation as the window's mean (BusyShare). Starts the next
        window. On a GPU, call it once the device is
        synchronised (StepMeter.window), so that every event has its time."""
        wait_s = self._wait_s + sum(start.elapsed_time(end) for start, end in self._waits) / 1e3
        per_step = wait_s / self._timed_steps if self._timed_steps else math.nan
        self._spare.extend(event for pair in self._waits for event in pair)
        self._waits.clear()
        self._wait_s, self._timed_steps = 0.0, 0
        readings = device_readings(self.device)
        readings[_UTILIZATION] = self.busy.window_mean(readings[_UTILIZATION])
        return [per_step, *readings]

    def report(
        self, timings: torch.Tensor, rows: torch.Tensor, steps: int
    ) -> tuple[dict[str, float], str | None]:
        """The log line's figures from every rank's window of `steps` steps (`timings`: one row
        per rank, its train_s and data_wait_s; `rows`: its `row()`), and the warning that names
        the slowest rank when its excess passes the threshold (None otherwise).

        With several ranks and a timed step in the window: the median and the maximum over
        the ranks of compute and of collective wait, per step, and the slowest rank with its
        excess (a share of the others' median). The GPU readings, where every rank has them:
        their median over the ranks, and the slowest rank's.
        """
        train_s, data_wait_s, wait = timings[:, 0], timings[:, 1], rows[:, 0]
        readings = rows[:, 1:]
        known = [
            (index, name, shown)
            for index, (name, _, _, shown) in enumerate(READINGS)
            if not bool(readings[:, index].isnan().any())
        ]
        figures = {f"train/gpu_{name}": _median(readings[:, index]) for index, name, _ in known}
        if self.world_size == 1 or bool(wait.isnan().any()):
            return figures, None
        own = (train_s / steps - wait).clamp(min=0)
        compute = (own - data_wait_s / steps).clamp(min=0)
        straggler = slowest_rank(own.tolist())
        figures |= {
            "train/compute_s": _median(compute),
            "train/compute_max_s": float(compute.max()),
            "train/collective_wait_s": _median(wait),
            "train/collective_wait_max_s": float(wait.max()),
            "train/slowest_rank": straggler.rank,
            "train/slowest_excess": straggler.excess,
        }
        figures |= {
            f"train/gpu_{name}_slowest": float(readings[straggler.rank, index])
            for index, name, _ in known
        }
        if not self._persists(straggler):
            return figures, None
        rank = straggler.rank
        data_wait = float(data_wait_s[rank]) / steps
        others = [other for other in range(self.world_size) if other != rank]
        gpu = [
            (shown, float(readings[rank, index]), _median(readings[others, index]))
            for index, _, shown in known
        ]
        return figures, self._warning(straggler, float(compute[rank]), data_wait, gpu)

    def _persists(self, straggler: Straggler) -> bool:
        """Whether `straggler`, this window's slowest rank, is named: past the threshold and
        MIN_EXCESS_S, as it was in the PERSIST_WINDOWS - 1 windows before."""
        past = straggler.excess > self.threshold and straggler.excess_s >= MIN_EXCESS_S
        if not (self.threshold and past):
            self._suspect, self._suspect_windows = None, 0
            return False
        same = self._suspect == straggler.rank
        self._suspect_windows = self._suspect_windows + 1 if same else 1
        self._suspect = straggler.rank
        return self._suspect_windows >= PERSIST_WINDOWS

    def _warning(
        self,
        straggler: Straggler,
        compute_s: float,
        data_wait_s: float,
        gpu: list[tuple[str, float, float]],
    ) -> str:
        """The line that names the slowest rank: its host, its own time per step and what it
        is made of, its excess; its GPU's readings beside the others' median (how each is
        shown, its value, theirs)."""
        message = (
            f"rank {straggler.rank} on {roster().host_of(straggler.rank)} is the slowest: "
            f"{straggler.own_s * 1e3:.1f} ms/step of its own (compute {compute_s * 1e3:.1f}, "
            f"data wait {data_wait_s * 1e3:.1f}), {straggler.excess_s * 1e3:.1f} ms "
            f"({straggler.excess:.0%}) more than the median of the other ranks "
            f"({straggler.others_s * 1e3:.1f} ms), which wait for it in the gradient all-reduce"
        )
        if gpu:
            mine = ", ".join(shown.format(value) for shown, value, _ in gpu)
            theirs = ", ".join(shown.format(median) for shown, _, median in gpu)
            message += f"; its GPU: {mine} (the others' median: {theirs})"
        return message + (
            ". Look at that host: a throttled or slower device, a busy CPU, its data loading "
            f"(this warning: train.straggler_threshold={self.threshold:g})"
        )


def describe_ranks(figures: dict[str, float]) -> list[str]:
    """`Stragglers.report`'s figures as the log line shows them (none with one rank and no
    GPU readings)."""
    parts = []
    if "train/compute_s" in figures:
        parts += [
            f"compute {figures['train/compute_s'] * 1e3:.1f} ms/step (max "
            f"{figures['train/compute_max_s'] * 1e3:.1f})",
            f"collective wait {figures['train/collective_wait_s'] * 1e3:.1f} ms/step (max "
            f"{figures['train/collective_wait_max_s'] * 1e3:.1f})",
        ]
    gpu = [
        shown.format(figures[f"train/gpu_{name}"])
        for name, _, _, shown in READINGS
        if f"train/gpu_{name}" in figures
    ]
    if gpu:
        parts.append("GPU " + ", ".join(gpu))
    return parts
