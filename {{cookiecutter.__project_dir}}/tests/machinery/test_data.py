"""Sharding: which rank sees which sample, in training and in evaluation."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler, TensorDataset

from {{ cookiecutter.package_name }}.cluster.distributed import DistEnv
from {{ cookiecutter.package_name }}.config import DataConfig
from {{ cookiecutter.package_name }}.loading.data import (
    MAX_AUTO_WORKERS,
    EvalShardSampler,
    ResumableDistributedSampler,
    SampleLoadError,
    build_train_loader,
    loader_workers,
    usable_cores,
)

WORLD = 2


def _dataset(size: int) -> TensorDataset:
    return TensorDataset(torch.arange(size))


def _shards(size: int, epoch: int, seed: int = 0) -> list[list[int]]:
    shards = []
    for rank in range(WORLD):
        env = DistEnv(rank=rank, world_size=WORLD)
        sampler = ResumableDistributedSampler(_dataset(size), env, seed)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    return shards


def test_train_shards_are_disjoint_equal_and_cover_the_data() -> None:
    """Two ranks get the same number of distinct samples; only the uneven tail is dropped."""
    shards = _shards(size=101, epoch=0)
    assert len(shards[0]) == len(shards[1]) == 50
    assert not set(shards[0]) & set(shards[1])
    assert len(set(shards[0]) | set(shards[1])) == 100


def test_train_order_changes_between_epochs() -> None:
    """set_epoch reshuffles: the same rank sees a different order (and set) next epoch."""
    assert _shards(size=100, epoch=0) != _shards(size=100, epoch=1)


@pytest.mark.parametrize("world_size", [1, 3])
def test_the_order_is_that_of_torch_s_distributed_sampler(world_size: int) -> None:
    """Checkpoints of earlier releases resume at the same sample: the order never changed."""
    data = _dataset(103)
    for rank in range(world_size):
        ours = ResumableDistributedSampler(data, DistEnv(rank=rank, world_size=world_size), 7)
        torch_s = DistributedSampler(data, world_size, rank, shuffle=True, seed=7, drop_last=True)
        ours.set_epoch(2)
        torch_s.set_epoch(2)
        assert list(ours) == list(torch_s)


def test_start_index_resumes_inside_the_epoch() -> None:
    """Starting at k yields exactly the rest of the shard that a full pass would yield."""
    sampler = ResumableDistributedSampler(_dataset(100), DistEnv(rank=1, world_size=WORLD), seed=0)
    sampler.set_epoch(3)
    full = list(sampler)
    sampler.set_epoch(3, start_index=20)
    assert list(sampler) == full[20:]
    assert len(sampler) == len(full) - 20


def test_global_batches_do_not_depend_on_world_size() -> None:
    """Step s uses the same samples with 1 or 2 ranks, so a run can move between world sizes."""
    size, global_batch = 96, 16
    one = ResumableDistributedSampler(_dataset(size), DistEnv(), seed=5)
    one.set_epoch(2)
    single = list(one)
    shards = _shards(size, epoch=2, seed=5)
    per_rank = global_batch // WORLD
    for step in range(size // global_batch):
        together = set()
        for shard in shards:
            together |= set(shard[step * per_rank : (step + 1) * per_rank])
        assert together == set(single[step * global_batch : (step + 1) * global_batch])


def test_eval_shards_count_every_sample_exactly_once() -> None:
    """Evaluation never pads: 101 samples over 2 ranks are 51 + 50, no duplicates."""
    shards = [list(EvalShardSampler(101, DistEnv(rank=r, world_size=WORLD))) for r in range(WORLD)]
    assert sorted(shards[0] + shards[1]) == list(range(101))


class RandomCrops(Dataset):
    """Augmentation stand-in: each fetch draws a random number, as a random crop would."""

    def __init__(self, draw: str = "torch") -> None:
        self.draw = draw

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.draw == "numpy":
            import numpy  # the test that draws with NumPy skips where it is not installed

            return torch.tensor(numpy.random.rand())
        return torch.rand(())


def _drawn(
    rank: int,
    world_size: int,
    epoch: int = 0,
    start_index: int = 0,
    draw: str = "torch",
    workers: int = 2,
) -> list[float]:
    """What a rank's loader draws for each sample of its shard, in order, its samples seeded
    one by one (in `workers` processes, or in this one)."""
    loader, sampler = build_train_loader(
        RandomCrops(draw),
        DistEnv(rank=rank, world_size=world_size),
        DataConfig(num_workers=workers, pin_memory=False),
        micro_batch_size=4,
        seed=7,
        device=torch.device("cpu"),
        sample_seeds=True,
    )
    sampler.set_epoch(epoch, start_index=start_index)
    return torch.cat(list(loader)).tolist()


@pytest.mark.timeout(120)
def test_dataloader_workers_draw_different_random_numbers_on_every_rank() -> None:
    rank_0, rank_1 = _drawn(0, WORLD), _drawn(1, WORLD)
    assert len(set(rank_0) | set(rank_1)) == len(rank_0) + len(rank_1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("draw", ["torch", "numpy"])
def test_dataloader_workers_draw_the_same_numbers_after_a_resume_mid_epoch(draw: str) -> None:
    """Fresh workers starting at sample 12 of the shard draw what the unbroken epoch drew."""
    if draw == "numpy":
        pytest.importorskip("numpy", reason="NumPy is seeded only where the data code uses it")
    unbroken = _drawn(0, WORLD, epoch=1, draw=draw)
    assert _drawn(0, WORLD, epoch=1, start_index=12, draw=draw) == unbroken[12:]
    assert _drawn(0, WORLD, epoch=2, draw=draw) != unbroken


@pytest.mark.timeout(120)
@pytest.mark.parametrize("draw", ["torch", "numpy"])
def test_the_draws_do_not_depend_on_the_number_of_workers_none_included(draw: str) -> None:
    """Hosts with other core counts (another `auto` worker count) draw alike, and a run resumed
    with other workers draws what the unbroken one would."""
    if draw == "numpy":
        pytest.importorskip("numpy", reason="NumPy is seeded only where the data code uses it")
    with_two = _drawn(1, WORLD, epoch=1, draw=draw)
    assert _drawn(1, WORLD, epoch=1, draw=draw, workers=1) == with_two
    assert _drawn(1, WORLD, epoch=1, draw=draw, workers=0) == with_two


def test_seeding_samples_in_the_training_process_leaves_its_own_streams_as_they_were() -> None:
    """Dropout goes on drawing from the rank's streams, whatever the data drew meanwhile."""
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    _drawn(0, WORLD, workers=0)
    assert torch.equal(torch.rand(4), expected)


class Corrupt(Dataset):
    """Sample 5 cannot be read, as a corrupt record would."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == 5:
            raise ValueError("truncated record at byte 1234\nmore detail")
        return torch.tensor(index)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_sample_that_fails_is_named_with_its_set_and_the_process_that_read_it(
    workers: int,
) -> None:
    config = DataConfig(num_workers=workers, pin_memory=False)
    loader, _ = build_train_loader(Corrupt(), DistEnv(), config, 4, 0, torch.device("cpu"))
    with pytest.raises(SampleLoadError) as raised:
        list(loader)
    # Without its traceback, which holds the loader's iterator, the workers end now: in a later
    # garbage collection their queues close first, and each would take 5 s to give up.
    error = raised.value.with_traceback(None)
    del raised
    where = "the training process" if workers == 0 else "loader worker "
    assert error.summary.startswith(where)
    assert error.summary.endswith(
        "could not load sample 5 of the training set: ValueError: truncated record at byte 1234"
    )
    assert 'raise ValueError("truncated record' in error.details


@pytest.mark.parametrize(
    ("cores", "ranks", "workers"),
    [(16, 4, 3), (64, 8, 7), (256, 4, MAX_AUTO_WORKERS), (2, 2, 0), (1, 1, 0)],
)
def test_auto_workers_follow_the_cores_each_rank_has_to_spare(
    cores: int, ranks: int, workers: int
) -> None:
    assert loader_workers(DataConfig(num_workers="auto"), ranks, cores) == workers


def test_a_number_of_workers_is_taken_as_given() -> None:
    assert loader_workers(DataConfig(num_workers=5), ranks_on_host=8, cores=2) == 5


def test_this_process_may_use_at_least_one_core() -> None:
    assert 1 <= usable_cores() <= (os.cpu_count() or 1)


def test_auto_workers_keep_prefetching_and_persistent_workers_in_effect() -> None:
    config = DataConfig()  # num_workers=auto
    workers = loader_workers(config, ranks_on_host=2, cores=6)
    loader, _ = build_train_loader(
        _dataset(64), DistEnv(), config, 4, seed=0, device=torch.device("cpu"), workers=workers
    )
    assert (loader.num_workers, loader.persistent_workers, loader.prefetch_factor) == (2, True, 2)
