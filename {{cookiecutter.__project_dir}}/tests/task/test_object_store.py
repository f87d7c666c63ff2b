"""Training with run.dir on an object store (an S3 server started by the tests) and
checkpoint.async: rank 0 is killed while its background thread uploads a checkpoint, and
torchrun's restart, on another local directory (as on another node), resumes from the
previous checkpoint, continues metrics.jsonl and ends with the weights of an unbroken
synchronous run on a local directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }}.checkpointing.checkpoint import load_checkpoint
from {{ cookiecutter.package_name }}.checkpointing.layout import latest_checkpoint
from {{ cookiecutter.package_name }}.checkpointing.storage import run_location, storage_of
from {{ cookiecutter.package_name }}.config import load_config
from {{ cookiecutter.package_name }}.monitoring.metrics import read_metrics

from ..conftest import S3_SECRET
from ..helpers import (
    FAST,
    TRAINING_LOSS,
    env_for,
    make_trainer,
    run_torchrun,
    spawn,
    write_fault_entry,
)

pytestmark = [pytest.mark.distributed, pytest.mark.faults, pytest.mark.timeout(300)]

TOTAL_STEPS = 12
#: In the first attempt, rank 0 dies while its background thread uploads the replicated state
#: of step 8, after every rank has uploaded its own file; every attempt keeps its logs and
#: metrics in a local directory of its own, empty at its start.
KILLED_MID_UPLOAD = """
import sys
import threading

from {{ cookiecutter.package_name }}.checkpointing import storage

attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
sys.argv.append(f"run.local_dir={local_base}-" + attempt)
write = storage.ObjectStorage.write


def killed_mid_upload(self, path, fill):
    if attempt == "0" and path.name == checkpoint.STATE_FILE and "step_00000008" in str(path):
        def half_then_killed(handle):
            fill(handle)
            print("killed uploading in", threading.current_thread().name, file=sys.stderr)
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # before the upload completes

        return write(self, path, half_then_killed)
    return write(self, path, fill)


storage.ObjectStorage.write = killed_mid_upload
"""


def _losses(records: list[dict]) -> list[tuple]:
    return [(r["step"], r.get(TRAINING_LOSS), r.get("eval/loss")) for r in records]


def _unbroken(rank: int, world_size: int, run_dir: Path) -> None:
    config = load_config(None, [*FAST, f"train.max_steps={TOTAL_STEPS}", f"run.dir={run_dir}"])
    make_trainer(config, env_for(rank, world_size)).fit()


def test_a_rank_killed_mid_upload_in_the_background_resumes_like_an_unbroken_run(
    s3_bucket: str, tmp_path: Path
) -> None:
    """The restart runs with an empty local directory, as on another node."""
    unbroken = tmp_path / "unbroken"
    spawn(2, _unbroken, unbroken, workdir=tmp_path / "spawn")

    url = f"{s3_bucket}/killed-mid-upload"
    fault = KILLED_MID_UPLOAD.replace("{local_base}", str(tmp_path / "local"))
    entry = write_fault_entry(tmp_path, fault)
    settings = [*FAST, f"train.max_steps={TOTAL_STEPS}", "checkpoint.async=true"]
    result = run_torchrun(2, [*settings, f"run.dir={url}"], entry=entry, max_restarts=1)

    assert result.returncode == 0, result.stderr[-4000:]
    assert "killed uploading in checkpoint-writer" in result.stderr
    resumed = tmp_path / "local-1"
    log = (resumed / "train.log").read_text()
    assert "removed s3://runs/killed-mid-upload/checkpoints/step_00000008" in log
    assert "resumed from s3://runs/killed-mid-upload/checkpoints/step_00000004" in log
    run_dir = run_location(url, str(resumed))
    final = load_checkpoint(latest_checkpoint(run_dir), rank=0, world_size=2)
    expected = load_checkpoint(latest_checkpoint(unbroken), rank=0, world_size=2)
    assert final.state["step"] == TOTAL_STEPS
    for name, tensor in expected.state["model"].items():
        assert torch.equal(final.state["model"][name], tensor), name
    # The empty local directory continued the checkpoint's metrics: every step, once.
    assert _losses(read_metrics(resumed)) == _losses(read_metrics(unbroken))
    store = storage_of(run_dir)
    for path in store.fs.find(url):
        assert S3_SECRET.encode() not in store.fs.cat_file(path), path
    for path in resumed.rglob("*"):
        assert path.is_dir() or S3_SECRET.encode() not in path.read_bytes(), path
