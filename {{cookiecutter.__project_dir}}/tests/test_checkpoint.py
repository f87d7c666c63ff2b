"""Checkpoints: complete contents, atomic publication, retention, and resume."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }} import checkpoint as checkpoint_module
from {{ cookiecutter.package_name }}.checkpoint import (
    COMPLETE_MARKER,
    CorruptCheckpointError,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from {{ cookiecutter.package_name }}.config import Config, load_config
from {{ cookiecutter.package_name }}.distributed import DistEnv

from .helpers import FAST, env_for, make_trainer, spawn, train_steps

SINGLE = DistEnv()


def test_state_holds_everything_needed_to_resume(fast_config: Config) -> None:
    """The replicated state: model, optimizer, scheduler, scaler, position, the task's state, the
    weights' moving average (None when off), config, versions."""
    trainer = make_trainer(fast_config)
    assert set(trainer.state_dict()) == {
        "model",
        "task",
        "ema",
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
    assert set(trainer.rank_state_dict()) == {"rank", "rng", "window"}


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
    loaded = load_checkpoint(path, rank=0, world_size=1)
    assert loaded.state["step"] == 0
    assert loaded.rank_state["rank"] == 0


def test_checkpoint_without_marker_is_never_loaded(fast_config: Config) -> None:
    """A directory whose COMPLETE marker is missing (a crash mid-save) is skipped."""
    trainer = make_trainer(fast_config)
    first = trainer.save()
    trainer.step = 8
    second = trainer.save()
    (second / COMPLETE_MARKER).unlink()
    assert latest_checkpoint(trainer.run_dir) == first
    with pytest.raises(CorruptCheckpointError, match="incomplete"):
        load_checkpoint(second, rank=0, world_size=1)


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
    write_text = checkpoint_module.atomic_write_text
    seen: list[set[str]] = []

    def checking_write_text(path: Path, text: str) -> None:
        seen.append({p.name for p in path.parent.iterdir()})
        write_text(path, text)

    monkeypatch.setattr(checkpoint_module, "atomic_write_text", checking_write_text)
    make_trainer(fast_config).save()
    assert seen == [{"state.pt", "rank_00000.pt"}]


# --- damaged checkpoints -----------------------------------------------------------------------


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _two_checkpoints(config: Config) -> tuple[Path, Path]:
    trainer = make_trainer(config)
    train_steps(trainer, steps=2)
    older = trainer.save()
    train_steps(trainer, steps=2)
    return older, trainer.save()


def test_the_marker_records_every_files_size_and_checksum(fast_config: Config) -> None:
    path = make_trainer(fast_config).save()
    files = json.loads((path / COMPLETE_MARKER).read_text())["files"]
    assert set(files) == {"state.pt", "rank_00000.pt"}
    for name, recorded in files.items():
        data = (path / name).read_bytes()
        assert recorded == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@pytest.mark.parametrize(
    ("damage", "file", "message"),
    [
        (_truncate, "state.pt", "state.pt has"),
        (_flip_a_byte, "state.pt", "state.pt does not match its SHA-256 checksum"),
        (_truncate, "rank_00000.pt", "rank_00000.pt has"),
        (Path.unlink, "rank_00000.pt", "rank_00000.pt is missing"),
    ],
    ids=["truncated-state", "changed-state", "truncated-rank-file", "missing-rank-file"],
)
def test_a_damaged_newest_checkpoint_is_named_moved_aside_and_the_previous_one_resumed(
    fast_config: Config,
    caplog: pytest.LogCaptureFixture,
    damage: Callable[[Path], None],
    file: str,
    message: str,
) -> None:
    older, newest = _two_checkpoints(fast_config)
    damage(newest / file)
    resumed = make_trainer(fast_config)
    with caplog.at_level(logging.WARNING):
        assert resumed.resume()
    assert resumed.step == 2
    assert message in caplog.text and newest.name in caplog.text
    assert complete_checkpoints(resumed.run_dir) == [older]
    assert (newest.parent / f"{newest.name}.corrupt").is_dir()


def test_checkpoints_that_are_all_damaged_leave_a_fresh_start_and_keep_the_files(
    fast_config: Config,
) -> None:
    older, newest = _two_checkpoints(fast_config)
    _truncate(older / "state.pt")
    _truncate(newest / "state.pt")
    resumed = make_trainer(fast_config)
    assert not resumed.resume()
    assert resumed.step == 0
    kept = sorted(path.name for path in (resumed.run_dir / "checkpoints").iterdir())
    assert kept == [f"{older.name}.corrupt", f"{newest.name}.corrupt"]


def _resume_after_rank_1_file_is_damaged(rank: int, world_size: int, run_dir: Path) -> int:
    config = load_config(None, [*FAST, f"run.dir={run_dir}"])
    trainer = make_trainer(config, env_for(rank, world_size))
    train_steps(trainer, steps=2)
    trainer.save()
    train_steps(trainer, steps=2)
    newest = trainer.save()
    if rank == 1:
        _truncate(newest / "rank_00001.pt")
    resumed = make_trainer(config, env_for(rank, world_size))
    resumed.resume()
    return resumed.step


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_ranks_agree_on_the_fallback_when_only_one_rank_cannot_load_its_file(
    tmp_path: Path,
) -> None:
    """Rank 0 could load step 4; rank 1 cannot: both resume from step 2."""
    steps = spawn(2, _resume_after_rank_1_file_is_damaged, tmp_path / "run", workdir=tmp_path)
    assert steps == [2, 2]
