"""What the straggler figures cost a step: the Trainer's step with this rank's wait in the
gradient all-reduce timed, as in training, against the same step untimed.

Run by run.py: `torchrun --standalone --nproc-per-node=2 bench/stragglers.py --project DIR
--json FILE [section.key=value ...]`. One Trainer per rank (the project's default config with
the overrides) trains blocks of `--steps` steps, each block from the start of the epoch, with
the wait timed (`Stragglers.timed_backward`, as in training: one step in a third of
train.log_every, the steps counted on across blocks) and untimed (a context that does nothing
in its place), and untimed again, in an order drawn for each round of three blocks,
after `--warmup` rounds. Per block: the CPU time of the training thread and of the process, and
the wall time. A ratio (timed / untimed) is overhead.py's paired ratio over the rounds of both
ranks, with its interval; untimed again / untimed is the control, what chance alone gives.
Once per log line each rank also reads its row and rank 0 gives the verdict: timed apart.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from types import ModuleType

import torch
from ddp_project.cluster.distributed import detect_env, gather_objects, process_group
from ddp_project.config import load_config
from ddp_project.monitoring.metrics import MetricsLogger
from ddp_project.task import Task
from ddp_project.training.trainer import Trainer
from side_by_side import load_overhead

#: Per block: CPU time of the training thread, of the process, and wall time.
FIGURES = ("cpu_step_s", "process_cpu_step_s", "wall_step_s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--project", type=Path, required=True)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=10, help="steps per block")
    parser.add_argument("--rounds", type=int, default=150, help="rounds of blocks timed")
    parser.add_argument("--warmup", type=int, default=3, help="rounds of blocks not timed")
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    args = parser.parse_args()
    overhead = load_overhead(args.project)
    env = detect_env()
    config_file = args.project / "configs" / "default.yaml"
    overrides = [*args.overrides, "train.max_steps=1000000"]
    with process_group(env, load_config(config_file, overrides).dist) as device:
        run_dir = overhead.shared_temporary_dir(env)
        config = load_config(config_file, [*overrides, f"run.dir={run_dir}"])
        metrics = MetricsLogger(run_dir, is_main=env.is_main)
        task = Task(config.task, seed=config.run.seed)
        trainer = Trainer(config, task, env, device, run_dir, metrics)
        if trainer.steps_per_epoch < args.steps:
            raise SystemExit(f"an epoch has {trainer.steps_per_epoch} steps, fewer than --steps")
        timed = trainer.stragglers.timed_backward
        variants = {"timed": timed, "untimed": untimed, "untimed_again": untimed}

        def block(variant: str) -> dict[str, float]:
            trainer.stragglers.timed_backward = variants[variant]
            trainer.sampler.set_epoch(0)
            batches = iter(trainer.train_loader)
            start = (time.thread_time(), time.process_time(), time.perf_counter())
            for _ in range(args.steps):
                trainer.train_step(batches)
                trainer.step += 1  # which steps are timed follows the step count
            end = (time.thread_time(), time.process_time(), time.perf_counter())
            return {
                figure: (b - a) / args.steps
                for figure, a, b in zip(FIGURES, start, end, strict=True)
            }

        rounds = []
        for index in range(args.warmup + args.rounds):
            order = random.Random(index).sample(sorted(variants), len(variants))
            blocks = {variant: block(variant) for variant in order}
            if index >= args.warmup:
                rounds.append(blocks)
        trainer.stragglers.timed_backward = timed
        log_line_s = log_line_seconds(trainer, env.world_size)
        metrics.close()
        every = [blocks for rank in gather_objects(rounds) for blocks in rank]
    if env.is_main:
        figures = {
            "world_size": env.world_size,
            "steps": args.steps,
            "rounds": len(every),
            "confidence": args.confidence,
            **{
                variant: {
                    figure: statistics.median(blocks[variant][figure] for blocks in every)
                    for figure in FIGURES
                }
                for variant in variants
            },
            "ratios": ratios(overhead, every, "timed", "untimed", args.confidence),
            "control": ratios(overhead, every, "untimed_again", "untimed", args.confidence),
            "log_line_s": log_line_s,
        }
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0


def untimed(loss: torch.Tensor, reduces: bool) -> AbstractContextManager:
    """What replaces `Stragglers.timed_backward` in the untimed blocks."""
    return nullcontext()


def ratios(
    overhead: ModuleType, every: list[dict], numerator: str, denominator: str, confidence: float
) -> dict[str, dict[str, float]]:
    """overhead.py's `paired_ratio` of every figure of two variants over the rounds."""
    return {
        figure: overhead.paired_ratio(
            [blocks[numerator][figure] for blocks in every],
            [blocks[denominator][figure] for blocks in every],
            confidence,
        )
        for figure in FIGURES
    }


def log_line_seconds(trainer: Trainer, world_size: int, calls: int = 1000) -> float:
    """The straggler figures' share of a log line: this rank's row, and the verdict on the
    rows of `world_size` ranks like it (the median of `calls`)."""
    stragglers = trainer.stragglers
    timings = torch.tensor([[1.0, 0.01]] * world_size, dtype=torch.float64)
    rows = torch.tensor([stragglers.row()] * world_size, dtype=torch.float64)
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        stragglers.row()
        stragglers.report(timings, rows, steps=10)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


if __name__ == "__main__":
    raise SystemExit(main())
