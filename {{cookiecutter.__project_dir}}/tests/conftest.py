"""Fixtures shared by the tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from {{ cookiecutter.package_name }}.config import Config, load_config

from .helpers import FAST


@pytest.fixture
def fast_config(tmp_path: Path) -> Config:
    """A small config whose run directory lives in the test's tmp_path."""
    return load_config(None, [*FAST, f"run.dir={tmp_path / 'run'}"])
