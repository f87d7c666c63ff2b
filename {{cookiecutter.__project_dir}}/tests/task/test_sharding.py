"""What each rank sees during training and evaluation, observed through the real trainer."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.utils.data import Dataset

from {{ cookiecutter.package_name }}.config import load_config
from {{ cookiecutter.package_name }}.task import Task

from ..helpers import (
    FAST,
    env_for,
    float64,
    make_trainer,
    micro_batch_size,
    spawn,
    with_samples,
)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

NUM_SAMPLES = 64
STEPS_PER_EPOCH = 4  # 64 samples / global batch 16


class Recording(Dataset):
    """A data set that notes the index of every sample fetched from it, in order."""

    def __init__(self, base: Dataset, seen: list[int]) -> None:
        self.base, self.seen = base, seen

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> object:
        self.seen.append(index)
        return self.base[index]


class RecordingTask(with_samples(Task, train=NUM_SAMPLES)):
    """The project's task on NUM_SAMPLES training samples, noting the index of each sample that
    training fetches (in this process: data.num_workers=0)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[int] = []

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        train, evaluation = super().build_datasets()
        return Recording(train, self.seen), evaluation


def _indices_per_epoch(rank: int, world_size: int, run_dir: Path) -> list[list[int]]:
    config = load_config(
        None,
        [
            *FAST,
            f"run.dir={run_dir}",
            "train.global_batch_size=16",
            micro_batch_size(4, 16),
            "train.epochs=2",
            "data.num_workers=0",
        ],
    )
    task = RecordingTask(config.task, seed=config.run.seed)
    make_trainer(config, env_for(rank, world_size), task).fit()
    seen = task.seen
    per_epoch = len(seen) // 2
    return [seen[:per_epoch], seen[per_epoch:]]


@pytest.fixture(scope="module")
def epochs(tmp_path_factory: pytest.TempPathFactory) -> list[list[list[int]]]:
    """[rank][epoch] -> sample indices, in the order that rank trained on them."""
    workdir = tmp_path_factory.mktemp("sharding")
    return spawn(2, _indices_per_epoch, workdir / "run", workdir=workdir)


@pytest.mark.parametrize("epoch", [0, 1])
def test_shards_are_disjoint_and_cover_the_data(epochs: list, epoch: int) -> None:
    rank0, rank1 = epochs[0][epoch], epochs[1][epoch]
    assert not set(rank0) & set(rank1)
    assert sorted(rank0 + rank1) == list(range(NUM_SAMPLES))


def test_every_rank_takes_the_same_number_of_steps(epochs: list) -> None:
    assert [len(epoch) for epoch in epochs[0]] == [len(epoch) for epoch in epochs[1]]


def test_order_changes_between_epochs(epochs: list) -> None:
    """The trainer calls set_epoch: without it, every epoch would repeat the same order."""
    for rank_epochs in epochs:
        assert rank_epochs[0] != rank_epochs[1]


#: The project's task in float64, on 101 evaluation samples: 2 ranks cannot share them evenly.
Float64OddEvaluation = float64(with_samples(Task, evaluation=101))


def _evaluate(rank: int, world_size: int, run_dir: Path) -> dict[str, float]:
    config = load_config(None, [*FAST, f"run.dir={run_dir}"])
    task = Float64OddEvaluation(config.task, seed=config.run.seed)
    return make_trainer(config, env_for(rank, world_size), task).evaluate()


def test_evaluation_on_two_ranks_equals_one_rank(tmp_path: Path) -> None:
    """101 samples over 2 ranks: no padded duplicates, so the metrics match a single process."""
    two_ranks = spawn(2, _evaluate, tmp_path / "run2", workdir=tmp_path)
    single = _evaluate(0, 1, tmp_path / "run1")
    assert two_ranks[0] == two_ranks[1]
    assert two_ranks[0] and two_ranks[0].keys() == single.keys()
    for name, value in single.items():
        assert two_ranks[0][name] == pytest.approx(value, rel=1e-12, abs=0), name
