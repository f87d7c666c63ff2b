"""Fixtures shared by the tests."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }}.config import Config, load_config

from .helpers import FAST


def _hide_gpus(patch: pytest.MonkeyPatch) -> None:
    """No GPU for the processes started from here (torchrun, train.py, the ranks of `spawn`),
    so dist.device=auto picks the CPU and gloo, as on a laptop, and two ranks never ask for two
    GPUs where there is one. In this process CUDA may already know the GPUs (test_gpu.py counts
    them as it is collected): torch.cuda answers instead."""
    patch.setenv("CUDA_VISIBLE_DEVICES", "")
    patch.setattr(torch.cuda, "is_available", lambda: False)
    patch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture(scope="module", autouse=True)
def cpu_in_modules_without_gpu_tests(request: pytest.FixtureRequest) -> Iterator[None]:
    """The CPU suite runs on CPUs on a GPU machine too. A module's own fixtures (a run shared
    by its tests) start before any of its tests: a module without a test marked `gpu` sees no
    GPU from its start to its end."""
    items = request.session.items
    module_items = [item for item in items if getattr(item, "module", None) is request.module]
    if any(item.get_closest_marker("gpu") for item in module_items):
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        _hide_gpus(patch)
        yield


@pytest.fixture(autouse=True)
def cpu_unless_marked_gpu(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a module with GPU tests, each test not marked `gpu` sees no GPU either."""
    if request.node.get_closest_marker("gpu") is None:
        _hide_gpus(monkeypatch)


@pytest.fixture
def fast_config(tmp_path: Path) -> Config:
    """A small config whose run directory lives in the test's tmp_path."""
    return load_config(None, [*FAST, f"run.dir={tmp_path / 'run'}"])


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A real S3-compatible server (moto's) on a free port, for the whole session."""
    pytest.importorskip("s3fs", reason="the s3 extra is not installed: pip install -e '.[s3]'")
    server_module = pytest.importorskip(
        "moto.server", reason="moto's S3 server is not installed: pip install 'moto[server]'"
    )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


#: A secret access key the tests look for in everything a run writes.
S3_SECRET = "s3cr3t-never-written-anywhere"


@pytest.fixture
def s3_bucket(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A bucket on the test server, with credentials in the environment only (inherited by
    the processes a test starts). Returns its URL."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3_SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    if not fs.exists("runs"):
        fs.mkdir("runs")
    return "s3://runs"
