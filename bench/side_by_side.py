"""Training loops timed side by side in one torchrun launch, interleaved run by run.

Run by run.py: `torchrun --nproc-per-node=2 bench/side_by_side.py --project DIR --json FILE
[section.key=value ...]`.
The loops come from the rendered project's benchmarks/overhead.py (its Trainer, its plain
loop with and without `no_sync`) and from lightning_loop.py. Two scenarios, each a list of loops
run in turn, `--repeats` times:

- the default batch: global 128 = 2 ranks x micro-batch 32 x 2 accumulation steps: the project's
  Trainer, the plain loop, Lightning and the plain loop again (two runs of the same loop: how
  much the figures differ by chance on this machine);
- accumulation K=4 (global 256): the Trainer and the plain loop, both with `no_sync`, and the
  plain loop with an all-reduce after every micro-batch.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch
from ddp_project.cluster.distributed import all_ranks_agree, detect_env, process_group
from lightning_loop import run_lightning

SCENARIOS = {
    "default": (
        ["train.global_batch_size=128"],
        ["trainer", "plain", "lightning", "plain_again"],
    ),
    "accumulation_4": (["train.global_batch_size=256"], ["trainer", "plain", "plain_sync_each"]),
}


def load_overhead(project: Path) -> ModuleType:
    path = project / "benchmarks" / "overhead.py"
    spec = importlib.util.spec_from_file_location("overhead", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--project", type=Path, required=True)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="section.key=value for every scenario")
    args = parser.parse_args()
    overhead = load_overhead(args.project)
    env = detect_env()
    config_file = args.project / "configs" / "default.yaml"
    results = {}
    with process_group(env, overhead.load_config(config_file, args.overrides).dist) as device:
        root = overhead.shared_temporary_dir(env)
        for scenario, (overrides, loops) in SCENARIOS.items():
            config = overhead.benchmark_config(
                config_file, [*args.overrides, *overrides], args.warmup_steps, args.steps
            )
            runs = {name: [] for name in loops}
            equal = {name: True for name in loops if name != "trainer"}
            for repeat in range(args.repeats):
                weights = {}
                for name in loops:
                    clock = overhead.StepClock(device, args.warmup_steps, args.steps)
                    if name == "trainer":
                        run_dir = root / f"{scenario}-{repeat}"
                        weights[name] = overhead.run_trainer(config, env, device, run_dir, clock)
                    elif name == "lightning":
                        weights[name] = run_lightning(config, env, clock.tick)
                    else:
                        sync_each = name == "plain_sync_each"
                        weights[name] = overhead.run_plain(config, env, device, clock, sync_each)
                    runs[name].append(overhead.slowest(clock.figures()))
                    gc.collect()
                trainer = weights["trainer"]
                for name in equal:
                    same = all(torch.equal(trainer[key], weights[name][key]) for key in trainer)
                    equal[name] &= all_ranks_agree(same)
            results[scenario] = {
                name: overhead.summary(figures)
                | ({"bitwise_equal_to_trainer": equal[name]} if name in equal else {})
                for name, figures in runs.items()
            }
            if env.is_main:
                print(scenario, json.dumps(results[scenario]), flush=True)
        if env.is_main:
            args.json.write_text(json.dumps(results, indent=2) + "\n")
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
