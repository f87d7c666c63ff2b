"""How long a checkpoint stops training, written at once or in the background (checkpoint.async).

    python benchmarks/checkpoint_stall.py                   # a state of about 1 GB, on CPU
    python benchmarks/checkpoint_stall.py --state-gb 4 --json stall.json
    python benchmarks/checkpoint_stall.py --device cuda     # the state on the GPU

One process with a gloo group of one rank trains a stack of square linear layers with AdamW on
`--device`, sized so that the weights and Adam's two moments add up to `--state-gb`, and saves
their checkpoint with the project's own code (checkpoint.save_checkpoint, and the writer of
background_save.py), into `--run-dir` (default: a temporary directory, which is removed). On a
GPU the background save copies the state into pinned host memory, as training on GPUs does,
and every time waits for the device's queued work.

- synchronous: the seconds `save_checkpoint` takes, all of which training waits;
- asynchronous: the seconds training pauses to copy the state into host memory (the first save
  allocates that copy, the later ones reuse it: both are reported), and the seconds the
  background write then takes;
- training speed: steps per second without a save, and while a background save is in flight
  (the write and training share the machine's cores and memory bandwidth).

Each figure is the median over `--repeats` saves. The goal of checkpoint.async: the stall is at
most a tenth of the synchronous save (`goal_met`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from {{ cookiecutter.package_name }}.checkpointing.background_save import BackgroundSaver, CompletedSave
from {{ cookiecutter.package_name }}.checkpointing.checkpoint import save_checkpoint
from {{ cookiecutter.package_name }}.cluster.distributed import DistEnv
from {{ cookiecutter.package_name }}.monitoring.throughput import synchronize

WIDTH = 2048
#: float32 weights plus Adam's two moments of the same size.
BYTES_PER_PARAMETER = 3 * 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-gb", type=float, default=1.0, help="weights + Adam state, GB")
    parser.add_argument("--repeats", type=int, default=3, help="saves of each kind")
    parser.add_argument("--batch", type=int, default=16, help="samples per training step")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where it trains")
    parser.add_argument("--speed-s", type=float, default=2.0, help="seconds of steps per s idle")
    parser.add_argument("--run-dir", type=Path, help="where to write (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    return parser.parse_args(argv)


def build(state_gb: float, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    layers = max(1, round(state_gb * 1e9 / BYTES_PER_PARAMETER / (WIDTH * WIDTH + WIDTH)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    return model, optimizer


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: int) -> None:
    inputs = torch.randn(batch, WIDTH, device=next(model.parameters()).device)
    loss = model(inputs).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def state_of(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, number: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": number}
    return state, {"rng": torch.get_rng_state()}


def state_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(value) for value in state)
    return 0


def steps_per_s(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: int, seconds: float
) -> float:
    device = next(model.parameters()).device
    synchronize(device)
    started, steps = time.perf_counter(), 0
    while steps < 3 or time.perf_counter() - started < seconds:
        step(model, optimizer, batch)
        steps += 1
    synchronize(device)
    return steps / (time.perf_counter() - started)


def measure(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    env = DistEnv()
    device = torch.device(args.device)
    model, optimizer = build(args.state_gb, device)
    step(model, optimizer, args.batch)  # Adam's moments exist from the first step
    number = 1

    def write_with(group: dist.ProcessGroup | None):
        def write(states: tuple[dict[str, Any], dict[str, Any]]) -> Path:
            return save_checkpoint(run_dir, number, *states, env, keep_last=1, group=group)

        return write

    sync_s = []
    for _ in range(args.repeats):
        number += 1
        step(model, optimizer, args.batch)
        synchronize(device)
        started = time.perf_counter()
        write_with(None)(state_of(model, optimizer, number))
        sync_s.append(time.perf_counter() - started)

    idle = steps_per_s(model, optimizer, args.batch, args.speed_s)

    saver = BackgroundSaver(pin_memory=device.type == "cuda", timeout_s=1800)
    completed: list[CompletedSave] = []
    stalls, busy = [], []
    for _ in range(args.repeats + 1):  # the first allocates the host copy
        number += 1
        step(model, optimizer, args.batch)
        synchronize(device)
        states = state_of(model, optimizer, number)
        stalls.append(saver.start(number, states, write_with(saver.group), completed.append))
        started, steps, count = time.perf_counter(), 0, len(completed)
        while len(completed) == count:  # train while the save is in flight
            step(model, optimizer, args.batch)
            steps += 1
            saver.poll()
        synchronize(device)
        busy.append(steps / (time.perf_counter() - started))
    saver.wait()

    sync_save_s = statistics.median(sync_s)
    stall_s = statistics.median(stalls[1:])
    return {
        "state_bytes": state_bytes(state_of(model, optimizer, number)),
        "sync_save_s": sync_save_s,
        "async_stall_s": stall_s,
        "async_first_stall_s": stalls[0],
        "async_write_s": statistics.median(save.write_s for save in completed[1:]),
        "stall_ratio": stall_s / sync_save_s,
        "goal_met": stall_s <= 0.1 * sync_save_s,
        "steps_per_s_idle": idle,
        "steps_per_s_during_save": statistics.median(busy),
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "device": str(device),
        "pin_memory": saver.host.pin_memory,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.repeats < 1 or not math.isfinite(args.state_gb) or args.state_gb <= 0:
        raise SystemExit("--repeats must be >= 1 and --state-gb positive")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU is visible")
    workdir = Path(tempfile.mkdtemp(prefix="checkpoint-stall-"))
    run_dir = args.run_dir or workdir / "run"
    store = dist.FileStore(os.fspath(workdir / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        record = measure(args, run_dir)
    finally:
        dist.destroy_process_group()
        shutil.rmtree(workdir, ignore_errors=True)
    text = json.dumps(record, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
