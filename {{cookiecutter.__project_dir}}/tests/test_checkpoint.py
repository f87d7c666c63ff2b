"""Checkpoints: complete contents, atomic publication, retention, and resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }} import checkpoint as checkpoint_module
from {{ cookiecutter.package_name }}.checkpoint import (
    COMPLETE_MARKER,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from {{ cookiecutter.package_name }}.config import Config, load_config
from {{ cookiecutter.package_name }}.distributed import DistEnv
from {{ cookiecutter.package_name }}.trainer import ResumeError

from .helpers import FAST, make_trainer, train_steps

SINGLE = DistEnv()


def test_state_holds_everything_needed_to_resume(fast_config: Config) -> None:
    """The replicated state: model, optimizer, scheduler, scaler, position, config, versions."""
    trainer = make_trainer(fast_config)
    assert set(trainer.state_dict()) == {
        "model",
        "optimizer",
        "scheduler",
        "scaler",
        "step",
        "epoch",
        "step_in_epoch",
        "sampler",
        "world_size",
        "global_batch_size",
        "config",
        "versions",
    }
    assert set(trainer.rank_state_dict()) == {"rank", "rng", "window_loss", "window_steps"}


def test_model_keys_have_no_wrapper_prefix(fast_config: Config) -> None:
    """Weights load into a bare model: no `module.` (DDP) or `_orig_mod.` (compile) prefixes."""
    keys = list(make_trainer(fast_config).state_dict()["model"])
    assert keys
    assert not [key for key in keys if key.startswith(("module.", "_orig_mod."))]


def test_round_trip_restores_weights_optimizer_and_position(fast_config: Config) -> None:
    """Save after 3 steps, resume in a fresh trainer: every tensor and counter is equal."""
    trainer = make_trainer(fast_config)
    train_steps(trainer, steps=3)
    trainer.save()

    resumed = make_trainer(fast_config)
    assert resumed.resume()
    assert resumed.step == 3
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(tensor, resumed.model.state_dict()[name]), name
    saved_opt, loaded_opt = trainer.optimizer.state_dict(), resumed.optimizer.state_dict()
    for index, state in saved_opt["state"].items():
        for key, value in state.items():
            assert torch.equal(
                torch.as_tensor(value), torch.as_tensor(loaded_opt["state"][index][key])
            )
    assert resumed.scheduler.state_dict() == trainer.scheduler.state_dict()
    assert torch.equal(torch.get_rng_state(), trainer.rank_state_dict()["rng"]["torch"])


def test_files_are_loaded_with_the_safe_unpickler(fast_config: Config) -> None:
    """Everything saved loads with weights_only=True, so a checkpoint cannot run code."""
    trainer = make_trainer(fast_config)
    path = trainer.save()
    state, rank_state = load_checkpoint(path, rank=0)
    assert state["step"] == 0
    assert rank_state["rank"] == 0


def test_checkpoint_without_marker_is_never_loaded(fast_config: Config) -> None:
    """A directory whose COMPLETE marker is missing (a crash mid-save) is skipped."""
    trainer = make_trainer(fast_config)
    first = trainer.save()
    trainer.step = 8
    second = trainer.save()
    (second / COMPLETE_MARKER).unlink()
    assert latest_checkpoint(trainer.run_dir) == first
    with pytest.raises(FileNotFoundError, match="incomplete"):
        load_checkpoint(second, rank=0)


def test_staging_directory_is_never_loaded(tmp_path: Path) -> None:
    """The hidden staging directory of an interrupted save is invisible to resume."""
    staging = tmp_path / "checkpoints" / ".step_00000004.tmp"
    staging.mkdir(parents=True)
    (staging / COMPLETE_MARKER).write_text("{}")
    assert latest_checkpoint(tmp_path) is None


def test_keeps_only_the_last_n(tmp_path: Path) -> None:
    """Retention keeps the newest `keep_last` complete checkpoints."""
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, {"step": step}, {"rank": 0}, SINGLE, keep_last=2)
    assert [path.name for path in complete_checkpoints(tmp_path)] == [
        "step_00000004",
        "step_00000005",
    ]


def test_resume_with_another_world_size_fails_clearly(fast_config: Config) -> None:
    """Per-rank state cannot be mapped onto a different number of ranks: say so, do not guess."""
    trainer = make_trainer(fast_config)
    save_checkpoint(
        trainer.run_dir,
        4,
        {**trainer.state_dict(), "world_size": 2},
        trainer.rank_state_dict(),
        SINGLE,
        3,
    )
    with pytest.raises(ResumeError, match="written by 2 ranks but this run has 1"):
        make_trainer(fast_config).resume()


def test_fresh_run_directory_starts_at_step_zero(fast_config: Config) -> None:
    trainer = make_trainer(fast_config)
    assert not trainer.resume()
    assert trainer.step == 0


def test_fp16_scaler_state_round_trips(tmp_path: Path) -> None:
    """The GradScaler's scale and growth tracker survive a save and a resume."""
    config = load_config(None, [*FAST, f"run.dir={tmp_path}", "train.mixed_precision=fp16"])
    trainer = make_trainer(config)
    train_steps(trainer, steps=2)
    trainer.scaler.update(1024.0)  # a scale that differs from a fresh scaler's
    trainer.save()
    resumed = make_trainer(config)
    assert resumed.scaler.state_dict() != trainer.scaler.state_dict()
    resumed.resume()
    assert resumed.scaler.state_dict() == trainer.scaler.state_dict()
    assert resumed.scaler.get_scale() == 1024.0


def test_completion_marker_is_written_last(
    fast_config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When COMPLETE is written, the state and every rank file are already in place."""
    write_text = checkpoint_module._atomic_write_text
    seen: list[set[str]] = []

    def checking_write_text(path: Path, text: str) -> None:
        seen.append({p.name for p in path.parent.iterdir()})
        write_text(path, text)

    monkeypatch.setattr(checkpoint_module, "_atomic_write_text", checking_write_text)
    make_trainer(fast_config).save()
    assert seen == [{"state.pt", "rank_00000.pt"}]
