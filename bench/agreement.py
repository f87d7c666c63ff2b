"""What the ranks' agreement before the first step costs, on `--nproc-per-node` ranks.

Run by run.py: `torchrun --standalone --nproc-per-node=N bench/agreement.py --json FILE`. The
process group starts as training starts it (with the agreement once, which also waits for
the slowest rank to start); then, with every rank past a barrier, the agreement runs
`--repeats` more times in fresh namespaces of the same store: each time from every rank's
posting to every rank's verdict, the slowest rank's, and building this rank's identity (a
digest of every source file, the resolved config) apart.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch.distributed as dist
from ddp_project.cluster.agreement import agree_on_launch, identity
from ddp_project.cluster.distributed import (
    barrier,
    detect_env,
    gather_objects,
    process_group,
    rendezvous_store,
)
from ddp_project.config import load_config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    env = detect_env()
    config = load_config(None, ["dist.device=cpu"])
    with process_group(env, config.dist) as device:
        started = time.perf_counter()
        mine = identity(config, device)
        identity_s = time.perf_counter() - started
        times = []
        for repeat in range(args.repeats):
            barrier()
            store = dist.PrefixStore(f"bench_{repeat}", rendezvous_store())
            started = time.perf_counter()
            agree_on_launch(store, env.rank, env.world_size, mine, config.dist.timeout_s)
            times.append(time.perf_counter() - started)
        slowest = gather_objects((statistics.median(times), identity_s, len(json.dumps(mine))))
    if env.is_main:
        figures = {
            "world_size": env.world_size,
            "agreement_s": max(agreement for agreement, _, _ in slowest),
            "identity_s": max(building for _, building, _ in slowest),
            "identity_bytes": max(size for _, _, size in slowest),
        }
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
