"""What the Trainer costs per step against a plain DDP loop that does the same work.

    torchrun --standalone --nproc-per-node=2 benchmarks/overhead.py
    torchrun --standalone --nproc-per-node=gpu benchmarks/overhead.py train.mixed_precision=bf16

Both train the model of `Task.build_model()` from the same seed, on the same samples in the
same order (the project's training loader, with the task's collate), with AdamW over the task's
parameter groups, the warmup-cosine schedule, clipping, micro-batches and `no_sync` accumulation
as configured (`--config`, then `section.key=value` overrides), and the task's loss as it comes:
a mean, or a sum normalised over the global batch's count. The plain loop is about forty lines:
the step and nothing else, in nanoGPT's shape (one autocast context, built once, around every
forward), so settings it does not replicate are refused (`train.compile`, `dist.comm_hook`,
`dist.broadcast_buffers`).
The Trainer adds what users get from it: loss tracking, the stop protocol
(`checkpoint.stop_on_signals`, on by default), and its periodic work. Logging, evaluation and
checkpoints happen every N steps; their intervals are set beyond the timed steps here, since the
plain loop has none of them.

The loops run in one launch, taking turns one optimizer step at a time: each on a thread of
its own, in an order drawn for every cycle of one step each (the Trainer, the plain loop, the
plain loop again), so that neighbouring steps of the three meet the same machine. On a shared
CPU, whose speed changes from one second to the next by tens of percent, whole runs one after
the other differ by more than the loops do; steps side by side do not. Each loop keeps its own
random streams, saved and restored at each turn. A launch runs `--rounds` rounds (each builds
the three loops anew) after one that warms up, not reported. Each run takes `--warmup-steps`
untimed steps, then `--steps` timed ones, then one more untimed step, on which the Trainer
evaluates and writes its final checkpoint. In every round the final weights of the three must
be bitwise equal: the same work was done, so the times compare the loops and nothing else. On
a GPU whose kernels are not deterministic (the atomics of cuDNN attention's backward), two
runs of the same work end a few ulps apart: the plain loop then differs from itself too, and
the benchmark says so.

The Trainer is used as it is: the end of each of its steps is marked by the `StopRequests` it
is given, which it asks after every optimizer step whether to stop (the answer is the real
protocol's). The plain loop marks the end of its steps the same way. A step runs from the
moment its loop has the turn to that mark (on a GPU, to the end of its kernels: the device
is synchronized there, as the loops share it). Four figures per block of `--block-steps`
timed steps, in seconds per step:

- wall median: the median time of the block's steps;
- wall mean: their mean;
- CPU thread: the CPU time of the loop's thread: what the loop itself computes and
  dispatches, without the waits for the other ranks or for a core that another program holds;
- CPU process: the same for every thread of the process (the collectives' threads too).

The wall figures are the slowest rank's, the CPU figures the mean of the ranks'. The CPU
figures show a loop's own cost even on a shared machine, where the wall clock measures the
scheduler as much as the loop.

Each ratio is the geometric mean over the blocks of the ratio of the same block of two loops
(Trainer / plain), with a bootstrap interval over the rounds (`--confidence`, 95% by default):
the blocks of one round share its builds, where each loop's memory lies, which moves them
together by about 1% on a CPU, so the round is the unit that repeats. The plain loop against
itself (plain again / plain) is the control: its interval shows how far from 1 chance alone
takes a ratio on this machine, that is what the benchmark resolves. A Trainer ratio whose
interval lies above 1 measures a cost; one whose interval holds 1 cannot be told from the
plain loop at this resolution (more `--rounds` narrow both intervals).

Exit status 1 when the Trainer ended in other weights than the plain loop while the plain loop
ended in its own twice (the loops did not do the same work), 2 on a setting it cannot compare,
else 0.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LambdaLR

from {{ cookiecutter.package_name }}.cluster.distributed import (
    DistEnv,
    all_ranks_agree,
    all_reduce_sum,
    detect_env,
    is_distributed,
    process_group,
)
from {{ cookiecutter.package_name }}.config import Config, ConfigError, flatten, load_config
from {{ cookiecutter.package_name }}.contract import adopt, warmup_cosine
from {{ cookiecutter.package_name }}.faults.stopping import StopRequests
from {{ cookiecutter.package_name }}.loading.data import build_train_loader, loader_workers
from {{ cookiecutter.package_name }}.monitoring.metrics import MetricsLogger
from {{ cookiecutter.package_name }}.task import Task
from {{ cookiecutter.package_name }}.training import rng
from {{ cookiecutter.package_name }}.training.losses import MicroLoss
from {{ cookiecutter.package_name }}.training.trainer import (
    AUTOCAST_DTYPES,
    Trainer,
    batch_split,
    move_to_device,
)

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
#: Trainer settings that the plain loop does not replicate, and the value it assumes.
PLAIN_LOOP_ASSUMES = {
    "train.compile": False,
    "dist.comm_hook": "none",
    "dist.broadcast_buffers": True,
}
Weights = dict[str, torch.Tensor]
#: A loop to time: it trains under the clock given and returns its final weights.
Runner = Callable[["StepClock"], Weights]
#: What is reported per run, in seconds per timed step (see StepClock.figures), and its label.
FIGURES = {
    "median_step_s": "wall median",
    "mean_step_s": "wall mean",
    "cpu_step_s": "CPU thread",
    "process_cpu_step_s": "CPU process",
}
CPU_FIGURES = ("cpu_step_s", "process_cpu_step_s")


class StepClock:
    """The time of each optimizer step of one run: from the moment the loop has its turn
    (`begin`) to the end of the step (`tick`), in wall clock, CPU time of the loop's thread and
    CPU time of the process. After each step, `after_step` hands the turn on (Turns)."""

    def __init__(self, device: torch.device, warmup_steps: int, steps: int) -> None:
        self.device = device
        self.window = (warmup_steps, warmup_steps + steps)
        #: Per step: seconds of wall clock, of this thread's CPU and of the process's CPU.
        self.steps: list[tuple[float, float, float]] = []
        self.after_step: Callable[[], None] = lambda: None
        self._begun = _now()

    def begin(self) -> None:
        self._begun = _now()

    def tick(self) -> None:
        """The end of a step (on a GPU, of its kernels: the loops share the device); then the
        other loops' turns, and this loop's next step begins."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        end = _now()
        self.steps.append(tuple(e - b for b, e in zip(self._begun, end, strict=True)))
        self.after_step()
        self.begin()

    def blocks(self, size: int) -> list[dict[str, float]]:
        """The timed steps' figures in blocks of `size` consecutive steps (see FIGURES); steps
        past the last whole block are left out."""
        first, last = self.window
        if len(self.steps) < last:
            raise RuntimeError(f"the clock saw {len(self.steps)} steps, fewer than {last}")
        timed = self.steps[first:last]
        starts = range(0, len(timed) - size + 1, size)
        return [block_figures(timed[start : start + size]) for start in starts]


def _now() -> tuple[float, float, float]:
    return time.perf_counter(), time.thread_time(), time.process_time()


def block_figures(steps: list[tuple[float, float, float]]) -> dict[str, float]:
    """Seconds per step over `steps`: median and mean wall clock, mean CPU time of the loop's
    thread and of the process."""
    count = len(steps)
    return {
        "median_step_s": statistics.median(wall for wall, _, _ in steps),
        "mean_step_s": sum(wall for wall, _, _ in steps) / count,
        "cpu_step_s": sum(thread for _, thread, _ in steps) / count,
        "process_cpu_step_s": sum(process for _, _, process in steps) / count,
    }


class Turns:
    """The loops of one round, each on a thread of its own, taking turns one optimizer step at a
    time: in each cycle every loop steps once, in an order drawn for the cycle (seeded: the same
    on every rank, so their collectives meet). Only one loop runs at any time.

    Neighbouring steps meet the same machine: a CPU that slows down for a second (another
    program, a shared core) slows every loop alike, which runs of whole loops one after the
    other do not. Each loop keeps its own random streams (dropout): the turn saves the state of
    the loop that ends it and restores that of the loop that takes it, so each trains as it
    would alone. A loop that fails ends the round: the others stop at their next step.
    """

    def __init__(self, names: list[str], seed: int, device: torch.device) -> None:
        self.device = device
        self._draw = random.Random(seed)
        self._lock = threading.Lock()
        #: One per loop: a turn wakes only the loop that takes it.
        self._turn = {name: threading.Condition(self._lock) for name in names}
        self._playing = list(names)
        self._cycle: list[str] = []
        self._current: str | None = None
        self._streams: dict[str, dict] = {}
        self._failure: BaseException | None = None

    def run(self, runners: dict[str, Runner], clocks: dict[str, StepClock]) -> dict[str, Weights]:
        """Run every loop to its end; returns each one's final weights."""
        weights: dict[str, Weights] = {}

        def play(name: str) -> None:
            try:
                if self.device.type == "cuda":
                    torch.cuda.set_device(self.device)  # the current device is per thread
                self._wait(name)
                clocks[name].begin()
                weights[name] = runners[name](clocks[name])
            except BaseException as error:  # re-raised by run(), on the main thread
                with self._lock:
                    self._failure = self._failure or error
                    for turn in self._turn.values():
                        turn.notify()
            finally:
                self._pass(name, finished=True)

        for name, clock in clocks.items():
            clock.after_step = partial(self._take_turn, name)
        threads = [  # daemons: an interrupted run (Ctrl-C) does not wait for them
            threading.Thread(target=play, args=(name,), name=name, daemon=True) for name in runners
        ]
        for thread in threads:
            thread.start()
        with self._lock:
            self._next()
        for thread in threads:
            thread.join()
        if self._failure is not None:
            raise self._failure
        return weights

    def _take_turn(self, name: str) -> None:
        self._pass(name, finished=False)
        self._wait(name)

    def _pass(self, name: str, finished: bool) -> None:
        with self._lock:
            self._streams[name] = rng.capture(self.device)
            if finished:
                self._playing.remove(name)
            self._next()

    def _next(self) -> None:
        """Give the turn to the next loop of the cycle (a new cycle drawn when it is over)."""
        self._cycle = [name for name in self._cycle if name in self._playing]
        if not self._cycle:
            self._cycle = self._draw.sample(self._playing, len(self._playing))
        self._current = self._cycle.pop(0) if self._cycle else None
        if self._current in self._streams:
            rng.restore(self._streams[self._current], self.device)
        if self._current is not None:
            self._turn[self._current].notify()

    def _wait(self, name: str) -> None:
        with self._lock:
            self._turn[name].wait_for(lambda: self._current == name or self._failure is not None)
            if self._failure is not None:
                raise RuntimeError(f"{name} stopped: another loop failed") from self._failure


class ClockedStopRequests(StopRequests):
    """The Trainer's stop protocol, unchanged, with the clock's mark after every optimizer
    step."""

    def __init__(self, clock: StepClock, enabled: bool, check_s: float) -> None:
        super().__init__(enabled, check_s)
        self.clock = clock

    def agreed_after_step(self) -> bool:
        agreed = super().agreed_after_step()
        self.clock.tick()
        return agreed


def run_trainer(
    config: Config,
    env: DistEnv,
    device: torch.device,
    run_dir: Path,
    clock: StepClock,
    task: object | None = None,
) -> Weights:
    """Train `task` (default: the project's) with the project's Trainer; returns the final
    weights."""
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = config.checkpoint
    stop = ClockedStopRequests(clock, checkpoint.stop_on_signals, checkpoint.stop_check_s)
    task = task or Task(config.task, seed=config.run.seed)
    metrics = MetricsLogger(run_dir, is_main=env.is_main)
    trainer = Trainer(config, task, env, device, run_dir, metrics, stop)
    trainer.fit()
    metrics.close()
    return {name: value.detach().clone() for name, value in trainer.model.state_dict().items()}


def run_plain(
    config: Config,
    env: DistEnv,
    device: torch.device,
    clock: StepClock,
    sync_every_micro_step: bool = False,
) -> Weights:
    """The same training as a plain loop; returns the final weights.

    `sync_every_micro_step` all-reduces the gradients of every micro-batch instead of once per
    optimizer step (`no_sync` off): what gradient accumulation without `no_sync` costs.
    """
    train, optim, seed = config.train, config.optim, config.run.seed
    micro, accumulation = batch_split(
        train.global_batch_size, train.micro_batch_size, env.world_size
    )
    task = adopt(Task(config.task, seed=seed))
    rng.seed_all(seed)
    model = task_model = task.build_model().to(device)
    if env.world_size > 1:
        model = DistributedDataParallel(
            task_model,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=config.dist.bucket_cap_mb,
            find_unused_parameters=config.dist.find_unused_parameters,
            static_graph=config.dist.static_graph,
            gradient_as_bucket_view=True,
        )
    rng.seed_all(seed + env.rank)  # each rank's own dropout, as in the Trainer
    train_set, _ = task.build_datasets()
    # The Trainer's loader workers: data.num_workers, `auto` resolved for the ranks of this host.
    workers = loader_workers(config.data, int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size)))
    loader, sampler = build_train_loader(
        train_set, env, config.data, micro, seed, device, task.collate, workers
    )
    steps_per_epoch = len(train_set) // train.global_batch_size
    optimizer = torch.optim.AdamW(
        task.param_groups(task_model),
        lr=optim.lr,
        betas=optim.betas,
        weight_decay=optim.weight_decay,
        fused=device.type == "cuda",
    )
    schedule = partial(
        warmup_cosine,
        warmup_steps=optim.warmup_steps,
        total_steps=train.max_steps,
        min_lr_ratio=optim.min_lr_ratio,
    )
    scheduler = LambdaLR(optimizer, schedule)
    dtype = AUTOCAST_DTYPES[train.mixed_precision]
    scaler = torch.amp.GradScaler(device.type, enabled=train.mixed_precision == "fp16")
    # nanoGPT's mixed precision: one context, built once, entered around every forward.
    autocast = nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)
    model.train()
    for step in range(train.max_steps):
        if step % steps_per_epoch == 0:
            sampler.set_epoch(step // steps_per_epoch)
            batches = iter(loader)
        count = None
        for micro_step in range(accumulation):
            batch = move_to_device(next(batches), device)
            sync = sync_every_micro_step or micro_step == accumulation - 1
            with nullcontext() if sync or model is task_model else model.no_sync():
                with autocast:
                    loss = MicroLoss.of(task.training_loss(model, batch))
                if loss.count is None:  # a mean: every micro-batch weighs the same
                    scaler.scale(loss.value / accumulation).backward()
                else:  # (sum, count): normalised by the global batch's count after backward
                    count = loss.count + (0 if count is None else count)
                    scaler.scale(loss.value / (micro * accumulation)).backward()
        scaler.unscale_(optimizer)
        if count is not None:
            total = all_reduce_sum(torch.as_tensor(count, dtype=torch.float64, device=device))
            grads = [param.grad for param in task_model.parameters() if param.grad is not None]
            factor = train.global_batch_size / total.clamp(min=1)
            torch._foreach_mul_(grads, factor.to(grads[0].dtype))
        if optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(task_model.parameters(), optim.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        clock.tick()
    return {name: value.detach().clone() for name, value in task_model.state_dict().items()}


def benchmark_config(
    path: Path | None, overrides: list[str], warmup_steps: int, steps: int
) -> Config:
    """The config to compare with: the user's, with the run's length and intervals set here.

    Logging, evaluation and checkpoints fall on the last step only, after the timed ones.
    Settings that the plain loop does not replicate are refused.
    """
    total = warmup_steps + steps + 1
    fixed = [f"train.max_steps={total}", f"train.log_every={total}", f"train.eval_every={total}"]
    fixed += [f"checkpoint.every_steps={total}", "checkpoint.resume=false"]
    config = load_config(path, [*overrides, *fixed])
    settings = flatten(config.to_dict())
    changed = [
        f"{key}={settings[key]}"
        for key, assumed in PLAIN_LOOP_ASSUMES.items()
        if settings.get(key, assumed) != assumed
    ]
    if changed:
        raise ConfigError(
            f"the plain loop does not replicate {', '.join(changed)}: leave them at their "
            "defaults to compare the two loops"
        )
    return config


def over_ranks(blocks: list[dict[str, float]]) -> list[dict[str, float]]:
    """Every rank's figures of each block as one: the slowest rank's wall clock (the ranks wait
    for each other: the slowest sets the pace), the mean of the ranks' CPU times (each its own
    work)."""
    if not is_distributed():
        return blocks
    slowest = torch.tensor([list(block.values()) for block in blocks], dtype=torch.float64)
    mean = slowest.clone()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    dist.all_reduce(mean)
    mean /= dist.get_world_size()
    return [
        {
            key: float(mean[row, column] if key in CPU_FIGURES else slowest[row, column])
            for column, key in enumerate(block)
        }
        for row, block in enumerate(blocks)
    ]


def summary(blocks: list[dict[str, float]]) -> dict:
    """The median over the blocks of each figure, and the blocks."""
    return {key: statistics.median(block[key] for block in blocks) for key in blocks[0]} | {
        "blocks": blocks
    }


def same_weights(mine: Weights, other: Weights) -> bool:
    """Whether two runs ended with bitwise equal weights on every rank (a collective)."""
    same = mine.keys() == other.keys() and all(torch.equal(mine[k], other[k]) for k in mine)
    return all_ranks_agree(same)


def interleave(
    runners: dict[str, Runner],
    rounds: int,
    clock: Callable[[], StepClock],
    block_steps: int,
) -> tuple[dict[str, list[dict[str, float]]], dict[str, bool]]:
    """Run the loops `rounds` times, taking turns step by step (Turns), after a round that is not
    reported (the warm-up: first calls, allocations, caches).

    Returns each loop's figures per block of `block_steps` timed steps (`over_ranks`), the
    blocks of every round in order, and for every loop but the first whether its final weights
    were bitwise equal to the first loop's in every round.
    """
    names = list(runners)
    blocks: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    equal = {name: True for name in names[1:]}
    for round_index in range(rounds + 1):
        clocks = {name: clock() for name in names}
        turns = Turns(names, round_index, clocks[names[0]].device)
        weights = turns.run(runners, clocks)
        if round_index > 0:
            for name in names:
                blocks[name] += over_ranks(clocks[name].blocks(block_steps))
        for name in equal:
            equal[name] &= same_weights(weights[names[0]], weights[name])
        del weights
        gc.collect()
    return blocks, equal


def paired_ratio(
    numerators: list[float],
    denominators: list[float],
    confidence: float,
    per_round: int = 1,
    resamples: int = 10_000,
) -> dict[str, float]:
    """The geometric mean of the ratios of paired blocks (numerator_i / denominator_i, the same
    steps of two loops taking turns), with a percentile bootstrap interval over the rounds:
    each `per_round` consecutive pairs come from one round.

    Pairing cancels what the blocks share (the machine's speed at the time); the geometric mean
    treats a ratio and its inverse alike. The round, not the block, is what repeats: the blocks
    of one round share its builds (where the memory of each loop lies), which move a round's
    ratios together by about 1% on a CPU. The resampling is seeded: the same blocks give the
    same interval.
    """
    logs = torch.tensor(
        [math.log(a / b) for a, b in zip(numerators, denominators, strict=True)],
        dtype=torch.float64,
    )
    rounds = logs.view(-1, per_round).mean(dim=1)
    picks = torch.randint(
        len(rounds), (resamples, len(rounds)), generator=torch.Generator().manual_seed(0)
    )
    tail = (1 - confidence) / 2
    bounds = torch.tensor([tail, 1 - tail], dtype=torch.float64)
    low, high = torch.quantile(rounds[picks].mean(dim=1), bounds).exp().tolist()
    return {"ratio": math.exp(rounds.mean()), "low": low, "high": high}


def ratios(
    blocks: dict[str, list[dict[str, float]]],
    numerator: str,
    denominator: str,
    confidence: float,
    per_round: int,
) -> dict[str, dict[str, float]]:
    """`paired_ratio` of every figure of two loops' blocks, `per_round` blocks a round."""
    return {
        figure: paired_ratio(
            [block[figure] for block in blocks[numerator]],
            [block[figure] for block in blocks[denominator]],
            confidence,
            per_round,
        )
        for figure in FIGURES
    }


def shown(ratio: dict[str, float]) -> str:
    """A ratio and its interval as the table shows them."""
    return f"{ratio['ratio']:.4f} [{ratio['low']:.4f}, {ratio['high']:.4f}]"


def shared_temporary_dir(env: DistEnv) -> Path:
    """A new directory made by rank 0, whose name every rank receives."""
    name = [tempfile.mkdtemp(prefix="overhead-") if env.is_main else None]
    if is_distributed():
        dist.broadcast_object_list(name, src=0)
    return Path(name[0])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Step time of the Trainer against a plain DDP loop doing the same work, "
        "taking turns step by step in one launch (run under torchrun).",
        epilog="Example: torchrun --standalone --nproc-per-node=2 benchmarks/overhead.py "
        "train.micro_batch_size=64",
    )
    parser.add_argument(
        "--config", type=Path, default=DEFAULT_CONFIG, help="YAML config (default: %(default)s)"
    )
    parser.add_argument("--warmup-steps", type=int, default=10, help="untimed steps per run")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per run")
    parser.add_argument(
        "--block-steps",
        type=int,
        default=10,
        help="timed steps per block, the unit of the intervals (default: 10)",
    )
    parser.add_argument(
        "--rounds", type=int, default=10, help="rounds of one run of each loop (default: 10)"
    )
    parser.add_argument(
        "--confidence", type=float, default=0.95, help="of the intervals (default: 0.95)"
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        help="for the Trainer's final checkpoints (default: a temporary "
        "directory; give a shared one when the ranks run on several machines)",
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_args(argv)
    if args.warmup_steps < 1 or args.block_steps < 1 or args.rounds < 1:
        parser.error("--warmup-steps, --block-steps and --rounds must be at least 1")
    if args.steps < args.block_steps or args.steps % args.block_steps:
        parser.error(
            f"--steps ({args.steps}) must be a multiple of --block-steps ({args.block_steps})"
        )
    if not 0 < args.confidence < 1:
        parser.error("--confidence must be between 0 and 1")
    return args


def report(
    blocks: dict[str, list[dict[str, float]]],
    equal: dict[str, bool],
    args: argparse.Namespace,
    env: DistEnv,
) -> dict:
    """The figures: each loop's medians over the blocks, the Trainer's ratio to the plain loop
    and the control's, with their intervals; the table printed on rank 0. `equal`: for the
    Trainer and the plain loop's second run, whether their weights were the plain loop's."""
    figures = {name: summary(loop_blocks) for name, loop_blocks in blocks.items()}
    per_round = args.steps // args.block_steps
    ratio = ratios(blocks, "trainer", "plain", args.confidence, per_round)
    control = ratios(blocks, "plain_again", "plain", args.confidence, per_round)
    percent = f"{args.confidence:.0%}"
    lines = [
        f"{args.rounds} rounds of {args.steps} timed steps per loop, taking turns, in blocks of "
        f"{args.block_steps}; per step, the median over the blocks, and ratios with their "
        f"{percent} interval:",
        f"{'':<16} {'trainer':>10} {'plain':>10} {'plain again':>11}   "
        f"{'trainer / plain':<24} {'control: plain again / plain':<24}",
        *(
            f"{label + ', ms':<16} "
            + " ".join(f"{figures[name][key] * 1e3:>10.4f}" for name in ("trainer", "plain"))
            + f" {figures['plain_again'][key] * 1e3:>11.4f}   "
            + f"{shown(ratio[key]):<24} {shown(control[key]):<24}"
            for key, label in FIGURES.items()
        ),
        f"final weights bitwise equal: {'yes' if all(equal.values()) else 'NO'}",
    ]
    if not equal["plain_again"]:
        lines.append(
            "the plain loop ended in other weights than itself: this device's kernels are not "
            "deterministic (torch.use_deterministic_algorithms names them), so no run can be "
            "compared bitwise"
        )
    if env.is_main:
        print("\n".join(lines), flush=True)
    return {
        "world_size": env.world_size,
        "rounds": args.rounds,
        "warmup_steps": args.warmup_steps,
        "steps": args.steps,
        "block_steps": args.block_steps,
        "confidence": args.confidence,
        "weights_bitwise_equal": all(equal.values()),
        "deterministic": equal["plain_again"],
        "ratios": ratio,
        "control": control,
        **figures,
    }


def exit_status(record: dict[str, Any]) -> int:
    """1 when the Trainer ended in other weights than the plain loop although the plain loop
    ended in the same weights twice: the loops did not do the same work. On a device whose
    kernels are not deterministic no run compares bitwise, and that is no failure."""
    return 1 if record["deterministic"] and not record["weights_bitwise_equal"] else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = detect_env()
    if getattr(Task, "updates", ()):
        print(
            f"error: the task trains its model in updates ({', '.join(Task.updates)}), and the "
            "plain loop this benchmark compares the Trainer with trains one model with one "
            "optimizer: there is nothing to compare it with",
            file=sys.stderr,
        )
        return 2
    try:
        config = benchmark_config(args.config, args.overrides, args.warmup_steps, args.steps)
        batch_split(config.train.global_batch_size, config.train.micro_batch_size, env.world_size)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    with process_group(env, config.dist) as device:
        root = args.run_dir or shared_temporary_dir(env)
        run_dirs = (root / f"trainer-{index}" for index in itertools.count())
        runners: dict[str, Runner] = {
            "trainer": lambda clock: run_trainer(config, env, device, next(run_dirs), clock),
            "plain": lambda clock: run_plain(config, env, device, clock),
            "plain_again": lambda clock: run_plain(config, env, device, clock),
        }
        clock = partial(StepClock, device, args.warmup_steps, args.steps)
        blocks, equal = interleave(runners, args.rounds, clock, args.block_steps)
        record = report(blocks, equal, args, env)
        if env.is_main:
            if args.json:
                args.json.write_text(json.dumps(record, indent=2) + "\n")
            if args.run_dir is None:
                shutil.rmtree(root, ignore_errors=True)
    return exit_status(record)


if __name__ == "__main__":
    sys.exit(main())
