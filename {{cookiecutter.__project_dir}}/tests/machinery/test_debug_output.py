"""`dist.debug`: the variables every rank gets before its process group starts, NCCL's log in
the run directory, and torch.distributed's debug level."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from {{ cookiecutter.package_name }}.cluster.debug_output import debug_dir, turn_on
from {{ cookiecutter.package_name }}.config import load_config

pytestmark = pytest.mark.standalone


@pytest.fixture(autouse=True)
def debug_level_restored() -> Iterator[None]:
    """torch keeps the level for the process: the other tests run at theirs."""
    level = dist.get_debug_level()
    yield
    dist.set_debug_level(level)


def test_it_is_off_by_default() -> None:
    assert load_config().dist.debug is False


def test_nccl_logs_into_the_run_directory_and_torch_distributed_debugs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    environ: dict[str, str] = {}
    with caplog.at_level(logging.INFO):
        turn_on(debug_dir(tmp_path), 0, 0, environ)
    assert environ == {
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_FILE": f"{tmp_path}/debug/nccl.%h.%p.log",
        "TORCH_DISTRIBUTED_DEBUG": "INFO",
    }
    assert (tmp_path / "debug").is_dir()  # NCCL does not create it
    assert "TORCH_CPP_LOG_LEVEL=INFO exported before the launch" in caplog.text


def test_what_the_user_exported_is_kept_and_torch_reads_it_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """torch read TORCH_DISTRIBUTED_DEBUG when imported: it takes the value anew."""
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "INFO")
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.setenv("NCCL_DEBUG_FILE", str(tmp_path / "mine.%p"))
    with caplog.at_level(logging.INFO):
        turn_on(debug_dir(tmp_path), 0, 0)
    assert dist.get_debug_level() == dist.DebugLevel.INFO
    assert not (tmp_path / "debug").exists()
    assert "kept as exported NCCL_DEBUG=WARN" in caplog.text
