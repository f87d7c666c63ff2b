"""A loss over tokens trains the same on any world size and accumulation (float64, gloo).

Micro-batches of padded sequences hold different numbers of real tokens. With `(loss_sum,
count)` from training_loss, the step's gradient is that of the sum over every real token of the
global batch divided by their total count: 1, 2 and 4 ranks, with and without accumulation,
end within 1e-10 of each other. A mean per micro-batch weighs a micro-batch of few tokens like
one of many, so the same global batch trains differently on other splits: the control below.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }}.config import load_config

from ..helpers import FAST, env_for, make_trainer, spawn, train_steps
from ..tasks import TokenTask

pytestmark = [pytest.mark.distributed, pytest.mark.own_tasks, pytest.mark.timeout(300)]

GLOBAL_BATCH = 16
STEPS = 3


def _train(rank: int, world_size: int, run_dir: Path, micro_batch: int, mean: bool) -> dict:
    config = load_config(
        None,
        [
            *FAST,
            f"run.dir={run_dir}",
            "train.mixed_precision=none",
            f"train.global_batch_size={GLOBAL_BATCH}",
            f"train.micro_batch_size={micro_batch}",
        ],
    )
    task = TokenTask(config.task, config.run.seed, dtype=torch.float64, mean_loss=mean)
    return train_steps(make_trainer(config, env_for(rank, world_size), task), STEPS)


def _splits(rank: int, world_size: int, workdir: Path) -> dict[str, dict]:
    """Summed losses without and with accumulation, and the per-micro-batch mean."""
    per_rank = GLOBAL_BATCH // world_size
    return {
        "whole": _train(rank, world_size, workdir / "whole", per_rank, mean=False),
        "accumulated": _train(rank, world_size, workdir / "accumulated", 2, mean=False),
        "mean": _train(rank, world_size, workdir / "mean", per_rank, mean=True),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, dict]]:
    """Rank 0's final weights for 1, 2 and 4 ranks."""
    workdir = tmp_path_factory.mktemp("tokens")
    found = {1: _splits(0, 1, workdir / "1")}
    for world_size in (2, 4):
        found[world_size] = spawn(
            world_size, _splits, workdir / str(world_size), workdir=workdir / f"store{world_size}"
        )[0]
    return found


def _max_difference(left: dict, right: dict) -> float:
    return max(float((left[name] - right[name]).abs().max()) for name in left)


@pytest.mark.parametrize(
    ("world_size", "split"),
    [(1, "accumulated"), (2, "whole"), (2, "accumulated"), (4, "whole"), (4, "accumulated")],
)
def test_summed_token_losses_train_alike_on_any_split_of_the_global_batch(
    runs: dict, world_size: int, split: str
) -> None:
    """Against 1 rank with the whole global batch in one micro-batch."""
    assert _max_difference(runs[world_size][split], runs[1]["whole"]) < 1e-10


def test_a_mean_per_micro_batch_trains_differently_on_two_ranks(runs: dict) -> None:
    """The control: what the (sum, count) form corrects is a real difference."""
    assert _max_difference(runs[2]["mean"], runs[1]["mean"]) > 1e-6
