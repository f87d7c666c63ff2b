"""Projects made from each release of the template take this one in with cruft, keeping their
owner's changes, their runs and their tests.

A release is the commit that added its version heading to CHANGELOG.md (README: "Releases");
a clone of this repository holds them, so a shallow clone fails here, saying so. For each
release a project is created with `cruft create --checkout <that commit>`, changed as its owner
changes one (EDITS: their task.py, a field of their TaskConfig changed and one added, a value of
their config), installed and trained a few steps. It is then updated to the template as this
working tree has it (committed on top of the history), as docs/updating.md says, and the
CHANGELOG's steps for a project that updates are applied as its owner applies them
(`apply_changelog_steps`): every file the update leaves (`*.rej`, a config.py of the owner's)
must be one that those steps name. The project is installed again, resumes its old checkpoint
with its console command, and runs its own tests/task.

The update from the newest release runs the whole of tests/task but the fault tests (the
default project runs those, tests/test_project_suite.py): since the updated project is checked
to be a fresh render plus the owner's changes, file by file, these are the rendered project's
task tests, trained on the owner's task. Updates from older releases run the resume tests.
Every step runs in a virtual environment of the project's own whose base is the test
environment, so installing the project changes nothing else.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from cookiecutter.main import cookiecutter
from matrix import ROOT
from test_project_suite import assert_whole_suite_ran, run_project_suite

CHANGELOG = (ROOT / "CHANGELOG.md").read_text()
#: The releases, newest first: the version headings of CHANGELOG.md.
RELEASES = re.findall(r"^## (\d+\.\d+\.\d+)\b", CHANGELOG, re.MULTILINE)
#: The answers the project is created with; an update must keep them.
ANSWERS = {"project_name": "Blob Classifier", "slurm_partition": "gpu"}
PACKAGE = "blob_classifier"
CONSOLE_COMMAND = "blob-classifier-train"
#: The file that defines TaskConfig: config.py before 1.0, task.py since.
TASK_CONFIG = "<TaskConfig>"
#: The owner's changes, made at the release: (file, its text there, what the owner made of it).
EDITS = [
    (
        "src/{package}/task.py",
        "from torch.nn import functional as F\n",
        "import torch.nn.functional as F\n",
    ),
    (
        "src/{package}/task.py",
        "        return F.cross_entropy(model(inputs), labels)\n",
        "        smoothing = self.config.label_smoothing\n"
        "        return F.cross_entropy(model(inputs), labels, label_smoothing=smoothing)\n",
    ),
    (TASK_CONFIG, "    hidden_dim: int = 128\n", "    hidden_dim: int = 96\n"),
    (
        TASK_CONFIG,
        "    dropout: float = 0.1\n",
        "    dropout: float = 0.1\n"
        "    #: Label smoothing of the training loss.\n"
        "    label_smoothing: float = 0.1\n",
    ),
    ("configs/default.yaml", "  lr: 0.003\n", "  lr: 0.002\n"),
]
#: The owner's settings that the runs before and after the update must both have.
OWNER_SETTINGS = {"optim.lr": 0.002, "task.hidden_dim": 96, "task.label_smoothing": 0.1}
#: Steps trained at the release, then in all after the update (a resume).
STEPS_BEFORE, STEPS_AFTER = 10, 20
RUN_DIR = "runs/ours"
#: Commits need an author; the machine's git configuration must not matter.
GIT_ENV = {
    "GIT_AUTHOR_NAME": "Template Test",
    "GIT_AUTHOR_EMAIL": "template-test@example.com",
    "GIT_COMMITTER_NAME": "Template Test",
    "GIT_COMMITTER_EMAIL": "template-test@example.com",
    "GIT_CONFIG_GLOBAL": os.devnull,
}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.xdist_group("update")]


def run(command: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """Run a command with a fixed git identity; its output stays readable in the test log."""
    result = subprocess.run(
        command,
        cwd=cwd,
        env={**os.environ, **GIT_ENV, "NO_COLOR": "1", "COLUMNS": "200", **env},
        capture_output=True,
        text=True,
        timeout=300,
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


def project_files(project: Path) -> set[str]:
    """The project's files as git sees them: tracked or new, none that it ignores (runs)."""
    listed = git("ls-files", "--cached", "--others", "--exclude-standard", "-z", cwd=project)
    return {name for name in listed.split("\0") if name and (project / name).is_file()}


# ---- the template and its releases -----------------------------------------------------------


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clone of this repository with the working tree committed on top: its history holds
    the releases, and its newest commit is the template under test."""
    if shutil.which("git") is None:
        pytest.fail("cruft and these tests need git: install it")
    shallow = run(["git", "rev-parse", "--is-shallow-repository"], ROOT)
    if shallow.returncode != 0 or shallow.stdout.strip() != "false":
        pytest.fail(
            f"{ROOT} is not a full git clone, and the releases are in its history: clone the "
            "repository without --depth (or run git fetch --unshallow)"
        )
    path = tmp_path_factory.mktemp("template") / "ddp-template"
    git("clone", "--quiet", str(ROOT), str(path), cwd=ROOT)
    git("rm", "-r", "--quiet", ".", cwd=path)
    copy_template(path)
    git("add", "--all", cwd=path)
    git("commit", "--quiet", "--allow-empty", "-m", "The template under test", cwd=path)
    return path


def release_commit(template: Path, version: str) -> str:
    """The commit that added the version's heading to CHANGELOG.md."""
    pattern = rf"^## {re.escape(version)}( |$)"
    added = git(
        "log", "--reverse", "--format=%H", f"-G{pattern}", "--", "CHANGELOG.md", cwd=template
    )
    if not added.split():
        pytest.fail(f"no commit of the history adds the heading of release {version}")
    return added.split()[0]


def steps_since(version: str) -> str:
    """The CHANGELOG's "What a project that updates must change" of every version after
    `version`, Unreleased included."""
    newer = CHANGELOG[: CHANGELOG.index(f"\n## {version}")]
    sections = re.split(r"^### ", newer, flags=re.MULTILINE)
    return "\n".join(
        section for section in sections if section.startswith("What a project that updates")
    )


# ---- the owner's project and its environment --------------------------------------------------


def task_config_file(project: Path) -> str:
    """The file that defines TaskConfig in this project (config.py before 1.0, task.py since)."""
    for name in ("config.py", "task.py"):
        path = project / "src" / PACKAGE / name
        if path.is_file() and "\nclass TaskConfig" in path.read_text():
            return f"src/{PACKAGE}/{name}"
    raise AssertionError("the project defines no TaskConfig")


def make_owners_changes(project: Path) -> set[str]:
    """EDITS, each found exactly once; returns the files changed."""
    changed = set()
    for where, old, new in EDITS:
        name = task_config_file(project) if where == TASK_CONFIG else where.format(package=PACKAGE)
        path = project / name
        text = path.read_text()
        assert text.count(old) == 1, f"{name} of this release does not hold {old!r} once"
        path.write_text(text.replace(old, new))
        changed.add(name)
    return changed


def python_environment(path: Path) -> Path:
    """A virtual environment whose packages are the test environment's, and its Python: what
    the project installs goes into it alone."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    own = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(own, "test-environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def install(python: Path, project: Path) -> None:
    """`pip install -e .`, with the packages the test environment has (no download)."""
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet"]
    result = run([*pip, "--no-deps", "--no-build-isolation", "-e", str(project)], project)
    assert result.returncode == 0, result.stderr


# ---- the CHANGELOG's steps, as an owner applies them ----------------------------------------


def class_block(source: str, name: str) -> tuple[int, int] | None:
    """The lines (0-based, end excluded) of top-level class `name` with its decorators."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            first = min([node.lineno, *(decorator.lineno for decorator in node.decorator_list)])
            return first - 1, node.end_lineno or node.lineno
    return None


def without_class(source: str, name: str) -> str:
    block = class_block(source, name)
    assert block is not None, f"no class {name}"
    lines = source.splitlines(keepends=True)
    return "".join(lines[: block[0]] + lines[block[1] :])


def imports_for(block: str, module_source: str) -> list[str]:
    """The `from X import name` lines of `module_source` for the names `block` uses."""
    used = {node.id for node in ast.walk(ast.parse(block)) if isinstance(node, ast.Name)}
    return [
        f"from {node.module} import {alias.name}\n"
        for node in ast.parse(module_source).body
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
        for alias in node.names
        if (alias.asname or alias.name) in used
    ]


def with_imports(task: str, lines: list[str]) -> str:
    """task.py with each import line it lacks, below `from __future__ import annotations`."""
    missing = "".join(line for line in dict.fromkeys(lines) if line not in task)
    future = "from __future__ import annotations\n"
    assert task.count(future) == 1
    return task.replace(future, f"{future}\n{missing}") if missing else task


def with_task_config(task: str, block: str) -> str:
    """task.py with `block` as its TaskConfig: in place of the one it has, or below the imports."""
    found = class_block(task, "TaskConfig")
    lines = task.splitlines(keepends=True)
    if found is not None:
        return "".join([*lines[: found[0]], block, *lines[found[1] :]])
    definition = re.search(r"^(class |def |@)", task, re.MULTILINE)
    assert definition, "task.py has no definition below its imports"
    return f"{task[: definition.start()]}{block}\n\n{task[definition.start() :]}"


@dataclass(frozen=True)
class Hunk:
    """A hunk of a `*.rej` file: what the function context line says, and its lines."""

    header: str
    lines: list[str]

    def side(self, mark: str) -> str:
        """The hunk's text before ('-') or after ('+') the change."""
        return "".join(line[1:] for line in self.lines if line[:1] in (" ", mark))

    def changed(self, mark: str) -> list[str]:
        return [line[1:] for line in self.lines if line.startswith(mark)]


def hunks(rej: Path) -> list[Hunk]:
    found: list[Hunk] = []
    for line in rej.read_text().splitlines(keepends=True)[1:]:
        if line.startswith("@@"):
            found.append(Hunk(line.split("@@")[2].strip(), []))
        else:
            found[-1].lines.append(line)
    return found


def is_import(line: str) -> bool:
    return line.startswith(("from ", "import "))


#: A TaskConfig class with its decorator: the lines up to the next one at the left margin.
TASK_CONFIG_CLASS = re.compile(r"^@dataclass\nclass TaskConfig\b.*\n(?:(?:[ \t].*)?\n)*", re.M)


def task_config_text(source: str) -> str | None:
    found = TASK_CONFIG_CLASS.search(source)
    return found.group(0).rstrip("\n") + "\n" if found else None


def apply_task_rej(task: str, rej: Path) -> tuple[str, str | None]:
    """task.py.rej as the CHANGELOG says: a hunk whose old lines are still in task.py applied
    by hand; of the one that met the owner's lines at the top of the file, its imports (those
    it removes go, those it adds come), the module docstring left as the owner has it.
    Returns task.py and the TaskConfig that hunk held (the example's)."""
    example_config = None
    for hunk in hunks(rej):
        if hunk.side("-") in task:
            task = task.replace(hunk.side("-"), hunk.side("+"), 1)
            continue
        assert hunk.lines[0].startswith(' """'), f"task.py.rej: a hunk no step covers: {hunk}"
        for line in hunk.changed("-"):
            if is_import(line):
                task = task.replace(line, "", 1)
        task = with_imports(task, [line for line in hunk.changed("+") if is_import(line)])
        example_config = task_config_text(hunk.side("+")) or example_config
    return task, example_config


def new_settings(rej: Path) -> dict[str, object]:
    """configs/default.yaml.rej: settings new in this release, `section.key` -> value; a hunk
    that removes or changes a line is not one."""
    settings: dict[str, object] = {}
    for hunk in hunks(rej):
        assert not hunk.changed("-"), f"default.yaml.rej changes a line of the owner's: {hunk}"
        section = hunk.header.removesuffix(":")
        for line in hunk.changed("+"):
            [(key, value)] = yaml.safe_load(line).items()
            settings[f"{section}.{key}"] = value
    return settings


def apply_changelog_steps(project: Path, left: set[str], generated: str) -> dict[str, object]:
    """What the CHANGELOG tells a project updating from 0.4 to do with each file the update
    left: the owner's TaskConfig into task.py (from config.py, or the example's from the .rej),
    config.py deleted, task.py.rej's imports, default.yaml.rej's new settings left at their
    defaults; each .rej deleted. `generated` is config.py as the release rendered it: an owner's
    change outside TaskConfig would need carrying into config/schema.py, which no EDIT makes.
    Returns the settings the update could not add to the owner's config."""
    package = project / "src" / PACKAGE
    task_path, config_path = package / "task.py", package / "config.py"
    unknown = left - {f"src/{PACKAGE}/config.py", f"src/{PACKAGE}/task.py.rej"}
    unknown -= {"configs/default.yaml.rej"}
    assert not unknown, f"the steps say nothing of {sorted(unknown)}"
    task = task_path.read_text()
    owners_config = None
    if config_path.exists():
        config = config_path.read_text()
        assert without_class(config, "TaskConfig") == without_class(generated, "TaskConfig"), (
            "config.py changed outside TaskConfig: carry that into config/schema.py by hand"
        )
        owners_config = task_config_text(config)
        assert owners_config is not None
        task = with_imports(task, imports_for(owners_config, config))
        config_path.unlink()
    rej = package / "task.py.rej"
    example_config = None
    if rej.exists():
        task, example_config = apply_task_rej(task, rej)
        rej.unlink()
    block = owners_config or example_config
    if block is not None:
        task = with_task_config(task, block)
    task_path.write_text(task)
    settings: dict[str, object] = {}
    yaml_rej = project / "configs" / "default.yaml.rej"
    if yaml_rej.exists():
        settings = new_settings(yaml_rej)
        yaml_rej.unlink()
    return settings


# ---- the update -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Update:
    """A project created at a release, changed, trained, updated and resumed."""

    version: str
    commit: str
    project: Path
    python: Path
    fresh: Path
    before: dict
    owners_files: set[str]
    check_before: subprocess.CompletedProcess[str]
    update: subprocess.CompletedProcess[str]
    left: set[str]
    settings_left_out: dict[str, object]
    resumed: subprocess.CompletedProcess[str]
    check_after: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module", params=RELEASES, ids=lambda version: f"from-{version}")
def updated(
    request: pytest.FixtureRequest, template: Path, tmp_path_factory: pytest.TempPathFactory
) -> Update:
    version = request.param
    commit = release_commit(template, version)
    work = tmp_path_factory.mktemp(f"from-{version}")
    created = cruft(
        "create",
        str(template),
        "--checkout",
        commit,
        "--no-input",
        "--output-dir",
        str(work),
        "--extra-context",
        json.dumps(ANSWERS),
        cwd=work,
    )
    assert created.returncode == 0, created.stderr
    project = work / "blob-classifier"
    git("init", "--quiet", "--initial-branch=main", cwd=project)
    git("add", ".", cwd=project)
    git("commit", "--quiet", "-m", "Generated from the template", cwd=project)
    before = json.loads((project / ".cruft.json").read_text())
    generated_config = project / "src" / PACKAGE / "config.py"
    generated = generated_config.read_text() if generated_config.exists() else ""
    owners_files = make_owners_changes(project)
    git("commit", "--quiet", "-am", "Our changes", cwd=project)

    python = python_environment(work / "venv")
    install(python, project)
    train = [str(python), "-m", f"{PACKAGE}.train", "--config", "configs/default.yaml"]
    steps = [f"train.max_steps={STEPS_BEFORE}", f"checkpoint.every_steps={STEPS_BEFORE}"]
    trained = run([*train, *steps, f"run.dir={RUN_DIR}"], project, OMP_NUM_THREADS="1")
    assert trained.returncode == 0, trained.stderr[-3000:]

    check_before = cruft("check", cwd=project)
    update = cruft("update", "--skip-apply-ask", "--allow-untracked-files", cwd=project)
    fresh = Path(
        cookiecutter(
            str(ROOT), no_input=True, output_dir=str(work / "fresh"), extra_context=ANSWERS
        )
    )
    left = project_files(project) - project_files_of_render(fresh) - {".cruft.json"}
    settings_left_out = apply_changelog_steps(project, left, generated)
    install(python, project)
    resume = [str(python.parent / CONSOLE_COMMAND), "--config", "configs/default.yaml"]
    resumed = run([*resume, f"train.max_steps={STEPS_AFTER}", f"run.dir={RUN_DIR}"], project)
    git("add", "--all", cwd=project)
    git("commit", "--quiet", "-m", "Template update", cwd=project)
    check_after = cruft("check", cwd=project)
    return Update(
        version,
        commit,
        project,
        python,
        fresh,
        before,
        owners_files,
        check_before,
        update,
        left,
        settings_left_out,
        resumed,
        check_after,
    )


def project_files_of_render(project: Path) -> set[str]:
    return {str(path.relative_to(project)) for path in project.rglob("*") if path.is_file()}


def resolved_config(update: Update) -> dict:
    return yaml.safe_load((update.project / RUN_DIR / "config.yaml").read_text())


def setting(config: dict, key: str) -> object:
    section, name = key.split(".")
    return config[section][name]


def test_cruft_create_records_the_release_commit_and_the_answers(updated: Update) -> None:
    recorded = updated.before["context"]["cookiecutter"]
    assert updated.before["commit"] == updated.commit
    assert {key: recorded[key] for key in ANSWERS} == ANSWERS


def test_cruft_check_fails_while_the_template_has_a_newer_commit(updated: Update) -> None:
    assert updated.check_before.returncode != 0
    assert "out of date" in updated.check_before.stdout


def test_cruft_update_succeeds(updated: Update) -> None:
    assert updated.update.returncode == 0, updated.update.stderr


def test_every_file_the_update_leaves_is_named_by_the_changelog_steps(updated: Update) -> None:
    """Each `*.rej`, and an owner's config.py, with what to do with it."""
    steps = steps_since(updated.version)
    unnamed = [
        name
        for name in sorted(updated.left)
        if name.replace(f"src/{PACKAGE}/", "src/<package>/") not in steps
    ]
    assert not unnamed


def test_after_the_steps_the_project_is_a_fresh_render_with_the_owners_changes(
    updated: Update,
) -> None:
    """No file of the release left behind, none of this template missing, and only the files
    the owner changed differ (their TaskConfig now in task.py)."""
    ours = project_files(updated.project) - {".cruft.json"}
    assert ours == project_files_of_render(updated.fresh)
    differ = {
        name
        for name in ours
        if (updated.project / name).read_bytes() != (updated.fresh / name).read_bytes()
    }
    moved = {name.replace("/config.py", "/task.py") for name in updated.owners_files}
    assert differ == moved


def test_the_update_keeps_the_owners_changes(updated: Update) -> None:
    """Each of EDITS, in its file; TaskConfig's in task.py."""
    for where, _, new in EDITS:
        name = f"src/{PACKAGE}/task.py" if where == TASK_CONFIG else where.format(package=PACKAGE)
        assert new in (updated.project / name).read_text(), new


def test_the_update_keeps_the_answers(updated: Update) -> None:
    after = json.loads((updated.project / ".cruft.json").read_text())
    kept = {key: value for key, value in after["context"]["cookiecutter"].items() if key in ANSWERS}
    assert kept == ANSWERS
    sbatch = (updated.project / "launch" / "slurm" / "train.sbatch").read_text()
    assert "#SBATCH --partition=gpu\n" in sbatch


def test_settings_the_update_could_not_add_to_the_config_take_their_defaults(
    updated: Update,
) -> None:
    """The steps leave default.yaml.rej's new settings out: the run has them at the values the
    .rej would have written."""
    config = resolved_config(updated)
    assert {key: setting(config, key) for key in updated.settings_left_out} == (
        updated.settings_left_out
    )


def test_the_reinstalled_console_command_resumes_the_run_of_the_release(updated: Update) -> None:
    log = updated.resumed.stderr + updated.resumed.stdout
    assert updated.resumed.returncode == 0, log[-3000:]
    assert re.search(rf"resumed from \S+step_0*{STEPS_BEFORE} at step {STEPS_BEFORE}\b", log), log
    assert f"training complete at step {STEPS_AFTER}" in log
    config = resolved_config(updated)
    assert {key: setting(config, key) for key in OWNER_SETTINGS} == OWNER_SETTINGS


def test_cruft_check_passes_after_the_update(updated: Update) -> None:
    assert updated.check_after.returncode == 0, updated.check_after.stdout


def test_the_updated_project_passes_its_task_tests(updated: Update) -> None:
    """The newest release's update runs tests/task but the fault tests, for the default
    project's whole suite (its 2-rank training and resume ran, its NCCL tests were collected);
    an older one's runs the resume tests."""
    newest = updated.version == RELEASES[0]
    selection = ["tests/task", "-m", "not faults"] if newest else ["tests/task/test_resume.py"]
    cases = run_project_suite(updated.project, {}, *selection, python=updated.python)
    if newest:
        assert_whole_suite_ran(cases)
    else:
        assert "test_weights_are_bitwise_equal_to_an_unbroken_run" in cases


@pytest.mark.parametrize("version", RELEASES)
def test_a_project_of_plain_cookiecutter_links_to_its_release(
    template: Path, tmp_path: Path, version: str
) -> None:
    """docs/updating.md's recipe: the answers in .cookiecutter.json and the release the project
    came from link it to the template, and cruft then finds no difference to that commit."""
    commit = release_commit(template, version)
    release = tmp_path / "release"
    git("clone", "--quiet", str(template), str(release), cwd=tmp_path)
    git("checkout", "--quiet", commit, cwd=release)
    rendered = run([sys.executable, "-m", "cookiecutter", "--no-input", str(release)], tmp_path)
    assert rendered.returncode == 0, rendered.stderr
    project = tmp_path / "ddp-project"
    answers = json.loads((project / ".cookiecutter.json").read_text())["cookiecutter"]
    linked = cruft(
        "link",
        str(template),
        "--checkout",
        commit,
        "--no-input",
        "--extra-context",
        json.dumps(answers),
        cwd=project,
    )
    assert linked.returncode == 0, linked.stderr
    record = json.loads((project / ".cruft.json").read_text())
    assert record["commit"] == commit
    difference = cruft("diff", "--exit-code", "--checkout", commit, cwd=project)
    assert difference.returncode == 0, difference.stdout


def test_the_releases_are_found_in_the_changelog() -> None:
    """A heading format the pattern misses would leave the releases untested."""
    assert RELEASES, "CHANGELOG.md has no version heading"
    headings = re.findall(r"^## (?!Unreleased)(.*)$", CHANGELOG, re.MULTILINE)
    assert len(headings) == len(RELEASES), headings
