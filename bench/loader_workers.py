"""How loader workers are started: what each way costs at the start of an epoch and per epoch.

`python bench/loader_workers.py PROJECT` (a rendered project, e.g. build/bench/ddp-project)
reads the default task's training set with 2 workers, micro-batch 32, the way the project's
loader does (LoaderDataset, per-sample seeds), started by:

- fork, as the project does (StopSafeLoader: stop signals blocked while the workers start,
  dropped by a thread of each worker);
- fork, a plain DataLoader (what the project did before: the baseline of the mechanism);
- forkserver, its server importing torch and the package first (a fresh process per worker
  that inherits nothing of the rank's: no file descriptor, no thread, no signal handler);
- spawn (a fresh interpreter per worker, importing torch).

For each: the time from `iter(loader)` to the first batch (workers started per epoch pay it
every epoch, persistent ones once), and a whole epoch with persistent workers after the first.
Medians of ROUNDS, printed as a table. docs/design.md gives the choice and these figures.
"""

from __future__ import annotations

import multiprocessing
import statistics
import sys
import time
from pathlib import Path

ROUNDS = 5
WORKERS = 2
BATCH = 32


def main() -> None:
    project = Path(sys.argv[1]).resolve()
    sys.path.insert(0, str(project / "src"))
    package = next(path.parent.name for path in (project / "src").glob("*/task.py"))
    task_module = __import__(f"{package}.task", fromlist=["Task"])
    data = __import__(f"{package}.loading.data", fromlist=["LoaderDataset"])
    workers = __import__(f"{package}.loading.workers", fromlist=["StopSafeLoader"])
    config = __import__(f"{package}.config", fromlist=["load_config"]).load_config(None, [])
    train_set, _ = task_module.Task(config.task, seed=0).build_datasets()
    sampler_class = data.ResumableDistributedSampler
    env = __import__(f"{package}.cluster.distributed", fromlist=["DistEnv"]).DistEnv()

    import torch
    from torch.utils.data import DataLoader

    multiprocessing.set_forkserver_preload(["torch", f"{package}.loading.data"])
    ways = {
        "fork, StopSafeLoader (the project)": (workers.StopSafeLoader, "fork", True),
        "fork, plain DataLoader": (DataLoader, "fork", False),
        "forkserver (torch preloaded)": (DataLoader, "forkserver", False),
        "spawn": (DataLoader, "spawn", False),
    }
    print(f"torch {torch.__version__}, {WORKERS} workers, micro-batch {BATCH}, {ROUNDS} rounds")
    print("| workers started by | iter() to first batch | epoch, persistent workers |")
    print("| --- | --- | --- |")
    for label, (loader_class, method, ours) in ways.items():
        starts, epochs = [], []
        for _ in range(ROUNDS):
            sampler = sampler_class(train_set, env, seed=0, sample_seeds=True)
            loader = loader_class(
                data.LoaderDataset(train_set, "training set"),
                batch_size=BATCH,
                sampler=sampler,
                drop_last=True,
                num_workers=WORKERS,
                persistent_workers=True,
                multiprocessing_context=method,
                worker_init_fn=workers.drop_stop_signals if ours else None,
            )
            started = time.perf_counter()
            batches = iter(loader)
            next(batches)
            starts.append(time.perf_counter() - started)
            for _ in batches:
                pass
            started = time.perf_counter()
            for _ in loader:
                pass
            epochs.append(time.perf_counter() - started)
            del batches, loader
        print(
            f"| {label} | {statistics.median(starts) * 1e3:.0f} ms | "
            f"{statistics.median(epochs) * 1e3:.0f} ms |"
        )


if __name__ == "__main__":
    main()
