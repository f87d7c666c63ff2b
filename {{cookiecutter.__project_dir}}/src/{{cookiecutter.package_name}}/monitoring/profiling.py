"""Where a step's time goes: an optional torch.profiler trace of a short window of training
steps on rank 0, and NVTX ranges around the phases of every step for Nsight Systems.

Both are off by default (profile.enabled, profile.nvtx). Profiling one rank with torch.profiler
is enough to see where a step's time goes; the other ranks run unprofiled, so they cannot be
slowed down by it. NVTX ranges cost next to nothing while no profiler listens, so they are on
every rank: `nsys profile` records the ranks it is started for.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
from torch.cuda import nvtx
from torch.profiler import ProfilerActivity, profile, schedule

from ..config import ProfileConfig

log = logging.getLogger(__name__)

_NO_RANGE = nullcontext()


class NvtxRange:
    """An NVTX range to enter as often as needed (torch.cuda.nvtx.range makes a new context
    manager at every call)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        nvtx.range_push(self.name)

    def __exit__(self, *_: object) -> None:
        nvtx.range_pop()


class StepRanges:
    """NVTX ranges around the phases of a step (`with ranges.forward:`; data wait, forward,
    backward, optimizer), which Nsight Systems shows on each rank's timeline beside the CUDA
    kernels and NCCL calls. On with profile.nvtx on a GPU; otherwise every phase is one shared
    context that does nothing. Built once: a step enters them without building anything."""

    def __init__(self, config: ProfileConfig, device: torch.device) -> None:
        self.enabled = config.nvtx and device.type == "cuda"

        def phase(name: str) -> AbstractContextManager:
            return NvtxRange(name) if self.enabled else _NO_RANGE

        self.data_wait = phase("data wait")
        self.forward = phase("forward")
        self.backward = phase("backward")
        self.optimizer = phase("optimizer")


class StepProfiler:
    """Call `step()` after every training step; records `active_steps` after `wait_steps`."""

    def __init__(
        self, config: ProfileConfig, run_dir: Path, device: torch.device, is_main: bool
    ) -> None:
        self.out_dir = run_dir / "profile"
        self._profile: profile | None = None
        self._written = False
        if not (config.enabled and is_main):
            return
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profile = profile(
            activities=activities,
            schedule=schedule(
                wait=config.wait_steps, warmup=1, active=config.active_steps, repeat=1
            ),
            on_trace_ready=self._write,
            record_shapes=True,
        )
        self._profile.start()

    def step(self) -> None:
        if self._profile is None:
            return
        self._profile.step()
        if self._written:
            self.stop()

    def stop(self) -> None:
        """Finish early (the run ended inside the window): the trace holds what was recorded."""
        if self._profile is not None:
            self._profile.stop()
            self._profile = None

    def _write(self, prof: profile) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        trace = self.out_dir / "trace_rank0.json"
        prof.export_chrome_trace(str(trace))
        on_cuda = ProfilerActivity.CUDA in prof.activities
        sort_by = "self_device_time_total" if on_cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort_by, row_limit=30)
        (self.out_dir / "summary.txt").write_text(table + "\n")
        log.info("profiler trace written to %s (summary.txt lists the top ops)", trace)
        self._written = True
