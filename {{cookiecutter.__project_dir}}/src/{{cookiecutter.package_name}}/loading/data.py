"""Sharding data over ranks: a resumable training sampler and an exact evaluation sampler.

The task (task.py) builds the data sets; this module decides which rank sees which sample.
"""

from __future__ import annotations

import math
import os
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    Sampler,
    default_collate,
    get_worker_info,
)

from ..cluster.distributed import DistEnv
from ..config import DataConfig
from ..training.rng import generators_kept, seed_sample
from .workers import StopSafeLoader, drop_stop_signals

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
        LoaderDataset.

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


class SampleLoadError(RuntimeError):
    """The task's data set failed to give a sample: which, where, and why.

    Raised in a loader worker, it reaches the rank as the DataLoader re-raises it there: of the
    same class, its message then the worker's whole traceback, which ends with this one-line
    account (`summary`).
    """

    @property
    def summary(self) -> str:
        """The one-line account: which process, which sample of which set, and the error."""
        last = str(self).rstrip().splitlines()[-1]
        return last.split(f"{type(self).__name__}: ", 1)[-1]

    @property
    def details(self) -> str:
        """Where in the data set it failed: the traceback of the error, from the worker."""
        if self.__cause__ is not None:  # raised in this process
            return "".join(traceback.format_exception(self.__cause__)).rstrip()
        return str(self).split("Original ", 1)[-1].rstrip()


class LoaderDataset(Dataset):
    """The task's data set as the loaders read it: a failure names its sample, and each
    training sample is fetched with the random generators seeded for it when the sampler gives
    (index, seed) pairs (ResumableDistributedSampler's `sample_seeds`).

    Python's, NumPy's and torch's generators are seeded (rng.seed_sample). Random augmentation
    then depends on (run seed, epoch, sample) alone: it differs between samples, epochs and so
    ranks, it is the same whatever the number of loader workers (none included) and of ranks,
    and a run resumed mid-epoch draws exactly what the unbroken run drew. Without it every
    rank's workers start from the same seed, and a resumed run's fresh workers repeat what the
    old ones drew first. In the training process (no workers) the rank's own generators are
    put back after each batch: dropout goes on drawing from them.
    """

    def __init__(self, dataset: Dataset, name: str) -> None:
        self.dataset = dataset
        #: What the task calls it in a failure's message: "training set", "evaluation set".
        self.name = name

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: int | tuple[int, int]) -> Any:
        return self._fetch([item])[0]

    def __getitems__(self, items: list[Any]) -> list[Any]:
        """A batch's samples: the DataLoader fetches them together (through the data set's own
        `__getitems__` where it has one and nothing is seeded)."""
        seeded = bool(items) and isinstance(items[0], tuple)
        if seeded and get_worker_info() is None:
            with generators_kept():
                return self._fetch(items)
        fetch = getattr(self.dataset, "__getitems__", None)
        if seeded or fetch is None:
            return self._fetch(items)
        try:
            return fetch(items)
        except Exception as error:
            raise SampleLoadError(self._failure(items, error)) from error

    def _fetch(self, items: list[Any]) -> list[Any]:
        """Each item's sample, seeded first where the items are (index, seed) pairs; one `try`
        for the batch, which costs nothing until a sample fails."""
        dataset, samples, index = self.dataset, [], None
        append = samples.append
        try:
            if items and isinstance(items[0], tuple):
                for index, seed in items:
                    seed_sample(seed)
                    append(dataset[index])
            else:
                for index in items:
                    append(dataset[index])
        except Exception as error:
            raise SampleLoadError(self._failure(index, error)) from error
        return samples

    def _failure(self, index: int | list[int] | None, error: Exception) -> str:
        worker = get_worker_info()
        where = "the training process" if worker is None else f"loader worker {worker.id}"
        what = f"sample {index}" if isinstance(index, int) else f"one of samples {index}"
        first_line = str(error).splitlines()[0] if str(error) else ""
        return (
            f"{where} (pid {os.getpid()}) could not load {what} of the {self.name}: "
            f"{type(error).__name__}: {first_line}"
        )


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
    sample_seeds: bool | None = None,
) -> tuple[DataLoader, ResumableDistributedSampler]:
    """Full micro-batches only (drop_last): every optimizer step sees exactly the global batch.

    `workers`: loader processes (default: data.num_workers, with `auto` as for one rank per
    host). `sample_seeds`: each sample is fetched with its own seed (LoaderDataset);
    needed with worker processes, and the default there. Without (0 workers only), the rank's
    own generators, saved in checkpoints, serve.
    """
    workers = loader_workers(config, 1) if workers is None else workers
    sample_seeds = workers > 0 if sample_seeds is None else sample_seeds
    sampler = ResumableDistributedSampler(dataset, env, seed, sample_seeds)
    loader = StopSafeLoader(
        LoaderDataset(dataset, "training set"),
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
    return StopSafeLoader(
        LoaderDataset(dataset, "evaluation set"),
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
        "worker_init_fn": drop_stop_signals if workers > 0 else None,
        # Without its own generator, every iter(loader) draws from the global torch RNG, so a
        # run resumed mid-epoch (one extra iter) would get different dropout masks afterwards.
        # Seeded per rank: it also seeds the workers, which must differ between ranks.
        "generator": torch.Generator().manual_seed(seed),
    }
