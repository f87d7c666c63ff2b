"""The cost of a (loss_sum, count) training loss against a mean, on the gpt example.

Run by run.py in a render of the `gpt` example: `torchrun --nproc-per-node=2 bench/loss_forms.py
--project DIR --json FILE [section.key=value ...]`. The example's Task returns the mean over
the tokens of a micro-batch; `SummedTokens` returns the same loss as a sum and the number of
tokens, which the Trainer then normalises over the global batch (one more all-reduce of a
scalar per step, and a multiplication of the gradients). The two take turns step by step in
one launch, `--rounds` times (benchmarks/overhead.py's turns, blocks and intervals).
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from ddp_project.cluster.distributed import detect_env, process_group
from ddp_project.task import Task
from side_by_side import load_overhead
from torch.nn import functional as F


class SummedTokens(Task):
    """The gpt example with its loss returned as (sum over the tokens, number of tokens)."""

    def training_loss(
        self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = batch
        logits = model(inputs).flatten(0, 1)
        loss_sum = F.cross_entropy(logits, targets.flatten(), reduction="sum")
        return loss_sum, torch.tensor(targets.numel(), device=targets.device)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--project", type=Path, required=True)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--block-steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    args = parser.parse_args()
    overhead = load_overhead(args.project)
    env = detect_env()
    config_file = args.project / "configs" / "default.yaml"
    config = overhead.benchmark_config(config_file, args.overrides, args.warmup_steps, args.steps)
    with process_group(env, config.dist) as device:
        root = overhead.shared_temporary_dir(env)
        run_dirs = (root / f"run-{index}" for index in itertools.count())

        def runner(task_class: type[Task]) -> Callable[[Any], dict[str, torch.Tensor]]:
            return lambda clock: overhead.run_trainer(
                config, env, device, next(run_dirs), clock, task_class(config.task, config.run.seed)
            )

        blocks, _ = overhead.interleave(
            {"mean": runner(Task), "sum_count": runner(SummedTokens)},
            args.rounds,
            lambda: overhead.StepClock(device, args.warmup_steps, args.steps),
            args.block_steps,
        )
        results = {name: overhead.summary(loop_blocks) for name, loop_blocks in blocks.items()}
        results["ratios"] = {
            "sum_count/mean": overhead.ratios(
                blocks, "sum_count", "mean", args.confidence, args.steps // args.block_steps
            )
        }
        if env.is_main:
            args.json.write_text(json.dumps(results, indent=2) + "\n")
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
