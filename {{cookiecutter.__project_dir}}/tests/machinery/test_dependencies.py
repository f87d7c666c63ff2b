"""A package the project needs and the environment lacks is named in one line with the command
that installs it (exit 2), before any command imports it: what a template update that adds a
dependency leaves until the project is installed again."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from {{ cookiecutter.package_name }} import cli, dependencies

pytestmark = pytest.mark.standalone

PACKAGE = "{{ cookiecutter.package_name }}"
ABSENT = "a-package-nobody-installed>=1"


def test_the_project_finds_what_it_declares_installed_here() -> None:
    declared = dependencies.declared()
    assert any(requirement.startswith("torch") for requirement in declared)
    assert dependencies.missing(declared) == []


def test_an_absent_package_is_missing_and_an_installed_one_is_not() -> None:
    assert dependencies.missing(["pyyaml>=6", ABSENT]) == [ABSENT]


@pytest.fixture
def source_tree_lacking_a_package(tmp_path: Path) -> Path:
    """A copy of the project's package and pyproject.toml that declares one package more, as
    pyproject.toml does after an update until the project is installed again."""
    pyproject = (dependencies.SOURCE_TREE / "pyproject.toml").read_text()
    assert "dependencies = [\n" in pyproject
    pyproject = pyproject.replace("dependencies = [\n", f'dependencies = [\n    "{ABSENT}",\n', 1)
    (tmp_path / "pyproject.toml").write_text(pyproject)
    shutil.copytree(Path(dependencies.__file__).parent, tmp_path / "src" / PACKAGE)
    return tmp_path


@pytest.mark.parametrize(
    "command",
    [
        ["-m", f"{PACKAGE}.train", "train.max_steps=1"],
        ["-m", f"{PACKAGE}.launch", "--standalone", "--nproc-per-node=1", "-m", f"{PACKAGE}.train"],
    ],
    ids=["train", "launch"],
)
def test_a_command_without_a_package_it_needs_says_so_in_one_line(
    source_tree_lacking_a_package: Path, command: list[str]
) -> None:
    project = source_tree_lacking_a_package
    result = subprocess.run(
        [sys.executable, *command],
        cwd=project,
        env={**os.environ, "PYTHONPATH": str(project / "src")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "error: this project needs a-package-nobody-installed, which this environment lacks: "
        "pip install -e ."
    ]


def test_the_console_command_checks_before_it_imports_the_training(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(dependencies, "declared", lambda: [ABSENT])
    with pytest.raises(SystemExit) as exit_:
        cli.train_command()
    assert exit_.value.code == 2
    assert "needs a-package-nobody-installed" in capsys.readouterr().err
