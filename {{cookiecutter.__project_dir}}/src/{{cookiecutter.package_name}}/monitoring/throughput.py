"""Step time, throughput, data wait, peak memory and MFU: what each log line reports.

Only host clocks are read during training: no device synchronisation per step. The device is
synchronised once per log interval (and before evaluation and checkpoints, whose time is left
out), so on a GPU a window's time is the time the device took, not the time to queue kernels.
Each rank measures itself; the trainer gathers all ranks' figures only at log time.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass

import torch

#: Dense peak TFLOP/s of one device by name fragment (first match wins) and precision, from
#: the vendors' data sheets. Set train.peak_tflops for a device that is not listed.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
}


def peak_flops(device: torch.device, precision: str, override_tflops: float) -> float | None:
    """One device's peak FLOP/s at `precision` (bf16, fp16, tf32 or fp32), or None if unknown."""
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, peaks in PEAK_TFLOPS.items():
        if fragment in name:
            return peaks[precision] * 1e12
    return None


def peak_memory_bytes(device: torch.device) -> int:
    """The most memory this process has held: the CUDA allocator's peak since the last reset, or
    the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that the clock read next includes it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Window:
    """This rank's figures for one log interval."""

    steps: int
    train_s: float
    data_wait_s: float
    peak_memory: int


class StepMeter:
    """Times this rank's training steps, leaving out evaluation, checkpoints and logging.

    The trainer calls `start()` when training starts, adds the time it waits for each batch to
    `data_wait_s`, counts `steps`, brackets the work to leave out with `pause()`/`resume()`,
    and reads the interval with `window()`. Totals over the whole launch feed the run summary.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.steps = 0
        self.data_wait_s = 0.0
        self.total_steps = 0
        self.total_train_s = 0.0
        self._started = 0.0
        self._paused_at: float | None = None
        self._paused_s = 0.0

    def start(self) -> None:
        self.steps, self.data_wait_s, self._paused_s = 0, 0.0, 0.0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._started = time.perf_counter()

    def pause(self) -> None:
        synchronize(self.device)
        self._paused_at = time.perf_counter()

    def resume(self) -> None:
        if self._paused_at is not None:
            self._paused_s += time.perf_counter() - self._paused_at
            self._paused_at = None

    def window(self) -> Window:
        """The interval since `start()`; starts the next one."""
        synchronize(self.device)
        train_s = time.perf_counter() - self._started - self._paused_s
        window = Window(self.steps, train_s, self.data_wait_s, peak_memory_bytes(self.device))
        self.total_steps += self.steps
        self.total_train_s += train_s
        self.start()
        return window


def window_figures(
    rows: torch.Tensor,
    steps: int,
    unit: str,
    units: float,
    flops_per_step: float | None,
    peak: float | None,
) -> dict[str, float]:
    """The metrics of one log interval from every rank's `Window` (one row per rank: train_s,
    data_wait_s, peak_memory), the throughput `units` all ranks processed in it, and the FLOPs
    of one step (None: no MFU).

    Throughput uses the slowest rank's time: the ranks wait for each other every step, so that
    is the job's pace. A rank that is slow at its own work (a starved DataLoader, a slower
    device) makes every rank wait in the gradient all-reduce; its data wait, or the spread of
    the step times, points at it.
    """
    train_s, data_wait_s, memory = rows[:, 0], rows[:, 1], rows[:, 2]
    step_times = train_s / steps
    wait_shares = data_wait_s / train_s
    slowest = float(train_s.max())
    world_size = rows.shape[0]
    rate = units / slowest
    figures = {
        "train/step_time_s": float(step_times.mean()),
        "train/step_time_min_s": float(step_times.min()),
        "train/step_time_max_s": float(step_times.max()),
        f"train/{unit}_per_s": rate,
        f"train/{unit}_per_s_per_device": rate / world_size,
        "train/data_wait_share": float(wait_shares.mean()),
        "train/data_wait_share_max": float(wait_shares.max()),
        "train/data_wait_max_rank": int(wait_shares.argmax()),
        "train/peak_memory_gb": float(memory.max()) / 1e9,
    }
    if peak is not None and flops_per_step is not None:
        figures["train/mfu"] = steps * flops_per_step / slowest / (world_size * peak)
    return figures


def describe(figures: dict[str, float], unit: str) -> str:
    """`window_figures` as the log line shows them."""
    parts = [
        f"{figures[f'train/{unit}_per_s']:,.0f} {unit}/s",
        f"{figures['train/step_time_s'] * 1e3:.1f} ms/step (ranks "
        f"{figures['train/step_time_min_s'] * 1e3:.1f}-"
        f"{figures['train/step_time_max_s'] * 1e3:.1f})",
        f"data wait {figures['train/data_wait_share']:.0%} (max "
        f"{figures['train/data_wait_share_max']:.0%} on rank "
        f"{figures['train/data_wait_max_rank']})",
        f"peak mem {figures['train/peak_memory_gb']:.2f} GB",
    ]
    if "train/mfu" in figures:
        parts.append(f"MFU {figures['train/mfu']:.1%}")
    return " | ".join(parts)
