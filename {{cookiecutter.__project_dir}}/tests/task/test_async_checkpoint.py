"""checkpoint.async on 2 ranks (gloo): a run resumed from checkpoints written in the background
ends bitwise where an unbroken synchronous run ends, one save is in flight at a time, and the
saves' collectives never mix with those of training."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }}.checkpointing import checkpoint as checkpoint_module
from {{ cookiecutter.package_name }}.checkpointing.layout import complete_checkpoints
from {{ cookiecutter.package_name }}.cluster.distributed import gather_objects
from {{ cookiecutter.package_name }}.config import load_config

from ..helpers import FAST, env_for, make_trainer, optimizer_states, spawn, train_steps

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

TOTAL_STEPS = 12
CRASH_AT_STEP = 10  # after the background save of step 8 started


class Crash(RuntimeError):
    pass


def _overrides(run_dir: Path, background: bool) -> list[str]:
    return [
        *FAST,
        f"run.dir={run_dir}",
        f"train.max_steps={TOTAL_STEPS}",
        f"checkpoint.async={str(background).lower()}",
    ]


def _unbroken_and_resumed(rank: int, world_size: int, workdir: Path) -> dict:
    env = env_for(rank, world_size)
    unbroken = make_trainer(load_config(None, _overrides(workdir / "sync", background=False)), env)
    unbroken.fit()

    config = load_config(None, _overrides(workdir / "async", background=True))
    first = make_trainer(config, env)
    train_step = first.train_step

    def crash_at_step(batches: object) -> object:
        if first.step + 1 == CRASH_AT_STEP:
            raise Crash
        return train_step(batches)

    first.train_step = crash_at_step
    with pytest.raises(Crash):
        first.fit()  # waits for the save in flight before the crash leaves it
    resumed = make_trainer(config, env)
    assert resumed.resume()
    resumed_at = resumed.step
    resumed.fit()
    return {
        "resumed_at": resumed_at,
        "unbroken": unbroken.model.state_dict(),
        "resumed": resumed.model.state_dict(),
        "unbroken_optimizer": optimizer_states(unbroken),
        "resumed_optimizer": optimizer_states(resumed),
    }


def test_a_run_resumed_from_background_checkpoints_ends_bitwise_like_an_unbroken_synchronous_run(
    tmp_path: Path,
) -> None:
    for result in spawn(2, _unbroken_and_resumed, tmp_path, workdir=tmp_path):
        assert result["resumed_at"] == 8
        for name, tensor in result["unbroken"].items():
            assert torch.equal(tensor, result["resumed"][name]), name
        for update, saved in result["unbroken_optimizer"].items():
            resumed = result["resumed_optimizer"][update]["state"]
            for index, state in saved["state"].items():
                for key, value in state.items():
                    assert torch.equal(value, resumed[index][key]), (update, index, key)
    names = [path.name for path in complete_checkpoints(tmp_path / "async")]
    assert names == ["step_00000004", "step_00000008", "step_00000012"]


def _two_background_saves(rank: int, world_size: int, run_dir: Path) -> dict:
    """Rank 0 writes the first checkpoint's state slowly; meanwhile both ranks train and
    gather on the control group, then start the next save."""
    config = load_config(None, [*FAST, f"run.dir={run_dir}", "checkpoint.async=true"])
    trainer = make_trainer(config, env_for(rank, world_size))
    events: list[tuple[int, str]] = []  # (step, begin or end) of each file written
    atomic_save = checkpoint_module._atomic_save

    def recorded_save(obj: object, path: Path) -> dict:
        step = int(path.parent.name[6:14])  # .step_00000002.<job>.tmp
        events.append((step, "begin"))
        if rank == 0 and path.name == checkpoint_module.STATE_FILE and step == 2:
            time.sleep(0.5)  # the next save is started meanwhile
        written = atomic_save(obj, path)
        events.append((step, "end"))
        return written

    checkpoint_module._atomic_save = recorded_save
    train_steps(trainer, 2)
    trainer.save_in_background()
    gathered = [gather_objects(rank) for _ in range(3)]
    train_steps(trainer, 2)
    trainer.save_in_background()
    trainer.wait_for_save()
    return {"events": events, "gathered": gathered}


def test_the_next_background_save_waits_for_the_one_in_flight_and_collectives_do_not_mix(
    tmp_path: Path,
) -> None:
    results = spawn(2, _two_background_saves, tmp_path / "run", workdir=tmp_path)
    for rank, result in enumerate(results):
        steps = [step for step, _ in result["events"]]
        assert steps == sorted(steps) and set(steps) == {2, 4}, result["events"]
        assert len(steps) == (8 if rank == 0 else 4)  # rank 0 writes the state too
        assert result["gathered"] == [[0, 1]] * 3
    names = [path.name for path in complete_checkpoints(tmp_path / "run")]
    assert names == ["step_00000002", "step_00000004"]
