"""Rendered projects pass their own test suites, including real 2-process gloo training.

The default project is installed into the test environment, exactly as a user installs it. The
other projects of a pairwise cover (every pair of option values appears in at least one of them)
run from their source trees, so that several can share this environment side by side.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest
from cookiecutter.main import cookiecutter
from matrix import DEFAULTS, ROOT, combo_id, pairwise_cover

TWO_RANK_TEST = "test_two_ranks_train_checkpoint_and_resume"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def run_project_suite(project: Path, env: dict[str, str], *options: str) -> dict[str, ET.Element]:
    """Run the project's pytest; fail with its output unless it passes. Returns its test cases."""
    report = project / "report.xml"
    pytest_command = ["-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
    result = subprocess.run(
        [sys.executable, *pytest_command, *options],
        cwd=project,
        env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", **env},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    return {case.get("name"): case for case in ET.parse(report).iter("testcase")}


def assert_two_ranks_ran(cases: dict[str, ET.Element]) -> None:
    two_rank = cases[TWO_RANK_TEST]
    assert two_rank.find("skipped") is None and two_rank.find("failure") is None
    assert any("gpu" in name for name in cases), "the NCCL tests must be collected"


@pytest.fixture(scope="module")
def installed_default_project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Render the default project and install it (editable, no downloads); uninstall afterwards."""
    out = tmp_path_factory.mktemp("default")
    project = Path(cookiecutter(str(ROOT), no_input=True, output_dir=str(out)))
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation"]
    subprocess.run([*pip, "-e", str(project)], check=True)
    yield project
    uninstall = [sys.executable, "-m", "pip", "uninstall", "--quiet", "--yes", project.name]
    subprocess.run(uninstall, check=True)


def test_default_project_suite_passes_with_two_gloo_ranks(installed_default_project: Path) -> None:
    """The installed default project's suite passes, and its 2-process gloo test really ran."""
    assert_two_ranks_ran(run_project_suite(installed_default_project, env={}))


COVER = [combo for combo in pairwise_cover() if combo != DEFAULTS]


@pytest.mark.parametrize("combo", COVER, ids=combo_id)
def test_project_suite_passes_for_a_pairwise_cover_of_options(combo: dict, tmp_path: Path) -> None:
    """Each project of the cover passes its own suite from its source tree."""
    # A package name of its own, so that no other installed project can shadow it.
    context = {**combo, "project_name": f"Cover {COVER.index(combo) + 1}"}
    project = Path(
        cookiecutter(str(ROOT), no_input=True, output_dir=str(tmp_path), extra_context=context)
    )
    # The fault tests (crashes, hangs, restarts under torchrun) exercise code that no option
    # changes; the default project runs them, the cover runs everything else.
    env = {"PYTHONPATH": str(project / "src")}
    assert_two_ranks_ran(run_project_suite(project, env, "-m", "not faults"))
