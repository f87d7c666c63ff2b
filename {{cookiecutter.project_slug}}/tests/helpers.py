"""Helpers shared by the tests: small fast configs and a torchrun launcher."""

from __future__ import annotations

import os
import subprocess
import sys

#: Overrides that make a run take seconds on a laptop CPU.
FAST = [
    "task.num_train_samples=512",
    "task.num_eval_samples=101",
    "task.hidden_dim=32",
    "train.global_batch_size=32",
    "train.micro_batch_size=8",
    "train.log_every=2",
    "train.eval_every=4",
    "checkpoint.every_steps=4",
    "data.num_workers=0",
]


def run_torchrun(
    nproc: int, overrides: list[str], timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """Train under `torchrun --standalone`: it picks a free port, so parallel tests never clash."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "{{ cookiecutter.package_name }}.train",
        *overrides,
    ]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
