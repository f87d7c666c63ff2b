"""Checkpoints in an object store (run.dir=s3://...), against a real S3 server (moto's) started
on a free port: the commit by COMPLETE, verification, fallback, pruning order, credentials that
stay in the environment, and the one-job lock kept in the store itself."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }}.checkpointing import run_lock
from {{ cookiecutter.package_name }}.checkpointing import storage as storage_module
from {{ cookiecutter.package_name }}.checkpointing.checkpoint import (
    REQUIRED_STATE_KEYS,
    STATE_FILE,
    CheckpointReadError,
    CheckpointSaveError,
    restore_run_files,
    save_checkpoint,
)
from {{ cookiecutter.package_name }}.checkpointing.layout import (
    COMPLETE_MARKER,
    complete_checkpoints,
    set_aside_checkpoints,
)
from {{ cookiecutter.package_name }}.checkpointing.newest_intact import load_newest_intact
from {{ cookiecutter.package_name }}.checkpointing.run_lock import (
    LOCK_FILE,
    Holder,
    RunDirBusyError,
    RunLock,
    owned_run_dir,
)
from {{ cookiecutter.package_name }}.checkpointing.storage import ObjectPath, run_location, storage_of
from {{ cookiecutter.package_name }}.cluster.distributed import DistEnv
from {{ cookiecutter.package_name }}.config import ConfigError, load_config

from ..conftest import S3_SECRET
from .test_run_lock import ELSEWHERE, race

pytestmark = pytest.mark.standalone

BUCKET = "runs"


@pytest.fixture
def run_dir(s3_bucket: str, tmp_path: Path, request: pytest.FixtureRequest) -> ObjectPath:
    """A fresh s3:// run directory (a prefix of its own) and its local part."""
    location = run_location(f"{s3_bucket}/{request.node.name}", str(tmp_path / "local"))
    assert isinstance(location, ObjectPath)
    return location


def _save(run_dir: ObjectPath, step: int, keep_last: int = 3) -> ObjectPath:
    state = {key: {} for key in REQUIRED_STATE_KEYS}
    state.update(model={"w": torch.full((4,), float(step))}, step=step)
    return save_checkpoint(run_dir, step, state, {"rng": step}, DistEnv(), keep_last=keep_last)


@pytest.fixture
def store_out_of_reach(run_dir: ObjectPath, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """From here on the store's endpoint is a closed port (credentials unchanged)."""
    fs_class = type(storage_of(run_dir).fs)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    fs_class.clear_instance_cache()  # a new client, for the new endpoint
    yield
    fs_class.clear_instance_cache()


def _objects(run_dir: ObjectPath) -> list[str]:
    fs = storage_of(run_dir).fs
    return sorted(path.removeprefix(f"{BUCKET}/") for path in fs.find(run_dir.url))


def _plant_lock(run_dir: ObjectPath, holder: Holder) -> None:
    """A lock object of `holder` (another job), written just now."""
    assert storage_of(run_dir).create(run_dir / LOCK_FILE, json.dumps(asdict(holder)).encode())


def _lock_token(run_dir: ObjectPath) -> str:
    return json.loads(storage_of(run_dir).read_bytes(run_dir / LOCK_FILE))["token"]


def test_checkpoint_is_written_under_its_name_with_complete_and_loads_verified(
    run_dir: ObjectPath,
) -> None:
    path = _save(run_dir, 4)
    assert path == run_dir / "checkpoints" / "step_00000004"
    loaded = load_newest_intact(run_dir, DistEnv())
    assert loaded is not None and loaded.state["step"] == 4 and loaded.rank_state == {"rng": 4}
    marker = json.loads(storage_of(path).read_text(path / COMPLETE_MARKER))
    assert set(marker["files"]) == {STATE_FILE, "rank_00000.pt"}


def test_save_killed_before_complete_is_never_listed_and_removed_by_the_next_save(
    run_dir: ObjectPath, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save(run_dir, 4)
    real_write = storage_module.ObjectStorage.write

    def killed_at_complete(self, path, fill):
        if path.name == COMPLETE_MARKER:
            raise KeyboardInterrupt  # the process ends here: no handler runs, nothing is cleaned
        return real_write(self, path, fill)

    monkeypatch.setattr(storage_module.ObjectStorage, "write", killed_at_complete)
    with pytest.raises(KeyboardInterrupt):
        _save(run_dir, 8)
    monkeypatch.undo()
    leftover = run_dir / "checkpoints" / "step_00000008"
    assert storage_of(leftover).exists(leftover / STATE_FILE)
    assert [path.name for path in complete_checkpoints(run_dir)] == ["step_00000004"]
    loaded = load_newest_intact(run_dir, DistEnv())
    assert loaded is not None and loaded.state["step"] == 4
    _save(run_dir, 8)
    names = [path.name for path in complete_checkpoints(run_dir)]
    assert names == ["step_00000004", "step_00000008"]


def test_damaged_object_is_detected_set_aside_and_the_previous_checkpoint_loads(
    run_dir: ObjectPath,
) -> None:
    _save(run_dir, 4)
    newest = _save(run_dir, 8)
    store = storage_of(newest)
    data = bytearray(store.read_bytes(newest / STATE_FILE))
    data[len(data) // 2] ^= 0xFF
    store.fs.pipe_file((newest / STATE_FILE).url, bytes(data))
    loaded = load_newest_intact(run_dir, DistEnv())
    assert loaded is not None and loaded.state["step"] == 4
    assert [path.name for path in set_aside_checkpoints(run_dir)] == ["step_00000008.corrupt"]
    assert [path.name for path in complete_checkpoints(run_dir)] == ["step_00000004"]
    aside = run_dir / "checkpoints" / "step_00000008.corrupt"
    assert store.read_bytes(aside / STATE_FILE) == bytes(data)  # kept for a look, not deleted


def test_pruning_removes_complete_before_the_files(
    run_dir: ObjectPath, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save(run_dir, 4, keep_last=1)
    fs = storage_of(run_dir).fs
    removed: list[str] = []
    real_rm_file, real_rm = fs.rm_file, fs.rm

    def recording_rm_file(path, **kwargs):
        removed.append(path)
        return real_rm_file(path, **kwargs)

    def recording_rm(path, recursive=False, **kwargs):
        removed.extend(sorted(fs.find(path)))
        return real_rm(path, recursive=recursive, **kwargs)

    monkeypatch.setattr(fs, "rm_file", recording_rm_file)
    monkeypatch.setattr(fs, "rm", recording_rm)
    _save(run_dir, 8, keep_last=1)
    monkeypatch.undo()
    pruned = [path.rsplit("/", 1)[-1] for path in removed if "/step_00000004/" in path]
    assert pruned[0] == COMPLETE_MARKER and set(pruned[1:]) == {STATE_FILE, "rank_00000.pt"}
    assert [path.name for path in complete_checkpoints(run_dir)] == ["step_00000008"]
    assert not any("step_00000004" in name for name in _objects(run_dir))


def test_run_files_travel_with_the_checkpoint_and_restore_into_an_empty_local_dir(
    run_dir: ObjectPath, tmp_path: Path
) -> None:
    local = run_dir.local
    assert local is not None
    local.mkdir(parents=True)
    (local / "metrics.jsonl").write_text('{"step": 2, "train/loss": 1.0}\n')
    (local / "train.log").write_text("step 2 | loss 1.0\n")
    _save(run_dir, 4)
    uploaded = [name.split("/", 2)[2] for name in _objects(run_dir)]
    assert "step_00000004/run/metrics.jsonl" in uploaded
    assert "step_00000004/run/train.log" in uploaded
    elsewhere = ObjectPath(run_dir.url, tmp_path / "another-node")
    restored = restore_run_files(elsewhere, rank=0)
    assert restored == run_dir / "checkpoints" / "step_00000004"
    assert (tmp_path / "another-node" / "metrics.jsonl").read_text() == (
        local / "metrics.jsonl"
    ).read_text()
    assert (tmp_path / "another-node" / "train.log").read_text() == "step 2 | loss 1.0\n"
    assert restore_run_files(elsewhere, rank=0) is None  # up to date now: left as it is


def test_credentials_are_in_no_object_and_no_local_file(run_dir: ObjectPath) -> None:
    local = run_dir.local
    assert local is not None
    local.mkdir(parents=True)
    (local / "metrics.jsonl").write_text('{"step": 4}\n')
    config = load_config(None, [f"run.dir={run_dir.url}", f"run.local_dir={local}"])
    state = {"model": {}, "step": 4, "config": config.to_dict()}
    save_checkpoint(run_dir, 4, state, {"rng": 0}, DistEnv(), keep_last=1)
    store = storage_of(run_dir)
    for name in _objects(run_dir):
        assert S3_SECRET.encode() not in store.fs.cat_file(f"{BUCKET}/{name}"), name
    for path in local.rglob("*"):
        assert path.is_dir() or S3_SECRET.encode() not in path.read_bytes(), path


def test_unreachable_store_is_a_read_error_that_changes_nothing(
    run_dir: ObjectPath, request: pytest.FixtureRequest
) -> None:
    _save(run_dir, 4)
    request.getfixturevalue("store_out_of_reach")
    with pytest.raises(CheckpointReadError, match="cannot list"):
        load_newest_intact(run_dir, DistEnv())


def test_a_save_failing_while_the_store_answers_no_size_query_is_a_save_error(
    run_dir: ObjectPath, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store went away mid-save: the failure is described with what could be measured."""
    _save(run_dir, 4)

    def out_of_reach(*args: object) -> None:
        raise OSError("EndpointConnectionError: Could not connect to the endpoint URL")

    monkeypatch.setattr(storage_module.ObjectStorage, "write", out_of_reach)
    monkeypatch.setattr(storage_module.ObjectStorage, "tree_size", out_of_reach)
    with pytest.raises(CheckpointSaveError) as failed:
        _save(run_dir, 8)
    message = str(failed.value)
    assert "cannot save checkpoint step_00000008 (rank 0: EndpointConnectionError" in message
    assert "step_00000004, takes an unknown size (it could not be measured)" in message
    monkeypatch.undo()
    assert [path.name for path in complete_checkpoints(run_dir)] == ["step_00000004"]


def test_a_second_job_on_an_object_store_run_dir_is_refused_naming_the_holder(
    run_dir: ObjectPath,
) -> None:
    """The holder runs on another machine: only its heartbeat, by the store's clock, tells."""
    _plant_lock(run_dir, ELSEWHERE)
    with pytest.raises(RunDirBusyError) as refused:
        RunLock(ObjectPath(run_dir.url, run_dir.local)).acquire()
    message = str(refused.value)
    assert f"{run_dir.url} is in use by another job: host node17, pid 4242, job 81234" in message
    assert f"recorded in {run_dir.url}/{LOCK_FILE}" in message
    assert _lock_token(run_dir) == ELSEWHERE.token
    assert _objects(run_dir) == [f"{run_dir.name}/{LOCK_FILE}"]


def test_a_stale_lock_on_an_object_store_is_taken_over_by_exactly_one_of_two_racing_jobs(
    run_dir: ObjectPath, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dead job's record reads as an hour old; both jobs judge it dead before either
    replaces it."""
    _plant_lock(run_dir, ELSEWHERE)
    read = run_lock._read

    def dead_job_s_record_an_hour_old(store, path):
        found = read(store, path)
        if found is not None and found[0].token == ELSEWHERE.token:
            return found[0], found[1] - 3600
        return found

    monkeypatch.setattr(run_lock, "_read", dead_job_s_record_an_hour_old)
    locks = [RunLock(run_dir), RunLock(run_dir)]
    outcomes = race(locks, monkeypatch)
    winners = [index for index, outcome in outcomes.items() if outcome == "won"]
    try:
        assert len(winners) == 1 and len(outcomes) == 2, outcomes
        winner = locks[winners[0]]
        assert winner.replaced is not None and winner.replaced[0] == ELSEWHERE
        assert f"pid {winner.me.pid}" in outcomes[1 - winners[0]]
        assert _lock_token(run_dir) == winner.me.token
        assert _objects(run_dir) == [f"{run_dir.name}/{LOCK_FILE}"]
    finally:
        for index in winners:
            locks[index].release()


def test_releasing_the_lock_removes_it_from_the_object_store(run_dir: ObjectPath) -> None:
    lock = RunLock(run_dir)
    lock.acquire()
    assert _lock_token(run_dir) == lock.me.token
    lock.release()
    assert _objects(run_dir) == []


def test_an_object_store_out_of_reach_refuses_the_lock_saying_what_to_check(
    run_dir: ObjectPath, store_out_of_reach: None
) -> None:
    with (
        pytest.raises(RunDirBusyError, match=r"cannot take the lock .*credentials"),
        owned_run_dir(run_dir, DistEnv()),
    ):
        pass


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("s3://AKIAEXAMPLE:hunter2@bucket/run", "credentials must not be written in run.dir"),
        ("ftp://host/run", "unknown scheme ftp://"),
        ("s3://", "names no bucket"),
    ],
)
def test_run_dir_url_is_refused_by_name(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as refused:
        load_config(None, [f"run.dir={url}"])
    assert "hunter2" not in str(refused.value) and "AKIAEXAMPLE" not in str(refused.value)


def test_run_dir_url_without_its_extra_names_the_pip_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(storage_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[gcs\]'"):
        load_config(None, ["run.dir=gs://bucket/run"])
