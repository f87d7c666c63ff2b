"""Sharding data over ranks: a resumable training sampler and an exact evaluation sampler.

The task (task.py) builds the data sets; this module decides which rank sees which sample.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, default_collate

from ..cluster.distributed import DistEnv
from ..config import DataConfig
from ..training.rng import seed_all

#: The most loader workers per rank that data.num_workers=auto starts.
MAX_AUTO_WORKERS = 8


def affinity_cores() -> int:
    """The cores this process may run on by its CPU affinity (Slurm's binding, taskset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, within a container's CPU limit
    (the cgroup's quota), at least 1."""
    cores = affinity_cores()
    quota = _cgroup_cpu_limit()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def _cgroup_cpu_limit() -> float | None:
    """CPUs a container may use (cgroup v2 cpu.max, or v1 cfs quota); None when unlimited."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        root = Path("/sys/fs/cgroup/cpu")
        quota_us = int((root / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def loader_workers(config: DataConfig, ranks_on_host: int, cores: int | None = None) -> int:
    """Loader processes per rank: data.num_workers, or for `auto` the cores each rank of this
    host has beside its own process, at most MAX_AUTO_WORKERS (0 when it has none to spare:
    workers would only take turns with the training on the same cores)."""
    if config.num_workers != "auto":
        return config.num_workers
    cores = usable_cores() if cores is None else cores
    return max(0, min(MAX_AUTO_WORKERS, cores // max(1, ranks_on_host) - 1))


class ResumableDistributedSampler(DistributedSampler):
    """A DistributedSampler that can start part-way through an epoch.

    The permutation depends only on (seed, epoch), and the tail is dropped so every rank gets the
    same number of samples. Optimizer step s of an epoch therefore always uses the same global set
    of samples, whatever the world size, and resuming at step s means skipping s * (samples per
    rank per step) samples of this rank's shard.
    """

    def __init__(
        self, dataset: Dataset, env: DistEnv, seed: int, sample_seeds: bool = False
    ) -> None:
        super().__init__(
            dataset,
            num_replicas=env.world_size,
            rank=env.rank,
            shuffle=True,
            seed=seed,
            drop_last=True,
        )
        self.start_index = 0
        self.sample_seeds = sample_seeds

    def set_epoch(self, epoch: int, start_index: int = 0) -> None:
        """Select the epoch's permutation (call every epoch) and where in the shard to begin."""
        if not 0 <= start_index <= self.num_samples:
            raise ValueError(
                f"start_index {start_index} outside this rank's shard of {self.num_samples}"
            )
        super().set_epoch(epoch)
        self.start_index = start_index

    def __iter__(self) -> Iterator[Any]:
        """This rank's indices from `start_index` on; with `sample_seeds`, (index, seed) pairs for
        SampleSeededDataset.

        The order is DistributedSampler's (the same permutation of the same generator), held
        as an array of this rank's share and read one index at a time: a Python list of every
        index (or a tensor's iterator, which makes a tensor of each at once) would take tens
        to hundreds of bytes a sample, 8 here, which matters for millions of windows.
        """
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.dataset), generator=generator)
        mine = order[self.rank : self.total_size : self.num_replicas][self.start_index :]
        mine = mine.numpy().copy()  # the copy frees the rest of the permutation
        del order
        if not self.sample_seeds:
            return (int(index) for index in mine)
        epoch_seed = (self.seed * 1_000_003 + self.epoch) * 1_000_033
        return ((int(index), (epoch_seed + int(index)) % 2**63) for index in mine)

    def __len__(self) -> int:
        return self.num_samples - self.start_index


class SampleSeededDataset(Dataset):
    """Seeds the random generators of a DataLoader worker before each sample it fetches.

    Python's, NumPy's and torch's global generators are seeded (rng.py).
    Random augmentation in a worker then depends on (run seed, epoch, sample) alone: it differs
    between samples, epochs and so ranks, and a run resumed mid-epoch draws exactly what the
    unbroken run drew, whatever the number of workers. Without it every rank's workers start
    from the same seed, and a resumed run's fresh workers repeat what the old ones drew first.
    """

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: tuple[int, int]) -> Any:
        index, seed = item
        seed_all(seed)
        return self.dataset[index]


class EvalShardSampler(Sampler[int]):
    """Rank r evaluates samples r, r + world, r + 2 * world, ...: no padding, no duplicates.

    Shards may differ in length by one; evaluation reduces sums and counts once at the end, so
    uneven shards are exact where DistributedSampler's padding would count samples twice.
    """

    def __init__(self, dataset_size: int, env: DistEnv) -> None:
        self.indices = range(env.rank, dataset_size, env.world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def build_train_loader(
    dataset: Dataset,
    env: DistEnv,
    config: DataConfig,
    micro_batch_size: int,
    seed: int,
    device: torch.device,
    collate: Callable[[list[Any]], Any] = default_collate,
    workers: int | None = None,
) -> tuple[DataLoader, ResumableDistributedSampler]:
    """Full micro-batches only (drop_last): every optimizer step sees exactly the global batch.

    `workers`: loader processes (default: data.num_workers, with `auto` as for one rank per
    host). With worker processes, each sample is fetched with its own seed
    (SampleSeededDataset); in the main process (0 workers) the rank's own generators, saved in
    checkpoints, serve.
    """
    workers = loader_workers(config, 1) if workers is None else workers
    sampler = ResumableDistributedSampler(dataset, env, seed, sample_seeds=workers > 0)
    loader = DataLoader(
        SampleSeededDataset(dataset) if workers > 0 else dataset,
        batch_size=micro_batch_size,
        sampler=sampler,
        drop_last=True,
        collate_fn=collate,
        **_loader_options(config, workers, device, seed + env.rank),
    )
    return loader, sampler


def build_eval_loader(
    dataset: Dataset,
    env: DistEnv,
    config: DataConfig,
    batch_size: int,
    seed: int,
    device: torch.device,
    collate: Callable[[list[Any]], Any] = default_collate,
    workers: int | None = None,
) -> DataLoader:
    """Every evaluation sample exactly once across all ranks."""
    sampler = EvalShardSampler(len(dataset), env)
    workers = loader_workers(config, 1) if workers is None else workers
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=collate,
        **_loader_options(config, workers, device, seed + env.rank),
    )


def _loader_options(config: DataConfig, workers: int, device: torch.device, seed: int) -> dict:
    return {
        "num_workers": workers,
        "pin_memory": config.pin_memory and device.type == "cuda",
        "persistent_workers": config.persistent_workers and workers > 0,
        "prefetch_factor": config.prefetch_factor if workers > 0 else None,
        # Without its own generator, every iter(loader) draws from the global torch RNG, so a
        # run resumed mid-epoch (one extra iter) would get different dropout masks afterwards.
        # Seeded per rank: it also seeds the workers, which must differ between ranks.
        "generator": torch.Generator().manual_seed(seed),
    }
