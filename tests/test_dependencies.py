"""The versions a rendered project declares are the ones the template is tested with, its
dependency update bots are configured validly, and it installs with uv as well as pip.

requirements-test.txt is the source: the template's tests run with its torch and ruff, so the
Docker image ships that torch, pyproject.toml allows no older one, and every ruff pin equals it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from cookiecutter.main import cookiecutter
from matrix import ROOT

BIN = Path(sys.executable).parent
REQUIREMENTS = (ROOT / "requirements-test.txt").read_text()
#: Where a project of each kind of CI keeps its dependency update configuration.
UPDATE_CONFIG = {"github": ".github/dependabot.yml", "gitlab": "renovate.json"}


def pinned(package: str) -> str:
    [version] = re.findall(rf"^{re.escape(package)}==(\S+)$", REQUIREMENTS, re.MULTILINE)
    return version


def release(version: str) -> str:
    """major.minor.patch, without a local build tag such as +cpu."""
    return version.split("+")[0]


@pytest.fixture(scope="module")
def github(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default project: GitHub Actions, Docker."""
    out = tmp_path_factory.mktemp("github")
    return Path(cookiecutter(str(ROOT), no_input=True, output_dir=str(out)))


@pytest.fixture(scope="module")
def gitlab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gitlab")
    context = {"ci": "gitlab", "use_docker": False}
    return Path(cookiecutter(str(ROOT), no_input=True, output_dir=str(out), extra_context=context))


# ---- torch ------------------------------------------------------------------------------------


def base_image_torch(text: str, keyword: str) -> str:
    """The torch release in the tag of the pytorch/pytorch image that `keyword` (FROM, From:)
    builds on."""
    [version] = re.findall(
        rf"^{keyword}\s+pytorch/pytorch:(\d+\.\d+\.\d+)-\S+$", text, re.MULTILINE
    )
    return version


def test_docker_image_ships_the_tested_torch(github: Path) -> None:
    dockerfile = (github / "Dockerfile").read_text()
    assert base_image_torch(dockerfile, "FROM") == release(pinned("torch"))


def test_apptainer_image_ships_the_tested_torch(github: Path) -> None:
    definition = (github / "apptainer.def").read_text()
    assert base_image_torch(definition, "From:") == release(pinned("torch"))


def test_torch_floor_is_the_tested_version(github: Path) -> None:
    """No torch older than the one the template's tests run with is allowed: an older one is
    untested (the project uses torch.amp.GradScaler(device), DDP's newer arguments, ...)."""
    dependencies = tomllib.loads((github / "pyproject.toml").read_text())["project"]
    [torch] = [spec for spec in dependencies["dependencies"] if spec.startswith("torch")]
    major, minor, _ = release(pinned("torch")).split(".")
    assert torch == f"torch>={major}.{minor},<{int(major) + 1}"


def test_ci_tests_the_oldest_and_the_newest_torch(github: Path, gitlab: Path) -> None:
    """The floor in pyproject.toml is tested by the project's own CI as well."""
    major, minor, _ = release(pinned("torch")).split(".")
    workflow = yaml.safe_load((github / ".github/workflows/ci.yml").read_text())
    github_torch = [
        job["torch"] for job in workflow["jobs"]["test"]["strategy"]["matrix"]["include"]
    ]
    pipeline = yaml.safe_load((gitlab / ".gitlab-ci.yml").read_text())
    gitlab_torch = [job["TORCH"] for job in pipeline["test"]["parallel"]["matrix"]]
    assert github_torch == gitlab_torch == [f"torch=={major}.{minor}.*", "torch"]


# ---- the demo's environment ------------------------------------------------------------------


def requirement_names(lines: list[str]) -> set[str]:
    """Distribution names, normalised (PEP 503), of requirement lines; comments skipped."""
    names = (re.match(r"[A-Za-z0-9._-]+", line.strip()) for line in lines)
    return {re.sub(r"[-_.]+", "-", name.group(0)).lower() for name in names if name}


def test_the_demo_environment_holds_what_the_default_project_needs(github: Path) -> None:
    """`make demo` installs requirements-demo.txt alone, at the versions the tests pin: the
    default project's dependencies, its build backend and cookiecutter."""
    demo = requirement_names((ROOT / "requirements-demo.txt").read_text().splitlines())
    project = tomllib.loads((github / "pyproject.toml").read_text())
    needed = requirement_names(
        [*project["project"]["dependencies"], *project["build-system"]["requires"], "cookiecutter"]
    )
    assert needed <= demo
    assert demo <= requirement_names(REQUIREMENTS.splitlines())


# ---- ruff -------------------------------------------------------------------------------------


def pre_commit_ruff(path: Path) -> str:
    config = yaml.safe_load(path.read_text())
    [repo] = [repo for repo in config["repos"] if repo["repo"].endswith("/ruff-pre-commit")]
    return repo["rev"].removeprefix("v")


def ci_ruff(text: str) -> str:
    [version] = re.findall(r'pip install "ruff==([^"]+)"', text)
    return version


def test_every_ruff_pin_is_the_tested_version(github: Path, gitlab: Path) -> None:
    dev = tomllib.loads((github / "pyproject.toml").read_text())["project"]
    dev_ruff = [spec for spec in dev["optional-dependencies"]["dev"] if spec.startswith("ruff")]
    pins = {
        "template .pre-commit-config.yaml": pre_commit_ruff(ROOT / ".pre-commit-config.yaml"),
        "project .pre-commit-config.yaml": pre_commit_ruff(github / ".pre-commit-config.yaml"),
        "project pyproject.toml": dev_ruff[0].removeprefix("ruff=="),
        "project ci.yml": ci_ruff((github / ".github/workflows/ci.yml").read_text()),
        "project .gitlab-ci.yml": ci_ruff((gitlab / ".gitlab-ci.yml").read_text()),
    }
    assert pins == dict.fromkeys(pins, pinned("ruff"))


def test_ci_checks_the_template_with_the_tested_cruft(github: Path, gitlab: Path) -> None:
    for ci in (github / ".github/workflows/ci.yml", gitlab / ".gitlab-ci.yml"):
        assert f'pip install "cruft=={pinned("cruft")}"' in ci.read_text()


# ---- dependency updates -----------------------------------------------------------------------


def validate(schema: str, path: Path) -> None:
    result = subprocess.run(
        [str(BIN / "check-jsonschema"), "--builtin-schema", schema, str(path)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dependabot_config_is_valid(github: Path) -> None:
    validate("vendor.dependabot", github / UPDATE_CONFIG["github"])


def test_dependabot_updates_packages_actions_and_the_base_image(github: Path) -> None:
    config = yaml.safe_load((github / UPDATE_CONFIG["github"]).read_text())
    ecosystems = [update["package-ecosystem"] for update in config["updates"]]
    assert ecosystems == ["pip", "github-actions", "docker"]


def test_dependabot_leaves_out_docker_without_a_dockerfile(tmp_path: Path) -> None:
    project = Path(
        cookiecutter(
            str(ROOT), no_input=True, output_dir=str(tmp_path), extra_context={"use_docker": False}
        )
    )
    config = yaml.safe_load((project / UPDATE_CONFIG["github"]).read_text())
    assert [update["package-ecosystem"] for update in config["updates"]] == [
        "pip",
        "github-actions",
    ]


def test_renovate_config_is_valid(gitlab: Path) -> None:
    validate("vendor.renovate", gitlab / UPDATE_CONFIG["gitlab"])


@pytest.mark.parametrize(("ci", "absent"), [("github", "renovate.json"), ("gitlab", ".github")])
def test_one_update_bot_per_ci(github: Path, gitlab: Path, ci: str, absent: str) -> None:
    project = {"github": github, "gitlab": gitlab}[ci]
    assert (project / UPDATE_CONFIG[ci]).is_file()
    assert not (project / absent).exists()


# ---- uv ---------------------------------------------------------------------------------------


def uv(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "uv"), *args],
        cwd=project,
        capture_output=True,
        text=True,
        # No uv.toml of this machine; its certificates and proxies (environment) are needed.
        env={**os.environ, "UV_NO_CONFIG": "1"},
        timeout=120,
    )


@pytest.fixture(scope="module")
def uv_lock(github: Path) -> Path:
    """The project's uv.lock, or a skip when PyPI cannot be reached (uv resolves against it)."""
    if shutil.which("uv", path=str(BIN)) is None:
        pytest.fail("uv is not installed: pip install -r requirements-test.txt")
    result = uv(github, "lock")
    if result.returncode != 0 and "Failed to fetch" in result.stderr:
        pytest.skip(f"PyPI cannot be reached, and uv resolves against it: {result.stderr[-300:]}")
    assert result.returncode == 0, result.stderr
    return github / "uv.lock"


def test_uv_resolves_the_project_and_its_dev_tools(uv_lock: Path) -> None:
    lock = tomllib.loads(uv_lock.read_text())
    names = {package["name"] for package in lock["package"]}
    assert {"ddp-project", "torch", "pyyaml", "pytest", "ruff", "pre-commit"} <= names


def test_uv_sync_would_install_the_dev_environment(uv_lock: Path) -> None:
    """`uv sync --extra dev`, planned without downloading torch."""
    result = uv(uv_lock.parent, "sync", "--extra", "dev", "--locked", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert re.search(r"^ \+ torch==", result.stderr, re.MULTILINE), result.stderr
    assert re.search(rf"^ \+ ruff=={re.escape(pinned('ruff'))}$", result.stderr, re.MULTILINE)
