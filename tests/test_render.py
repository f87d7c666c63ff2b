"""Every valid combination of options renders a clean, lint-free project.

The combinations come from cookiecutter.json (choice lists and booleans), filtered by the
`_invalid_combinations` table that the pre-generation hook enforces; nothing is listed by hand.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import re
import shutil
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path

import pytest
import yaml
from cookiecutter.main import cookiecutter
from matrix import CHOICES, ROOT, combo_id, valid_combinations

BIN = Path(sys.executable).parent
LEFTOVER_JINJA = ("{{ cookiecutter.", "{{cookiecutter.", "{%", "{#")
# One xdist group per combination: under `pytest -n`, a combination's checks share one render.
COMBINATIONS = [
    pytest.param(combo, id=combo_id(combo), marks=pytest.mark.xdist_group(combo_id(combo)))
    for combo in valid_combinations()
]


def expected_files(combo: dict, package: str = "ddp_project") -> set[str]:
    """The exact file set of a rendered project, written out independently of the hooks."""
    files = {
        ".cookiecutter.json",
        ".gitignore",
        ".pre-commit-config.yaml",
        "LICENSE",
        "Makefile",
        "README.md",
        "pyproject.toml",
        "configs/default.yaml",
        "launch/torchrun.sh",
        "tests/__init__.py",
        "tests/conftest.py",
        "tests/helpers.py",
        "benchmarks/allreduce.py",
        "benchmarks/overhead.py",
    }
    tests = ["amp", "benchmarks", "checkpoint", "config", "data", "distributed"]
    tests += ["distributed_env", "gpu"]
    tests += ["gradients", "ranks", "restart", "resume", "resume_checks", "sharding"]
    tests += ["stop_signal", "timeouts", "trainer"]
    files |= {f"tests/test_{name}.py" for name in tests}
    modules = ["checkpoint", "config", "data", "distributed", "logs", "metrics", "resume"]
    modules += ["stopping", "task", "train", "trainer", "__init__"]
    files |= {f"src/{package}/{name}.py" for name in modules}
    if combo["use_slurm"]:
        files.add("launch/slurm/train.sbatch")
    if combo["use_docker"]:
        files |= {"Dockerfile", ".dockerignore", "apptainer.def"}
    if combo["tracker"] != "none":
        files |= {f"src/{package}/tracker.py", "tests/test_tracker.py"}
    if combo["example"] == "gpt":
        files |= {f"src/{package}/gpt.py", "tests/test_gpt.py"}
        files |= {"configs/gpt-small.yaml", "configs/gpt2-124m.yaml"}
    if combo["ci"] == "github":
        files.add(".github/workflows/ci.yml")
    if combo["ci"] == "gitlab":
        files.add(".gitlab-ci.yml")
    return files


@pytest.fixture(scope="session")
def render_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("renders")


@cache
def _render(root: Path, key: str) -> Path:
    combo = json.loads(key)
    out = root / hashlib.sha1(key.encode()).hexdigest()[:12]
    return Path(cookiecutter(str(ROOT), no_input=True, output_dir=str(out), extra_context=combo))


def render(root: Path, combo: dict) -> Path:
    """Render once per combination and session; the tests below all read the same render."""
    return _render(root, json.dumps(combo, sort_keys=True))


def project_files(project: Path) -> set[str]:
    return {str(path.relative_to(project)) for path in project.rglob("*") if path.is_file()}


#: (command, content digest) pairs that passed: identical content is linted once per session.
_LINT_PASSED: set[tuple[str, ...]] = set()


def tool(name: str) -> str:
    """A linter from the test environment (requirements-test.txt)."""
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: pip install -r requirements-test.txt")
    return str(path)


def lint_once(command: list[str], path: Path) -> None:
    """Run a linter on one file unless identical content already passed the same command."""
    key = (*command, hashlib.sha1(path.read_bytes()).hexdigest())
    if key in _LINT_PASSED:
        return
    result = subprocess.run([*command, str(path)], capture_output=True, text=True)
    assert result.returncode == 0, f"{command[0]} {path.name}:\n{result.stdout}{result.stderr}"
    _LINT_PASSED.add(key)


@pytest.mark.parametrize("combo", COMBINATIONS)
class TestEveryCombination:
    def test_records_every_answer(self, render_root: Path, combo: dict) -> None:
        """Each option given arrives in the project's recorded answers (no silent typo)."""
        project = render(render_root, combo)
        answers = json.loads((project / ".cookiecutter.json").read_text())["cookiecutter"]
        assert {key: answers[key] for key in combo} == combo

    def test_has_exactly_the_expected_files(self, render_root: Path, combo: dict) -> None:
        assert project_files(render(render_root, combo)) == expected_files(combo)

    def test_has_no_leftover_jinja(self, render_root: Path, combo: dict) -> None:
        project = render(render_root, combo)
        for path in project.rglob("*"):
            if path.is_file():
                text = path.read_text()
                assert not [mark for mark in LEFTOVER_JINJA if mark in text], path

    def test_python_compiles(self, render_root: Path, combo: dict) -> None:
        for path in render(render_root, combo).rglob("*.py"):
            ast.parse(path.read_text(), filename=str(path))

    def test_data_files_parse(self, render_root: Path, combo: dict) -> None:
        """YAML, TOML and JSON files all load."""
        project = render(render_root, combo)
        for path in project.rglob("*"):
            if path.suffix in {".yaml", ".yml"}:
                yaml.safe_load(path.read_text())
            elif path.suffix == ".toml":
                tomllib.loads(path.read_text())
            elif path.suffix == ".json":
                json.loads(path.read_text())

    def test_passes_ruff_check_and_format(self, render_root: Path, combo: dict) -> None:
        """The project is formatted exactly as its own ruff configuration formats it."""
        project = render(render_root, combo)
        py = sorted(project.rglob("*.py"))
        digest = hashlib.sha1(
            b"".join(path.read_bytes() for path in [*py, project / "pyproject.toml"])
        ).hexdigest()
        if ("ruff", digest) in _LINT_PASSED:
            return
        for command in (["check", "--no-cache"], ["format", "--check", "--no-cache"]):
            result = subprocess.run(
                [tool("ruff"), *command, "."], cwd=project, capture_output=True, text=True
            )
            assert result.returncode == 0, result.stdout + result.stderr
        _LINT_PASSED.add(("ruff", digest))

    def test_shell_scripts_pass_shellcheck(self, render_root: Path, combo: dict) -> None:
        project = render(render_root, combo)
        for path in [*project.rglob("*.sh"), *project.rglob("*.sbatch")]:
            lint_once([tool("shellcheck")], path)

    def test_dockerfile_passes_hadolint(self, render_root: Path, combo: dict) -> None:
        dockerfile = render(render_root, combo) / "Dockerfile"
        if combo["use_docker"]:
            lint_once([tool("hadolint")], dockerfile)
        else:
            assert not dockerfile.exists()

    def test_apptainer_definition_builds_from_the_dockerfile_image(
        self, render_root: Path, combo: dict
    ) -> None:
        """No Apptainer linter installs here: check the header, the sections and that every
        path copied into the image exists."""
        project = render(render_root, combo)
        if not combo["use_docker"]:
            assert not (project / "apptainer.def").exists()
            return
        header, sections = parse_definition((project / "apptainer.def").read_text())
        image = re.search(r"^FROM (\S+)", (project / "Dockerfile").read_text(), re.MULTILINE)
        assert header == {"Bootstrap": "docker", "From": image.group(1)}
        assert {"files", "post", "runscript"} <= set(sections) <= APPTAINER_SECTIONS
        for line in sections["files"]:
            assert (project / line.split()[0]).exists(), line

    def test_ci_configuration_matches_its_schema(self, render_root: Path, combo: dict) -> None:
        """GitHub and GitLab files validate against the services' published schemas."""
        project = render(render_root, combo)
        schemas = {
            "github": (".github/workflows/ci.yml", "vendor.github-workflows"),
            "gitlab": (".gitlab-ci.yml", "vendor.gitlab-ci"),
        }
        if combo["ci"] in schemas:
            path, schema = schemas[combo["ci"]]
            lint_once([tool("check-jsonschema"), "--builtin-schema", schema], project / path)


APPTAINER_SECTIONS = {"help", "labels", "files", "post", "environment", "runscript", "test"}


def parse_definition(text: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    """An Apptainer definition file: its header (key: value) and its %sections' lines."""
    header: dict[str, str] = {}
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("%"):
            current = sections.setdefault(stripped[1:].split()[0], [])
        elif current is not None:
            if stripped and not stripped.startswith("#"):
                current.append(stripped)
        elif stripped and not stripped.startswith("#"):
            key, _, value = stripped.partition(":")
            header[key.strip()] = value.strip()
    return header, sections


def test_matrix_covers_every_value_and_leaves_out_the_refused_combinations() -> None:
    combos = valid_combinations()
    for name, values in CHOICES.items():
        assert {combo[name] for combo in combos} == set(values), name
    assert 0 < len(combos) < math.prod(len(values) for values in CHOICES.values())
