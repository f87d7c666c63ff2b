"""The project's console command (`[project.scripts]` in pyproject.toml): what
`python -m <package>.train` does, as an installed command.

It imports the training (and torch) only after recording the stop signals and checking the
project's dependencies, as train.py does from its first lines when run with `python -m`.
"""

from __future__ import annotations

from .dependencies import require_installed
from .faults.signals import record_early


def train_command() -> int:
    """Record the stop signals, check the dependencies, then import the training and run it."""
    record_early()
    require_installed()
    from .launch import exit_status_recorded
    from .train import main

    return exit_status_recorded(main)
