"""Resume is bitwise exact: a run that crashes and restarts ends where an unbroken run ends."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }}.config import load_config
from {{ cookiecutter.package_name }}.metrics import read_metrics
from {{ cookiecutter.package_name }}.trainer import ResumeError

from .helpers import FAST, env_for, make_trainer, spawn

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

TOTAL_STEPS = 16
CHECKPOINT_EVERY = 7  # step 7 is inside the first epoch (10 steps per epoch)
CRASH_AT_STEP = 10  # steps 8 and 9 are trained and logged, then lost


def _config(run_dir: Path) -> list[str]:
    # 2 ranks x micro-batch 8 x 2 accumulation steps; dropout is on, so RNG state matters.
    return [
        *FAST,
        f"run.dir={run_dir}",
        "task.num_train_samples=320",
        "train.global_batch_size=32",
        "train.micro_batch_size=8",
        f"train.max_steps={TOTAL_STEPS}",
        f"checkpoint.every_steps={CHECKPOINT_EVERY}",
        "checkpoint.keep_last=10",
    ]


class Crash(RuntimeError):
    pass


def _straight_and_interrupted(rank: int, world_size: int, workdir: Path) -> dict:
    env = env_for(rank, world_size)
    straight = make_trainer(load_config(None, _config(workdir / "straight")), env)
    straight.fit()

    interrupted_config = load_config(None, _config(workdir / "interrupted"))
    first = make_trainer(interrupted_config, env)
    train_step = first.train_step

    def crash_at_step(batches: object) -> tuple:
        if first.step + 1 == CRASH_AT_STEP:
            raise Crash
        return train_step(batches)

    first.train_step = crash_at_step
    with pytest.raises(Crash):
        first.fit()

    resumed = make_trainer(interrupted_config, env)
    assert resumed.resume()
    resumed_at = resumed.step
    resumed.fit()
    return {
        "resumed_at": resumed_at,
        "straight": (straight.model.state_dict(), straight.optimizer.state_dict()),
        "resumed": (resumed.model.state_dict(), resumed.optimizer.state_dict()),
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
        straight, resumed = result["straight"][1]["state"], result["resumed"][1]["state"]
        assert straight.keys() == resumed.keys()
        for index, state in straight.items():
            for key, value in state.items():
                assert torch.equal(value, resumed[index][key]), (index, key)


def test_logged_losses_and_metrics_equal_an_unbroken_run(runs: tuple) -> None:
    """Same values at the same steps; the records of the lost steps 8-9 are not duplicated."""
    workdir, _ = runs
    exact = ("train/loss", "train/lr", "train/grad_norm", "eval/loss", "eval/accuracy")

    def exact_fields(run: str) -> list[dict]:
        records = read_metrics(workdir / run)
        return [{k: v for k, v in r.items() if k in (*exact, "step")} for r in records]

    assert exact_fields("interrupted") == exact_fields("straight")
    assert [r["step"] for r in read_metrics(workdir / "straight") if "train/loss" in r] == list(
        range(2, TOTAL_STEPS + 1, 2)
    )


def test_resuming_with_another_world_size_is_refused(runs: tuple, tmp_path: Path) -> None:
    """A 2-rank checkpoint does not silently continue on 1 rank: the error says what to do."""
    workdir, _ = runs
    shutil.copytree(workdir / "straight", tmp_path / "run")
    single = make_trainer(load_config(None, _config(tmp_path / "run")))
    with pytest.raises(ResumeError, match="written by 2 ranks but this run has 1"):
        single.resume()
