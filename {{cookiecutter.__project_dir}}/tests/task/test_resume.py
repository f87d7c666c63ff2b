"""Resume is bitwise exact: a run that crashes and restarts ends where an unbroken run ends."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }}.cluster.distributed import DistEnv
from {{ cookiecutter.package_name }}.config import Config, load_config
from {{ cookiecutter.package_name }}.monitoring.metrics import read_metrics
from {{ cookiecutter.package_name }}.task import Task
from {{ cookiecutter.package_name }}.training.trainer import Trainer

from ..helpers import (
    FAST,
    env_for,
    float64,
    make_trainer,
    micro_batch_size,
    optimizer_states,
    spawn,
    with_random_draws,
    with_samples,
)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

TOTAL_STEPS = 16
CHECKPOINT_EVERY = 7  # step 7 is inside the first epoch (10 steps per epoch)
CRASH_AT_STEP = 10  # steps 8 and 9 are trained and logged, then lost
#: 320 training samples: 10 steps of 32 per epoch, so the runs cross into the second epoch.
TenStepsPerEpoch = with_samples(Task, train=320)


def _config(run_dir: Path) -> list[str]:
    # 2 ranks x micro-batch 8 x 2 accumulation steps (a whole-batch loss: 16 x 1), in training
    # mode: the task's dropout, if it has any, makes the random state matter.
    return [
        *FAST,
        f"run.dir={run_dir}",
        "train.global_batch_size=32",
        micro_batch_size(8, 32),
        f"train.max_steps={TOTAL_STEPS}",
        f"checkpoint.every_steps={CHECKPOINT_EVERY}",
        "checkpoint.keep_last=10",
    ]


class Crash(RuntimeError):
    pass


def _trainer(config: Config, env: DistEnv, task_class: type[Task] = TenStepsPerEpoch) -> Trainer:
    return make_trainer(config, env, task_class(config.task, seed=config.run.seed))


def _straight_and_interrupted(rank: int, world_size: int, workdir: Path) -> dict:
    env = env_for(rank, world_size)
    straight = _trainer(load_config(None, _config(workdir / "straight")), env)
    straight.fit()

    interrupted_config = load_config(None, _config(workdir / "interrupted"))
    first = _trainer(interrupted_config, env)
    train_step = first.train_step

    def crash_at_step(batches: object) -> tuple:
        if first.step + 1 == CRASH_AT_STEP:
            raise Crash
        return train_step(batches)

    first.train_step = crash_at_step
    with pytest.raises(Crash):
        first.fit()

    resumed = _trainer(interrupted_config, env)
    assert resumed.resume()
    resumed_at = resumed.step
    resumed.fit()
    return {
        "resumed_at": resumed_at,
        "straight": (straight.model.state_dict(), optimizer_states(straight)),
        "resumed": (resumed.model.state_dict(), optimizer_states(resumed)),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    workdir = tmp_path_factory.mktemp("resume")
    return workdir, spawn(2, _straight_and_interrupted, workdir, workdir=workdir)


def test_resume_starts_from_the_last_complete_checkpoint(runs: tuple) -> None:
    _, results = runs
    assert [result["resumed_at"] for result in results] == [CHECKPOINT_EVERY] * 2


def test_weights_are_bitwise_equal_to_an_unbroken_run(runs: tuple) -> None:
    _, results = runs
    for result in results:
        straight, resumed = result["straight"][0], result["resumed"][0]
        for name, tensor in straight.items():
            assert torch.equal(tensor, resumed[name]), name


def test_optimizer_state_is_bitwise_equal_to_an_unbroken_run(runs: tuple) -> None:
    _, results = runs
    for result in results:
        for update, saved in result["straight"][1].items():
            straight, resumed = saved["state"], result["resumed"][1][update]["state"]
            assert straight.keys() == resumed.keys()
            for index, state in straight.items():
                for key, value in state.items():
                    assert torch.equal(value, resumed[index][key]), (update, index, key)


def test_logged_losses_and_metrics_equal_an_unbroken_run(runs: tuple) -> None:
    """Same values at the same steps; the records of the lost steps 8-9 are not duplicated."""
    workdir, _ = runs

    def exact_fields(run: str) -> list[dict]:
        return [{k: v for k, v in r.items() if _exact(k)} for r in read_metrics(workdir / run)]

    straight = exact_fields("straight")
    assert any(key.startswith("eval/") for record in straight for key in record)
    assert exact_fields("interrupted") == straight
    logged = [r["step"] for r in straight if any(_is_training_loss(k) for k in r)]
    assert logged == list(range(2, TOTAL_STEPS + 1, 2))


def _is_training_loss(key: str) -> bool:
    return key.startswith("train/") and key.rsplit("/", 1)[-1] == "loss"


def _exact(key: str) -> bool:
    """The step, every evaluation metric, and the training loss, lr and gradient norm (of
    each update: train/loss, or train/<update>/loss in a task with Task.updates)."""
    name = key.rsplit("/", 1)[-1]
    return (
        key == "step"
        or key.startswith("eval/")
        or (key.startswith("train/") and name in ("loss", "lr", "grad_norm"))
    )


# --- another world size, other loader workers ----------------------------------------------
# float64 and eval mode (no dropout), data augmented at random, and a loader worker (each
# sample seeded alone: data.py): a run resumed on another number of ranks then ends within
# rounding of the unbroken run exactly when it continued at the right sample with the right
# global batch and the same draws; on the same ranks without workers, bitwise.
Float64TenStepsPerEpoch = float64(with_random_draws(TenStepsPerEpoch))


def _float64_run(
    rank: int, world_size: int, run_dir: Path, workers: int = 1
) -> dict[str, torch.Tensor]:
    # Each sample is seeded alone (data.py): random augmentation then depends on the sample,
    # not on which rank draws it, nor in which process, and runs stay comparable on any world
    # size and with any number of loader workers.
    config = load_config(None, [*_config(run_dir), f"data.num_workers={workers}"])
    trainer = _trainer(config, env_for(rank, world_size), Float64TenStepsPerEpoch)
    resumed_at = trainer.step if trainer.resume() else None
    trainer.fit()
    return {"resumed_at": resumed_at, "weights": trainer.model.state_dict()}


@pytest.fixture(scope="module")
def two_rank_float64_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    workdir = tmp_path_factory.mktemp("float64")
    result = spawn(2, _float64_run, workdir / "run", workdir=workdir)[0]
    return workdir / "run", result["weights"]


def _copy_up_to_first_checkpoint(source: Path, target: Path) -> None:
    shutil.copytree(source, target)
    for checkpoint in sorted((target / "checkpoints").iterdir())[1:]:
        shutil.rmtree(checkpoint)


@pytest.mark.parametrize("world_size", [1, 4])
def test_a_2_rank_checkpoint_continues_on_another_world_size_at_the_exact_sample(
    two_rank_float64_run: tuple[Path, dict], tmp_path: Path, world_size: int
) -> None:
    source, unbroken = two_rank_float64_run
    _copy_up_to_first_checkpoint(source, tmp_path / "run")
    if world_size == 1:
        result = _float64_run(0, 1, tmp_path / "run")
    else:
        result = spawn(world_size, _float64_run, tmp_path / "run", workdir=tmp_path)[0]
    assert result["resumed_at"] == CHECKPOINT_EVERY
    for name, tensor in unbroken.items():
        torch.testing.assert_close(result["weights"][name], tensor, rtol=1e-9, atol=1e-12)


def test_a_run_of_loader_workers_resumed_without_them_ends_bitwise_equal(
    two_rank_float64_run: tuple[Path, dict], tmp_path: Path
) -> None:
    """A host with other cores (data.num_workers=auto: none there) takes the run over."""
    source, unbroken = two_rank_float64_run
    _copy_up_to_first_checkpoint(source, tmp_path / "run")
    result = spawn(2, _float64_run, tmp_path / "run", 0, workdir=tmp_path)[0]
    assert result["resumed_at"] == CHECKPOINT_EVERY
    for name, tensor in unbroken.items():
        assert torch.equal(result["weights"][name], tensor), name


def test_resuming_on_another_world_size_says_bitwise_reproducibility_is_lost(
    two_rank_float64_run: tuple[Path, dict], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _copy_up_to_first_checkpoint(two_rank_float64_run[0], tmp_path / "run")
    config = load_config(None, _config(tmp_path / "run"))
    with caplog.at_level(logging.WARNING):
        assert _trainer(config, DistEnv(), Float64TenStepsPerEpoch).resume()
    assert "checkpoint of 2 ranks on 1" in caplog.text
    assert "no longer bitwise reproducible" in caplog.text
