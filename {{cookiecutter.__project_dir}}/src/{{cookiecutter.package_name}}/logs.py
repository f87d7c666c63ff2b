"""Rank-aware logging: rank 0 tells the story, the other ranks speak only when something is wrong.

Every line carries its rank. All ranks append to one `train.log` in the run directory (appends
of whole lines do not interleave), and print to stderr, which the launcher collects.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path


def setup_logging(rank: int, run_dir: Path) -> None:
    """Configure the root logger for this rank: INFO on rank 0, WARNING elsewhere."""
    level = logging.INFO if rank == 0 else logging.WARNING
    formatter = logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s")
    run_dir.mkdir(parents=True, exist_ok=True)
    handlers: list[logging.Handler] = [
        logging.StreamHandler(sys.stderr),
        logging.FileHandler(run_dir / "train.log", mode="a"),
    ]
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    for handler in handlers:
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(level)
