"""Rank-aware logging: rank 0 tells the story, the other ranks speak only when something is wrong.

Every line carries its rank and goes to stderr, which the launcher collects. Each log file in the
run directory has a single writer, because appends from several hosts to one file on a shared
file system (NFS, Lustre) can interleave or lose lines: rank 0 writes `train.log`, and rank N
writes `train.rank<N>.log`, created at its first warning, so a healthy run leaves train.log only.
On rank 0 at a terminal, a progress bar shares stderr with the log lines.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import TextIO


def setup_logging(rank: int, run_dir: Path | None = None) -> None:
    """Configure the root logger for this rank: INFO on rank 0, WARNING elsewhere; to stderr,
    and to this rank's file in `run_dir` once the job owns it."""
    level = logging.INFO if rank == 0 else logging.WARNING
    formatter = logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        log_file = run_dir / log_file_name(rank)
        handlers.append(logging.FileHandler(log_file, mode="a", delay=rank != 0))
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    for handler in handlers:
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(level)


def log_file_name(rank: int) -> str:
    return "train.log" if rank == 0 else f"train.rank{rank}.log"


class ProgressBar:
    """One line at the bottom of a terminal: steps done, speed and time left.

    Drawn only when `enabled` and the stream is a terminal (never into a log file or a Slurm
    output file), at most 5 times a second, so it costs nothing measurable per step. Log lines
    written to the same stream first clear it; it is drawn again at the next update.
    """

    REDRAW_S = 0.2
    WIDTH = 30

    def __init__(self, first: int, total: int, enabled: bool, stream: TextIO = sys.stderr) -> None:
        self.first, self.total, self.stream = first, total, stream
        self.enabled = enabled and stream.isatty()
        self._started = time.perf_counter()
        self._drawn = 0.0
        self._handlers: list[logging.Handler] = []
        if self.enabled:
            for handler in logging.getLogger().handlers:
                if isinstance(handler, logging.StreamHandler) and handler.stream is stream:
                    handler.addFilter(self._clear_before_log)
                    self._handlers.append(handler)

    def update(self, step: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self._drawn < self.REDRAW_S and step < self.total:
            return
        self._drawn = now
        self.stream.write("\r" + self.render(step, now - self._started) + "\033[K")
        self.stream.flush()

    def render(self, step: int, elapsed: float) -> str:
        """The bar's text after `elapsed` seconds at `step`."""
        done = (step - self.first) / max(1, self.total - self.first)
        filled = int(self.WIDTH * done)
        rate = (step - self.first) / elapsed if elapsed > 0 else 0.0
        left = (self.total - step) / rate if rate > 0 else 0.0
        bar = "#" * filled + "." * (self.WIDTH - filled)
        minutes, seconds = divmod(int(left), 60)
        return (
            f"step {step}/{self.total} [{bar}] {done:4.0%} "
            f"{rate:.1f} steps/s, {minutes}:{seconds:02d} left"
        )

    def close(self) -> None:
        for handler in self._handlers:
            handler.removeFilter(self._clear_before_log)
        self._handlers = []
        if self.enabled:
            self._clear()

    def _clear(self) -> None:
        self.stream.write("\r\033[K")
        self.stream.flush()
        self._drawn = 0.0

    def _clear_before_log(self, record: logging.LogRecord) -> bool:
        self._clear()
        return True
