"""Gradient equivalence, accumulation under no_sync, and the global batch, on 2 gloo ranks.

DDP with N ranks x micro-batch B x K accumulation steps must make the same update as one process
with the whole global batch; gradients must be all-reduced once per optimizer step, not once
per micro-step. A task whose loss reads the step's samples together (Task.whole_batch_loss:
negatives gathered across ranks) trains one micro-batch per rank: 2 ranks must equal one
process, and a split that needs accumulation is refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from {{ cookiecutter.package_name }}.cluster.distributed import DistEnv
from {{ cookiecutter.package_name }}.config import load_config
from {{ cookiecutter.package_name }}.task import Task
from {{ cookiecutter.package_name }}.train import checked_config

from ..helpers import (
    FAST,
    WHOLE_BATCH_LOSS,
    Float64Task,
    accumulates,
    env_for,
    flat_grads,
    make_trainer,
    spawn,
    train_steps,
)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

GLOBAL_BATCH = 16
STEPS = 3
#: The 2-rank run's micro-batch: 2 ranks x 4 x 2 accumulation steps, or for a whole-batch loss
#: 2 ranks x 8 x 1.
TWO_RANK_MICRO_BATCH = GLOBAL_BATCH // 2 if WHOLE_BATCH_LOSS else 4


def _float64_config(run_dir: Path, micro_batch: int) -> list[str]:
    """One loader worker: each sample's random augmentation is then seeded by the sample
    (data.py), the same whichever rank reads it in whichever micro-batch, so that runs on other
    world sizes and splits train on the same data."""
    return [
        *FAST,
        f"run.dir={run_dir}",
        "train.mixed_precision=none",
        f"train.global_batch_size={GLOBAL_BATCH}",
        f"train.micro_batch_size={micro_batch}",
        "data.num_workers=1",
    ]


def _train_float64(rank: int, world_size: int, run_dir: Path, micro_batch: int) -> dict:
    config = load_config(None, _float64_config(run_dir, micro_batch))
    task = Float64Task(config.task, seed=config.run.seed)
    return train_steps(make_trainer(config, env_for(rank, world_size), task), STEPS)


@pytest.fixture(scope="module")
def two_rank_weights(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Weights of both ranks after 3 steps of 2 ranks x micro-batch 4 x 2 accumulation steps
    (a whole-batch loss: 8 x 1)."""
    workdir = tmp_path_factory.mktemp("float64")
    return spawn(2, _train_float64, workdir / "run", TWO_RANK_MICRO_BATCH, workdir=workdir)


def _assert_close(left: dict, right: dict) -> None:
    """Within 1e-10; a failure names the weight and how far it is off (a loss that gathers
    negatives across ranks, trained with accumulation, is off by 1e-3: Task.whole_batch_loss)."""
    for name, tensor in left.items():
        torch.testing.assert_close(
            tensor,
            right[name],
            rtol=0,
            atol=1e-10,
            msg=lambda default, name=name: f"{name}: {default}",
        )


def test_replicas_hold_identical_weights(two_rank_weights: list[dict]) -> None:
    for name, tensor in two_rank_weights[0].items():
        other = two_rank_weights[1][name]
        assert torch.equal(tensor, other), f"{name}: off by {(tensor - other).abs().max():.3g}"


def test_two_ranks_equal_one_process_with_the_whole_batch(
    two_rank_weights: list[dict], tmp_path: Path
) -> None:
    """2 ranks x B=4 x K=2 (a whole-batch loss: B=8, K=1) == 1 process x batch 16, in float64,
    within 1e-10, after 3 steps."""
    single = _train_float64(0, 1, tmp_path / "run", micro_batch=GLOBAL_BATCH)
    _assert_close(two_rank_weights[0], single)


@accumulates
def test_same_global_batch_trains_the_same_on_one_or_two_ranks(
    two_rank_weights: list[dict], tmp_path: Path
) -> None:
    """The global batch is the contract: 1 rank accumulating 4 x 4 matches 2 ranks x 2 x 4."""
    single = _train_float64(0, 1, tmp_path / "run", micro_batch=4)
    _assert_close(two_rank_weights[0], single)


@pytest.mark.skipif(
    not WHOLE_BATCH_LOSS,
    reason="the task's loss reads each micro-batch alone: accumulation trains it (test above)",
)
def test_a_whole_batch_loss_refuses_accumulation_naming_the_micro_batch_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """1 rank x 4 x 4 would give each micro-batch only its own negatives: another loss. The
    launch is refused before it starts, naming the micro-batch size of one step."""
    settings = _float64_config(tmp_path / "run", micro_batch=4)
    assert checked_config(None, settings, DistEnv(), tell=False) is None
    error = capsys.readouterr().err
    assert "Task.whole_batch_loss" in error and "takes 4 micro-batches per step" in error
    assert f"Set train.micro_batch_size={GLOBAL_BATCH} (" in error


#: Micro-batches per rank and step (K) that the communication tests train with: 1 only for a
#: task whose loss reads the whole batch, which refuses accumulation.
ACCUMULATIONS = (1,) if WHOLE_BATCH_LOSS else (1, 2, 4)
K_ALL = [1, *(pytest.param(k, marks=accumulates) for k in (2, 4))]


def _record_communication(rank: int, world_size: int, run_dir: Path) -> dict[int, dict]:
    return {k: _record_one(rank, world_size, run_dir / str(k), k) for k in ACCUMULATIONS}


def _record_one(rank: int, world_size: int, run_dir: Path, k: int) -> dict:
    """When gradients are all-reduced, and the gradients before and after, with K = k: per
    update (one, unless the task has Task.updates, each with a DDP wrapper of its own)."""
    config = load_config(
        None,
        [
            *FAST,
            f"run.dir={run_dir}",
            f"train.global_batch_size={8 * world_size * k}",
            "train.micro_batch_size=8",
        ],
    )
    task = Task(config.task, seed=config.run.seed)
    trainer = make_trainer(config, env_for(rank, world_size), task)
    parts = {update.name: update.module for update in trainer.updates}
    micro_step = -1
    rounds: set[tuple[str | None, int, int]] = set()
    before_last: list[torch.Tensor] = []
    at_step: dict[str | None, list[torch.Tensor]] = {name: [] for name in parts}

    # DDP checks a hook's annotations against its own types: leave this one unannotated.
    def counting_allreduce(name, bucket):
        rounds.add((name, len(at_step[name]), micro_step))
        return default_hooks.allreduce_hook(None, bucket)

    def loss_with_probe(model: torch.nn.Module, batch: object, **update: str) -> object:
        nonlocal micro_step
        micro_step = (micro_step + 1) % k
        if k > 1 and micro_step == k - 1:
            before_last.append(flat_grads(parts[update.get("update")]))
        return Task.training_loss(task, model, batch, **update)

    task.training_loss = loss_with_probe
    for update in trainer.updates:
        update.ddp.register_comm_hook(update.name, counting_allreduce)
        update.optimizer.register_step_pre_hook(
            lambda *_, name=update.name: at_step[name].append(flat_grads(parts[name]))
        )
    train_steps(trainer, STEPS)
    return {"rounds": rounds, "before_last": before_last, "at_step": at_step}


@pytest.fixture(scope="module")
def communication(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    workdir = tmp_path_factory.mktemp("no_sync")
    return spawn(2, _record_communication, workdir / "run", workdir=workdir)


@pytest.mark.parametrize("k", K_ALL)
def test_one_allreduce_round_per_optimizer_step(communication: list[dict], k: int) -> None:
    """Gradients are reduced only during the last micro-step of each optimizer step."""
    for rank_records in communication:
        names = rank_records[k]["at_step"]
        expected = {(name, step, k - 1) for name in names for step in range(STEPS)}
        assert rank_records[k]["rounds"] == expected


@accumulates
@pytest.mark.parametrize("k", [2, 4])
def test_gradients_stay_local_until_the_last_micro_step(communication: list[dict], k: int) -> None:
    """Before the last micro-step each rank holds only its own gradients: they differ."""
    for left, right in zip(
        communication[0][k]["before_last"], communication[1][k]["before_last"], strict=True
    ):
        assert not torch.equal(left, right)


@pytest.mark.parametrize("k", K_ALL)
def test_gradients_are_identical_at_the_optimizer_step(communication: list[dict], k: int) -> None:
    """After the last micro-step the all-reduced gradients are bitwise equal on every rank."""
    for name, left_steps in communication[0][k]["at_step"].items():
        steps = list(zip(left_steps, communication[1][k]["at_step"][name], strict=True))
        assert len(steps) == STEPS
        for left, right in steps:
            assert torch.equal(left, right)
