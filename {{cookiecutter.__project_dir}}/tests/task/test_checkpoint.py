"""Checkpoints: complete contents, atomic publication, retention, and resume."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }}.checkpointing import checkpoint as checkpoint_module
from {{ cookiecutter.package_name }}.checkpointing.checkpoint import (
    CheckpointSaveError,
    CorruptCheckpointError,
    load_checkpoint,
    save_checkpoint,
    save_timeout_s,
)
from {{ cookiecutter.package_name }}.checkpointing.layout import (
    COMPLETE_MARKER,
    complete_checkpoints,
    latest_checkpoint,
)
from {{ cookiecutter.package_name }}.checkpointing.resume import ResumeError
from {{ cookiecutter.package_name }}.checkpointing.retention import remove_foreign_staging
from {{ cookiecutter.package_name }}.cluster.distributed import DistEnv
from {{ cookiecutter.package_name }}.config import Config, load_config
from {{ cookiecutter.package_name }}.monitoring.metrics import MetricsLogger, read_metrics

from ..helpers import (
    FAST,
    UPDATES,
    env_for,
    make_trainer,
    optimizer_states,
    spawn,
    train_steps,
)

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
        "best",
        "skipped_steps",
        *(["updates"] if UPDATES else []),  # the names of the task's updates, in order
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
    loaded = optimizer_states(resumed)
    for update, saved_opt in optimizer_states(trainer).items():
        for index, state in saved_opt["state"].items():
            for key, value in state.items():
                assert torch.equal(
                    torch.as_tensor(value), torch.as_tensor(loaded[update]["state"][index][key])
                )
    for before, after in zip(trainer.updates, resumed.updates, strict=True):
        assert after.scheduler.state_dict() == before.scheduler.state_dict()
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
        save_checkpoint(tmp_path, step, {"step": step}, {"rank": 0}, SINGLE, 2, job="job")
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
    scaler = trainer.updates[0].scaler
    scaler.update(1024.0)  # a scale that differs from a fresh scaler's
    trainer.save()
    resumed = make_trainer(config)
    assert resumed.updates[0].scaler.state_dict() != scaler.state_dict()
    resumed.resume()
    assert resumed.updates[0].scaler.state_dict() == scaler.state_dict()
    assert resumed.updates[0].scaler.get_scale() == 1024.0


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


def _with_records(config: Config, steps: list[int]) -> list[dict]:
    """metrics.jsonl with one record per step, as the run that saved the checkpoints wrote it."""
    logger = MetricsLogger(Path(config.run.dir), is_main=True)
    for step in steps:
        logger.log(step, {"train/loss": float(step)})
    return read_metrics(Path(config.run.dir))


def test_when_every_checkpoint_is_damaged_the_launch_is_refused_and_the_metrics_are_kept(
    fast_config: Config,
) -> None:
    """Never a silent start at step 0 over a run's work; the refusal lasts for later launches."""
    older, newest = _two_checkpoints(fast_config)
    records = _with_records(fast_config, [2, 4, 6])
    _truncate(older / "state.pt")
    _truncate(newest / "state.pt")
    for _ in range(2):
        with pytest.raises(ResumeError) as refused:
            make_trainer(fast_config).resume()
        assert "checkpoint.start_over_if_unusable=true" in str(refused.value)
    first = str(refused.value)
    assert newest.name in first and "state.pt has" not in first  # the second launch's view
    kept = sorted(path.name for path in (older.parent).iterdir())
    assert kept == [f"{older.name}.corrupt", f"{newest.name}.corrupt"]
    assert read_metrics(Path(fast_config.run.dir)) == records


def test_the_refusal_names_each_damaged_checkpoint_and_why(fast_config: Config) -> None:
    older, newest = _two_checkpoints(fast_config)
    _truncate(older / "state.pt")
    (newest / "rank_00000.pt").unlink()
    with pytest.raises(ResumeError) as refused:
        make_trainer(fast_config).resume()
    message = str(refused.value)
    assert f"{newest.name} (damaged: rank_00000.pt is missing; moved to {newest.name}.corrupt)" in (
        message
    )
    assert f"{older.name} (damaged: state.pt has" in message


def test_start_over_if_unusable_starts_a_new_run_and_keeps_the_old_metrics_aside(
    tmp_path: Path,
) -> None:
    config = load_config(
        None, [*FAST, f"run.dir={tmp_path}", "checkpoint.start_over_if_unusable=true"]
    )
    older, newest = _two_checkpoints(config)
    records = _with_records(config, [2, 4])
    _truncate(older / "state.pt")
    _truncate(newest / "state.pt")
    trainer = make_trainer(config)
    assert not trainer.resume()
    trainer.start_fresh()
    assert trainer.step == 0
    assert read_metrics(tmp_path) == []
    (kept,) = tmp_path.glob("metrics.before-start-over-*.jsonl")
    assert [json.loads(line) for line in kept.read_text().splitlines()] == records


def test_a_set_aside_name_that_is_taken_gets_a_number_and_the_previous_checkpoint_resumes(
    fast_config: Config,
) -> None:
    _, newest = _two_checkpoints(fast_config)
    taken = newest.with_name(f"{newest.name}.corrupt")
    taken.mkdir()
    (taken / "state.pt").write_bytes(b"an earlier damaged copy")
    _truncate(newest / "state.pt")
    resumed = make_trainer(fast_config)
    assert resumed.resume()
    assert resumed.step == 2
    assert (taken / "state.pt").read_bytes() == b"an earlier damaged copy"
    assert (newest.parent / f"{newest.name}.corrupt-2" / "state.pt").is_file()


@pytest.mark.parametrize(
    "error",
    [
        MemoryError(),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"
        ),
        PermissionError(13, "Permission denied"),
        OSError(5, "Input/output error"),
    ],
    ids=["memory-error", "cpu-allocator", "permission", "eio"],
)
def test_an_error_of_the_machine_while_loading_ends_the_launch_naming_the_file_and_changes_nothing(
    fast_config: Config, monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    """The bytes match their checksum: the error is not damage, so nothing is moved aside and
    the metrics are not cut back."""
    older, newest = _two_checkpoints(fast_config)
    records = _with_records(fast_config, [2, 4, 6])

    def failing_load(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(torch, "load", failing_load)
    with pytest.raises(ResumeError) as refused:
        make_trainer(fast_config).resume()
    assert f"cannot read {newest / 'state.pt'}: {type(error).__name__}" in str(refused.value)
    assert complete_checkpoints(newest.parent.parent) == [older, newest]
    assert sorted(path.name for path in newest.parent.iterdir()) == [older.name, newest.name]
    assert read_metrics(Path(fast_config.run.dir)) == records


def _rewrite_state(checkpoint: Path, change: Callable[[dict], None]) -> None:
    """Change state.pt and record its new checksum: a checkpoint intact, but of other contents."""
    state = torch.load(checkpoint / "state.pt", weights_only=True)
    change(state)
    torch.save(state, checkpoint / "state.pt")
    marker = json.loads((checkpoint / COMPLETE_MARKER).read_text())
    data = (checkpoint / "state.pt").read_bytes()
    marker["files"]["state.pt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / COMPLETE_MARKER).write_text(json.dumps(marker))


def _set_format(checkpoint: Path, version: int | None) -> None:
    marker = json.loads((checkpoint / COMPLETE_MARKER).read_text())
    if version is None:
        del marker["format"]
    else:
        marker["format"] = version
    (checkpoint / COMPLETE_MARKER).write_text(json.dumps(marker))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda path: _rewrite_state(path, lambda state: state.pop("config")), "lacks config"),
        (lambda path: _set_format(path, 99), "of checkpoint format 99"),
    ],
    ids=["missing-key", "newer-format"],
)
def test_a_checkpoint_of_another_format_is_skipped_by_name_and_kept_and_the_previous_one_resumes(
    fast_config: Config,
    caplog: pytest.LogCaptureFixture,
    change: Callable[[Path], None],
    message: str,
) -> None:
    """Never a KeyError: the previous intact checkpoint continues the run, and the skipped one
    is moved out of reach of the run's own saves and pruning, not deleted."""
    older, newest = _two_checkpoints(fast_config)
    change(newest)
    resumed = make_trainer(fast_config)
    with caplog.at_level(logging.WARNING):
        assert resumed.resume()
    assert resumed.step == 2
    assert message in caplog.text
    assert complete_checkpoints(resumed.run_dir) == [older]
    assert (newest.parent / f"{newest.name}.incompatible" / "state.pt").is_file()


def test_only_checkpoints_lacking_keys_are_refused_naming_the_keys_and_left_in_place(
    fast_config: Config,
) -> None:
    older, newest = _two_checkpoints(fast_config)
    for path in (older, newest):
        _rewrite_state(path, lambda state: [state.pop("config"), state.pop("optimizer")])
    with pytest.raises(ResumeError, match="lacks optimizer, config"):
        make_trainer(fast_config).resume()
    assert complete_checkpoints(older.parent.parent) == [older, newest]


def test_a_checkpoint_from_before_the_format_version_was_recorded_still_loads(
    fast_config: Config,
) -> None:
    _, newest = _two_checkpoints(fast_config)
    _set_format(newest, None)
    resumed = make_trainer(fast_config)
    assert resumed.resume()
    assert resumed.step == 4


# --- staging, and full disks -------------------------------------------------------------------


def test_a_save_leaves_the_staging_of_another_job_in_the_run_directory_alone(
    fast_config: Config,
) -> None:
    """Two jobs on one run directory never delete each other's save in flight."""
    trainer = make_trainer(fast_config)
    other = trainer.run_dir / "checkpoints" / f".step_00000000.{trainer.job}x.tmp"
    other.mkdir(parents=True)
    (other / "state.pt.partial").write_bytes(b"being written")
    trainer.save()
    trainer.step = 4
    trainer.save()
    assert (other / "state.pt.partial").read_bytes() == b"being written"


def test_remove_foreign_staging_removes_what_other_jobs_left_and_keeps_this_jobs(
    tmp_path: Path,
) -> None:
    root = tmp_path / "checkpoints"
    own, foreign, old_style = (
        root / ".step_00000008.this-job.tmp",
        root / ".step_00000008.host-1-2.tmp",
        root / ".step_00000004.tmp",
    )
    for path in (own, foreign, old_style):
        path.mkdir(parents=True)
        (path / "state.pt.partial").write_bytes(b"x")
    assert sorted(remove_foreign_staging(tmp_path, "this-job")) == sorted([foreign, old_style])
    assert [path.name for path in root.iterdir()] == [own.name]


def _no_space_after(limit: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Writes of checkpoint files fail as on a full disk once `limit` bytes were written."""
    write = checkpoint_module._HashingWriter.write

    def full_disk_write(self: object, data: bytes) -> int:
        if self.size + len(data) > limit:
            self.error = OSError(errno.ENOSPC, "No space left on device")
            raise self.error
        return write(self, data)

    monkeypatch.setattr(checkpoint_module._HashingWriter, "write", full_disk_write)


def test_a_save_on_a_full_disk_removes_its_staging_says_the_sizes_and_keeps_earlier_checkpoints(
    fast_config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    older, newest = _two_checkpoints(fast_config)
    trainer = make_trainer(fast_config)
    assert trainer.resume()
    trainer.step = 8
    _no_space_after(1000, monkeypatch)
    with pytest.raises(CheckpointSaveError) as failed:
        trainer.save()
    message = str(failed.value)
    assert "cannot save checkpoint step_00000008 (rank 0: [Errno 28] No space left on device)" in (
        message
    )
    assert f"the previous checkpoint, {newest.name}, takes" in message and "free in" in message
    assert sorted(path.name for path in newest.parent.iterdir()) == [older.name, newest.name]
    monkeypatch.undo()
    resumed = make_trainer(fast_config)
    assert resumed.resume() and resumed.step == 4


def test_a_save_that_would_not_fit_is_refused_before_anything_is_written(
    fast_config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, newest = _two_checkpoints(fast_config)
    trainer = make_trainer(fast_config)
    trainer.step = 8
    small = shutil.disk_usage(newest).__class__(total=10**9, used=10**9 - 100, free=100)
    monkeypatch.setattr(checkpoint_module.shutil, "disk_usage", lambda path: small)
    writes: list[Path] = []
    monkeypatch.setattr(checkpoint_module, "_atomic_save", lambda obj, path: writes.append(path))
    with pytest.raises(CheckpointSaveError, match="not enough free space for another checkpoint"):
        trainer.save()
    assert writes == []
    assert latest_checkpoint(trainer.run_dir) == newest
    assert not list(newest.parent.glob(".step_*"))


def test_a_resume_warns_when_the_disk_cannot_hold_keep_last_plus_one_checkpoints(
    fast_config: Config, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _, newest = _two_checkpoints(fast_config)
    size = sum(path.stat().st_size for path in newest.iterdir())
    free = size  # keep_last=3 with 2 held: two more are needed at the peak of a save
    usage = shutil.disk_usage(newest).__class__(total=10**9, used=10**9 - free, free=free)
    monkeypatch.setattr(checkpoint_module.shutil, "disk_usage", lambda path: usage)
    with caplog.at_level(logging.WARNING):
        assert make_trainer(fast_config).resume()
    assert "checkpoint.keep_last=3 needs about" in caplog.text


def test_a_save_waits_for_the_ranks_by_the_previous_write_time_with_a_floor_and_a_ceiling() -> None:
    floor, factor = checkpoint_module.SAVE_TIMEOUT_FLOOR_S, checkpoint_module.SAVE_TIMEOUT_FACTOR
    assert save_timeout_s(None, ceiling_s=1800) == 1800  # the first save of a launch
    assert save_timeout_s(1.0, ceiling_s=1800) == floor
    assert save_timeout_s(200.0, ceiling_s=1800) == factor * 200.0
    assert save_timeout_s(1000.0, ceiling_s=1800) == 1800


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
