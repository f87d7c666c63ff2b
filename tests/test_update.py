"""Generated projects take template updates with cruft, and keep their own changes.

A copy of the template becomes a git repository; a project is created from it with
`cruft create`, and the project's owner commits changes of their own. The template then
changes, and `cruft update` brings its change into the project next to the owner's, as the
generated README's "Updating from the template" section describes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from matrix import ROOT

TEMPLATE_PROJECT = Path("{{cookiecutter.__project_dir}}")
PACKAGE = "ddp_project"
#: The owner's changes to the generated project.
USER_TASK_LINE = "# Our data set replaces the blobs in the next release."
USER_FILE = "notes/data.md"
USER_README_LINE = "Owned by the vision team."
#: The template's change between the two commits.
TEMPLATE_README_LINE = "A line the next template release adds to the README."
TEMPLATE_SOURCE_LINE = "# A line the next template release adds to the process group module."
#: An answer that differs from the default: updates must keep it.
ANSWERS = {"slurm_partition": "gpu", "tracker": "none"}
#: Commits need an author; the machine's git configuration must not matter.
GIT_ENV = {
    "GIT_AUTHOR_NAME": "Template Test",
    "GIT_AUTHOR_EMAIL": "template-test@example.com",
    "GIT_COMMITTER_NAME": "Template Test",
    "GIT_COMMITTER_EMAIL": "template-test@example.com",
    "GIT_CONFIG_GLOBAL": os.devnull,
}


def run(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run a command with a fixed git identity; its output stays readable in the test log."""
    result = subprocess.run(
        command,
        cwd=cwd,
        env={**os.environ, **GIT_ENV, "NO_COLOR": "1", "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    print(f"$ {' '.join(command)}  (exit {result.returncode})\n{result.stdout}{result.stderr}")
    return result


def git(*args: str, cwd: Path) -> str:
    result = run(["git", *args], cwd)
    assert result.returncode == 0, result.stderr
    return result.stdout


def cruft(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, "-m", "cruft", *args], cwd)


def copy_template(destination: Path) -> None:
    """The template as it is in the working tree: tracked and new files, none that git ignores."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)


@dataclass(frozen=True)
class Update:
    """A project created from the template's first commit, then updated to its second."""

    project: Path
    before: dict
    check_before: subprocess.CompletedProcess[str]
    update: subprocess.CompletedProcess[str]
    check_after: subprocess.CompletedProcess[str]


@dataclass(frozen=True)
class Template:
    """A git repository of the template, and its first commit."""

    path: Path
    first_commit: str


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Template:
    if shutil.which("git") is None:
        pytest.skip("cruft needs git, which is not installed")
    path = tmp_path_factory.mktemp("template")
    copy_template(path)
    git("init", "--quiet", "--initial-branch=main", cwd=path)
    git("add", ".", cwd=path)
    git("commit", "--quiet", "-m", "Template release 1", cwd=path)
    return Template(path, git("rev-parse", "HEAD", cwd=path).strip())


@pytest.fixture(scope="module")
def updated(template: Template, tmp_path_factory: pytest.TempPathFactory) -> Update:
    output = tmp_path_factory.mktemp("output")
    created = cruft(
        "create",
        str(template.path),
        "--checkout",
        template.first_commit,
        "--no-input",
        "--output-dir",
        str(output),
        "--extra-context",
        json.dumps(ANSWERS),
        cwd=output,
    )
    assert created.returncode == 0, created.stderr
    project = output / "ddp-project"
    git("init", "--quiet", "--initial-branch=main", cwd=project)
    git("add", ".", cwd=project)
    git("commit", "--quiet", "-m", "Generated from the template", cwd=project)
    before = json.loads((project / ".cruft.json").read_text())

    task = project / "src" / PACKAGE / "task.py"
    task.write_text(task.read_text() + USER_TASK_LINE + "\n")
    readme = project / "README.md"
    title, rest = readme.read_text().split("\n", 1)
    readme.write_text(f"{title}\n\n{USER_README_LINE}\n{rest}")
    (project / USER_FILE).parent.mkdir()
    (project / USER_FILE).write_text("Where our data set lives.\n")
    git("add", ".", cwd=project)
    git("commit", "--quiet", "-m", "Our changes", cwd=project)

    readme = template.path / TEMPLATE_PROJECT / "README.md"
    readme.write_text(readme.read_text() + "\n" + TEMPLATE_README_LINE + "\n")
    source = (
        template.path
        / TEMPLATE_PROJECT
        / "src/{{cookiecutter.package_name}}/cluster/distributed.py"
    )
    source.write_text(source.read_text() + TEMPLATE_SOURCE_LINE + "\n")
    git("commit", "--quiet", "-am", "Template release 2", cwd=template.path)

    check_before = cruft("check", cwd=project)
    update = cruft("update", "--skip-apply-ask", "--allow-untracked-files", cwd=project)
    git("add", ".", cwd=project)
    git("commit", "--quiet", "-m", "Template release 2", cwd=project)
    check_after = cruft("check", cwd=project)
    return Update(project, before, check_before, update, check_after)


def test_cruft_create_records_the_template_commit_and_the_answers(updated: Update) -> None:
    recorded = updated.before["context"]["cookiecutter"]
    assert len(updated.before["commit"]) == 40
    assert recorded["_commit"] == updated.before["commit"]
    assert {key: recorded[key] for key in ANSWERS} == ANSWERS


def test_cruft_check_fails_while_the_template_has_a_newer_commit(updated: Update) -> None:
    assert updated.check_before.returncode != 0
    assert "out of date" in updated.check_before.stdout


def test_cruft_update_succeeds(updated: Update) -> None:
    assert updated.update.returncode == 0, updated.update.stderr
    assert not list(updated.project.rglob("*.rej"))


def test_update_brings_the_template_change(updated: Update) -> None:
    assert TEMPLATE_README_LINE in (updated.project / "README.md").read_text()
    source = updated.project / "src" / PACKAGE / "cluster" / "distributed.py"
    assert source.read_text().endswith(TEMPLATE_SOURCE_LINE + "\n")


def test_update_keeps_the_owners_changes(updated: Update) -> None:
    assert USER_TASK_LINE in (updated.project / "src" / PACKAGE / "task.py").read_text()
    assert (updated.project / USER_FILE).is_file()
    assert USER_README_LINE in (updated.project / "README.md").read_text()


def test_update_keeps_the_answers(updated: Update) -> None:
    after = json.loads((updated.project / ".cruft.json").read_text())
    assert after["commit"] != updated.before["commit"]
    assert after["context"]["cookiecutter"] | {"_commit": None} == updated.before["context"][
        "cookiecutter"
    ] | {"_commit": None}
    sbatch = (updated.project / "launch" / "slurm" / "train.sbatch").read_text()
    assert "#SBATCH --partition=gpu\n" in sbatch


def test_cruft_check_passes_after_the_update(updated: Update) -> None:
    assert updated.check_after.returncode == 0, updated.check_after.stdout


def test_project_from_plain_cookiecutter_links_to_its_template_commit(
    template: Template, tmp_path: Path
) -> None:
    """The README's recipe: the answers in .cookiecutter.json and the release the project came
    from link it to the template, and cruft then finds no difference to that commit."""
    release = tmp_path / "release"
    git("clone", "--quiet", str(template.path), str(release), cwd=tmp_path)
    git("checkout", "--quiet", template.first_commit, cwd=release)
    rendered = run([sys.executable, "-m", "cookiecutter", "--no-input", str(release)], tmp_path)
    assert rendered.returncode == 0, rendered.stderr
    project = tmp_path / "ddp-project"
    answers = json.loads((project / ".cookiecutter.json").read_text())["cookiecutter"]
    linked = cruft(
        "link",
        str(template.path),
        "--checkout",
        template.first_commit,
        "--no-input",
        "--extra-context",
        json.dumps(answers),
        cwd=project,
    )
    assert linked.returncode == 0, linked.stderr
    record = json.loads((project / ".cruft.json").read_text())
    assert record["commit"] == template.first_commit
    difference = cruft("diff", "--exit-code", "--checkout", template.first_commit, cwd=project)
    assert difference.returncode == 0, difference.stdout
