"""The writer of checkpoints in the background, in one process with a fake write: the copy of
the state is independent of training, one save at a time, and a failure is raised where the
ranks wait."""

from __future__ import annotations

import errno
import threading
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }}.checkpointing.background_save import BackgroundSaver, CompletedSave, HostCopy
from {{ cookiecutter.package_name }}.checkpointing.checkpoint import CheckpointSaveError

pytestmark = [pytest.mark.standalone, pytest.mark.timeout(60)]


def test_the_copy_keeps_its_values_while_training_changes_the_live_state() -> None:
    weight = torch.ones(4)
    state = {"model": {"weight": weight}, "history": [1.0], "step": 3}
    copied = HostCopy(pin_memory=False).take(state)
    weight.add_(1)
    state["history"].append(2.0)
    assert torch.equal(copied["model"]["weight"], torch.ones(4))
    assert copied["history"] == [1.0]
    assert copied["step"] == 3


def test_tensors_that_share_memory_share_it_in_the_copy() -> None:
    """Tied weights are written once, as torch.save writes the live state."""
    shared = torch.arange(6.0)
    copied = HostCopy(pin_memory=False).take({"a": shared, "b": shared.view(2, 3), "c": shared[2:]})
    assert copied["a"].untyped_storage().data_ptr() == copied["b"].untyped_storage().data_ptr()
    assert copied["c"].untyped_storage().data_ptr() == copied["a"].untyped_storage().data_ptr()
    assert torch.equal(copied["c"], torch.arange(2.0, 6.0))
    assert copied["a"].untyped_storage().data_ptr() != shared.untyped_storage().data_ptr()


def test_a_state_dicts_type_and_metadata_are_kept() -> None:
    module_state = torch.nn.BatchNorm1d(2).state_dict()
    copied = HostCopy(pin_memory=False).take(module_state)
    assert type(copied) is OrderedDict
    assert copied._metadata == module_state._metadata  # type: ignore[attr-defined]


def test_the_next_copy_reuses_the_host_buffers_of_the_previous_one() -> None:
    host = HostCopy(pin_memory=False)
    first = host.take({"weight": torch.zeros(8)})
    second = host.take({"weight": torch.ones(8)})
    assert (
        second["weight"].untyped_storage().data_ptr()
        == first["weight"].untyped_storage().data_ptr()
    )
    assert torch.equal(second["weight"], torch.ones(8))


def test_the_next_save_waits_until_the_one_in_flight_is_written() -> None:
    """At most one write at a time, whatever the threads' timing: the first write is released
    only from a timer, while the second save is being started."""
    saver = BackgroundSaver(pin_memory=False, timeout_s=60)
    release = threading.Event()
    running, most_running, events = [0], [0], []

    def write(step: int):
        def run(snapshot: object) -> Path:
            running[0] += 1
            most_running[0] = max(most_running[0], running[0])
            events.append(f"write {step}")
            if step == 1:
                release.wait(timeout=30)
            running[0] -= 1
            return Path(f"step_{step}")

        return run

    def done(completed: CompletedSave) -> None:
        events.append(f"done {completed.step}")

    saver.start(1, {"step": 1}, write(1), done)
    timer = threading.Timer(0.2, release.set)
    timer.start()
    saver.start(2, {"step": 2}, write(2), done)
    saver.wait()
    timer.join()
    assert most_running[0] == 1
    assert events == ["write 1", "done 1", "write 2", "done 2"]


def test_what_follows_a_complete_save_runs_on_the_training_thread_once() -> None:
    saver = BackgroundSaver(pin_memory=False, timeout_s=60)
    threads: list[str] = []
    saver.start(1, {}, lambda snapshot: Path("step_1"), lambda _: threads.append(_name()))
    saver.wait()
    saver.wait()
    saver.poll()
    assert threads == [threading.main_thread().name]


def _name() -> str:
    return threading.current_thread().name


def test_a_failed_write_is_raised_at_the_next_wait_not_between_steps() -> None:
    saver = BackgroundSaver(pin_memory=False, timeout_s=60)
    finished = threading.Event()
    completed: list[CompletedSave] = []

    def full_disk(snapshot: object) -> Path:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        finally:
            finished.set()

    saver.start(8, {}, full_disk, completed.append)
    finished.wait(timeout=30)
    saver.poll()  # between steps: nothing is raised, nothing follows
    with pytest.raises(CheckpointSaveError, match=r"step 8, written in the background, failed"):
        saver.wait()
    assert completed == []
    saver.wait()  # reported once; the next save starts afresh
    saver.start(9, {}, lambda snapshot: Path("step_9"), completed.append)
    saver.wait()
    assert [save.step for save in completed] == [9]


def test_a_failed_collective_save_is_raised_as_it_is_on_every_rank() -> None:
    """save_checkpoint's own error is the same on every rank: it is raised unchanged."""
    saver = BackgroundSaver(pin_memory=False, timeout_s=60)
    error = CheckpointSaveError("cannot save checkpoint step_00000004 (rank 1: full)")

    def failing(snapshot: object) -> Path:
        raise error

    saver.start(4, {}, failing, lambda _: None)
    with pytest.raises(CheckpointSaveError) as raised:
        saver.start(5, {}, lambda snapshot: Path("step_5"), lambda _: None)
    assert raised.value is error
