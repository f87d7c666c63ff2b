"""Training loops timed side by side in one torchrun launch, taking turns step by step.

Run by run.py: `torchrun --nproc-per-node=2 bench/side_by_side.py --project DIR --json FILE
[section.key=value ...]`.
The loops come from the rendered project's benchmarks/overhead.py (its Trainer, its plain
loop with and without `no_sync`, its turns, blocks and intervals) and from lightning_loop.py.
Two scenarios, each a list of loops that take turns one step at a time, `--rounds` times:

- the default batch: global 128 = 2 ranks x micro-batch 32 x 2 accumulation steps: the project's
  Trainer, the plain loop, Lightning and the plain loop again (two runs of the same loop: how
  far from 1 chance alone takes a ratio on this machine);
- accumulation K=4 (global 256): the Trainer and the plain loop, both with `no_sync`, and the
  plain loop with an all-reduce after every micro-batch.

Each scenario's figures hold every loop's medians over the blocks of `--block-steps` timed
steps, and the ratios of `RATIOS` with their intervals over the rounds (overhead.py's `ratios`).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from ddp_project.cluster.distributed import detect_env, process_group
from lightning_loop import run_lightning

SCENARIOS = {
    "default": (
        ["train.global_batch_size=128"],
        ["trainer", "plain", "lightning", "plain_again"],
    ),
    "accumulation_4": (["train.global_batch_size=256"], ["trainer", "plain", "plain_sync_each"]),
}
#: The ratios (numerator, denominator) of each scenario, with their intervals.
RATIOS = {
    "default": [("trainer", "plain"), ("lightning", "trainer"), ("plain_again", "plain")],
    "accumulation_4": [("trainer", "plain"), ("plain_sync_each", "plain")],
}


def load_overhead(project: Path) -> ModuleType:
    path = project / "benchmarks" / "overhead.py"
    spec = importlib.util.spec_from_file_location("overhead", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def runner(
    name: str,
    overhead: ModuleType,
    config: Any,
    env: Any,
    device: torch.device,
    run_dirs: Iterator[Path],
) -> Callable[[Any], dict[str, torch.Tensor]]:
    """The loop `name` as overhead.interleave runs it: it trains under a clock, marking the end of
    each step, and returns its final weights."""
    if name == "trainer":
        return lambda clock: overhead.run_trainer(config, env, device, next(run_dirs), clock)
    if name == "lightning":
        return lambda clock: run_lightning(config, env, clock.tick)
    sync_each = name == "plain_sync_each"
    return lambda clock: overhead.run_plain(config, env, device, clock, sync_each)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--project", type=Path, required=True)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--block-steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("overrides", nargs="*", help="section.key=value for every scenario")
    args = parser.parse_args()
    overhead = load_overhead(args.project)
    env = detect_env()
    config_file = args.project / "configs" / "default.yaml"
    results = {}
    with process_group(env, overhead.load_config(config_file, args.overrides).dist) as device:
        root = overhead.shared_temporary_dir(env)
        run_dirs = (root / f"trainer-{index}" for index in itertools.count())
        for scenario, (overrides, loops) in SCENARIOS.items():
            config = overhead.benchmark_config(
                config_file, [*args.overrides, *overrides], args.warmup_steps, args.steps
            )
            blocks, equal = overhead.interleave(
                {name: runner(name, overhead, config, env, device, run_dirs) for name in loops},
                args.rounds,
                lambda: overhead.StepClock(device, args.warmup_steps, args.steps),
                args.block_steps,
            )
            results[scenario] = {
                name: overhead.summary(loop_blocks)
                | ({"bitwise_equal_to_trainer": equal[name]} if name in equal else {})
                for name, loop_blocks in blocks.items()
            }
            results[scenario]["ratios"] = {
                f"{numerator}/{denominator}": overhead.ratios(
                    blocks, numerator, denominator, args.confidence, args.steps // args.block_steps
                )
                for numerator, denominator in RATIOS[scenario]
            }
            if env.is_main:
                print(scenario, json.dumps(results[scenario]["ratios"]), flush=True)
        if env.is_main:
            args.json.write_text(json.dumps(results, indent=2) + "\n")
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
