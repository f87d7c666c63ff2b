"""The rendered default project installs into the test environment and passes its own suite."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest
from cookiecutter.main import cookiecutter

ROOT = Path(__file__).resolve().parents[1]
TWO_RANK_TEST = "test_two_ranks_train_checkpoint_and_resume"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def installed_default_project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Render the default project and install it (editable, no downloads); uninstall afterwards."""
    out = tmp_path_factory.mktemp("default")
    project = Path(cookiecutter(str(ROOT), no_input=True, output_dir=str(out)))
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation"]
    subprocess.run([*pip, "-e", str(project)], check=True)
    yield project
    subprocess.run(
        [sys.executable, "-m", "pip", "uninstall", "--quiet", "-y", project.name], check=True
    )


def test_default_project_suite_passes_with_two_gloo_ranks(installed_default_project: Path) -> None:
    """The project's own pytest run passes, and its 2-process gloo test ran rather than skipped."""
    report = installed_default_project / "report.xml"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"],
        cwd=installed_default_project,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    cases = {case.get("name"): case for case in ET.parse(report).iter("testcase")}
    two_rank = cases[TWO_RANK_TEST]
    assert two_rank.find("skipped") is None and two_rank.find("failure") is None
    gpu_cases = [case for name, case in cases.items() if "gpu" in name]
    assert gpu_cases, "the NCCL tests must be collected"
