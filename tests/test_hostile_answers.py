"""Hostile answers: a value the template accepts renders into files that still parse and hold it
exactly; a value it refuses stops generation with the reason and leaves nothing behind.

The values reach the render through a replay file, which cookiecutter hands to the template as
they are: `{{`, `{%` and control characters arrive as typed, and private keys can be set.
"""

from __future__ import annotations

import ast
import datetime
import json
import re
import subprocess
import tomllib
import types
from pathlib import Path

import pytest
import yaml
from answers import RECORDED, VALID, load_hook, render_from_replay
from cookiecutter.exceptions import FailedHookException
from cookiecutter.main import cookiecutter
from matrix import CONTEXT, ROOT

#: (option, value, what the message says): values that must never reach a rendered file.
REFUSED = [
    ("project_slug", "ddp-project\n", "is not a safe directory name"),
    ("project_slug", "my project", "is not a safe directory name"),
    ("project_slug", "a..b", "is not a safe directory name"),
    ("project_slug", "ddp-", "is not a safe directory name"),
    ("project_slug", "$(touch pwned)", "is not a safe directory name"),
    ("project_slug", "`id`", "is not a safe directory name"),
    ("project_slug", "ddp\x7f", "is not a safe directory name"),
    ("project_slug", "ddp\u0663", "is not a safe directory name"),
    ("project_slug", "{{ cookiecutter.x }}", "is not a safe directory name"),
    ("project_slug", "a" * 51, "is 51 characters long"),
    ("project_slug", "a" * 300, "is 300 characters long"),
    ("package_name", "ddp_project\n", "is not a valid import name"),
    ("package_name", "ddp_\u0663", "is not a valid import name"),
    ("package_name", "my.project", "is not a valid import name"),
    ("author_email", "you@example.com\n", "is not an email address"),
    ("author_email", 'you"@example.com', "is not an email address"),
    ("author_email", 'you@example.com", evil = "1', "is not an email address"),
    ("author_email", "you@example.com\x7f", "is not an email address"),
    ("author_email", "you\\@example.com", "is not an email address"),
    ("author_email", "$(id)@example.com", "is not an email address"),
    ("author_email", "zoë@example.com", "is not an email address"),
    ("author_email", "a" * 250 + "@example.com", "is not an email address"),
    ("project_name", "DDP\n", "must be one non-empty line"),
    ("project_name", "DDP\x7f", "U+007F"),
    ("project_name", "DDP\u202eevil", "U+202E (RIGHT-TO-LEFT OVERRIDE)"),
    ("project_name", "DDP\u200b", "U+200B (ZERO WIDTH SPACE)"),
    ("project_name", " DDP", "starts or ends with whitespace"),
    ("project_name", "x" * 101, "is 101 characters long"),
    ("description", "one\ntwo", "must be one non-empty line"),
    ("description", "x" * 201, "is 201 characters long"),
    ("author_name", "Ada\r", "must be one non-empty line"),
    ("author_name", "", "must be one non-empty line"),
    ("slurm_nodes", "\u0663", "must be a whole number >= 1"),
    ("slurm_nodes", "2\n", "must be a whole number >= 1"),
    ("slurm_nodes", "1\x7f", "must be a whole number >= 1"),
    ("slurm_nodes", "01", "must be a whole number >= 1"),
    ("slurm_nodes", "1" * 7, "must be a whole number >= 1"),
    ("slurm_gpus_per_node", "\uff18", "must be a whole number >= 0"),
    ("slurm_cpus_per_process", "$(nproc)", "must be a whole number >= 1"),
    ("slurm_time_limit", "24:00:00\n", "is not a Slurm time"),
    ("slurm_time_limit", "\u0662\u0664:00:00", "is not a Slurm time"),
    ("slurm_partition", "gpu\n", "is not a Slurm name"),
    ("slurm_partition", "gpu\x7f", "is not a Slurm name"),
    ("slurm_account", "$(id)", "is not a Slurm name"),
    ("license", "GPL-3.0", "is not one of the choices MIT, Apache-2.0"),
    ("license", "MIT\n", "is not one of the choices"),
    ("python_version", 3.11, "is not one of the choices"),
    ("mixed_precision", "fp8", "is not one of the choices"),
    ("example", "llama", "is not one of the choices"),
    ("tracker", "none ", "is not one of the choices"),
    ("ci", "jenkins", "is not one of the choices"),
    ("use_slurm", "yes", "is not yes or no"),
    ("use_docker", 1, "is not yes or no"),
    ("project_name", 42, "is int, not text"),
    ("description", None, "is NoneType, not text"),
    ("slurm_nodes", 2, "is int, not text"),
    ("__project_dir", "../escape", "is not the name project_slug gives ('ddp-project')"),
    ("__project_dir", "/tmp/elsewhere", "is not the name project_slug gives"),
    ("_extensions", ["jinja2.ext.debug"], "differs from the template's"),
    ("_copy_without_render", ["*"], "is not an option of this template"),
    ("_jinja2_env_vars", {"autoescape": True}, "is not an option of this template"),
    ("surprise", "x", "is not an option of this template"),
]

#: (option, value): hostile-looking values that are fine, because the filters escape them.
ACCEPTED = [
    ("project_name", "Zoë Ünal"),
    ("project_name", "日本語のプロジェクト"),
    ("project_name", "Q's \"DDP\" \\ $(id) `id` {{ x }} {% y %} # k: [v] = 'c' & *a !t |> %"),
    ("author_name", "Zoë Ünal"),
    ("author_name", 'O\'Brien, "Bob" \\ Jr.'),
    ("description", "- k: v # {{ x }} {% y %} \"\"\" ''' \\ $(id) `id` & *a !t | > % @ [t] = 1"),
    ("description", "Fast training \u2013 on many GPUs"),
    ("project_slug", "my.project"),
    ("project_slug", "MyProject"),
    ("project_slug", "a" * 50),
    ("author_email", "o'brien+`id`$HOME@example.co.uk"),
    ("slurm_nodes", "999999"),
]


def test_every_key_of_the_template_has_a_refused_value_above() -> None:
    """A new option needs its hostile values here too (private keys without rules excepted)."""
    unchecked = {"_invalid_combinations", "_ask_only_if", "__prompts__"}
    assert {option for option, _, _ in REFUSED} >= set(CONTEXT) - unchecked


@pytest.fixture(scope="module")
def pre_gen() -> types.ModuleType:
    return load_hook("pre_gen_project.py", VALID)


@pytest.mark.parametrize(
    ("option", "value", "reason"), REFUSED, ids=[f"{o}={ascii(v)[:30]}" for o, v, _ in REFUSED]
)
def test_hostile_value_is_refused_with_the_reason(
    pre_gen: types.ModuleType, option: str, value: object, reason: str
) -> None:
    """The message names the option first, then says why and how to fix it."""
    errors = pre_gen.validate({**VALID, option: value})
    assert [error for error in errors if error.startswith(f"{option} ") and reason in error]


@pytest.mark.parametrize(
    ("option", "value"), ACCEPTED, ids=[f"{o}={ascii(v)[:30]}" for o, v in ACCEPTED]
)
def test_hostile_looking_but_valid_value_is_accepted(
    pre_gen: types.ModuleType, option: str, value: str
) -> None:
    derived = {"__project_dir": value} if option == "project_slug" else {}
    assert pre_gen.validate({**VALID, option: value, **derived}) == []


# ---- rendering accepted hostile values ------------------------------------------------------

HOSTILE = {
    **RECORDED,
    "project_name": "Zoë \"Q\" O'Brien \\ $(touch pwned) `id` {{ x }} {% y %} #: - [k] = 'v'",
    "project_slug": "my.project",
    "__project_dir": "my.project",
    "package_name": "my_project",
    "description": '""" \'\'\' \\ $(touch pwned) `id` {{ x }} {% if y %} #: [k] = "v" & *a !t |> %',
    "author_name": 'Zoë Ünal, "O\'Brien" \\ `touch pwned`',
    "author_email": "o'brien+`id`$HOME@example.co.uk",
    "slurm_partition": "gpu,gpu-long",
}
#: The same options with plain text: the files must have the same keys as this render.
PLAIN = {
    **HOSTILE,
    "project_name": "Plain",
    "description": "Plain.",
    "author_name": "Plain Name",
    "author_email": "plain@example.com",
}
DATA_FILES = [
    "pyproject.toml",
    ".cookiecutter.json",
    ".pre-commit-config.yaml",
    "configs/default.yaml",
    ".github/workflows/ci.yml",
]


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return render_from_replay(tmp_path_factory.mktemp("hostile"), HOSTILE)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return render_from_replay(tmp_path_factory.mktemp("plain"), PLAIN)


def load(path: Path) -> object:
    """A data file parsed by its format's own parser."""
    text = path.read_text()
    if path.suffix == ".toml":
        return tomllib.loads(text)
    if path.suffix == ".json":
        return json.loads(text)
    return yaml.safe_load(text)


def keys(data: object) -> object:
    """The nesting of tables, mappings and lists, with the scalar values left out."""
    if isinstance(data, dict):
        return {key: keys(value) for key, value in data.items()}
    if isinstance(data, list):
        return [keys(item) for item in data]
    return type(data).__name__


def test_hostile_answers_render_into_the_directory_named_by_the_slug(hostile: Path) -> None:
    assert hostile.name == "my.project"
    assert sorted(path.name for path in hostile.parent.iterdir()) == ["my.project"]


def test_pyproject_holds_the_answers_exactly(hostile: Path) -> None:
    project = tomllib.loads((hostile / "pyproject.toml").read_text())["project"]
    assert project["name"] == HOSTILE["project_slug"]
    assert project["description"] == HOSTILE["description"]
    assert project["authors"] == [
        {"name": HOSTILE["author_name"], "email": HOSTILE["author_email"]}
    ]
    assert project["scripts"] == {"my.project-train": "my_project.cli:train_command"}


def test_pyproject_metadata_builds_with_the_answers(hostile: Path) -> None:
    """Hatchling, the build backend, reads the same name, summary and author."""
    from hatchling.metadata.core import ProjectMetadata

    core = ProjectMetadata(str(hostile), None).core
    assert (core.raw_name, core.description) == (HOSTILE["project_slug"], HOSTILE["description"])
    assert core.authors == [{"name": HOSTILE["author_name"], "email": HOSTILE["author_email"]}]


@pytest.mark.parametrize("name", DATA_FILES)
def test_data_file_has_the_same_keys_as_with_plain_answers(
    hostile: Path, plain: Path, name: str
) -> None:
    """No answer opened a TOML table, added a YAML key or ended a JSON string early."""
    assert keys(load(hostile / name)) == keys(load(plain / name))


def test_recorded_answers_are_exact(hostile: Path) -> None:
    recorded = json.loads((hostile / ".cookiecutter.json").read_text())["cookiecutter"]
    assert recorded == HOSTILE


def test_python_files_compile_and_the_docstring_is_exact(hostile: Path) -> None:
    for path in hostile.rglob("*.py"):
        compile(path.read_text(), str(path), "exec")
    init = ast.parse((hostile / "src" / "my_project" / "__init__.py").read_text())
    assert ast.get_docstring(init, clean=False) == HOSTILE["description"]


def shell_snippets(project: Path) -> dict[str, str]:
    """Every piece of shell in the project: scripts, README code blocks, Apptainer sections."""
    snippets = {
        str(path.relative_to(project)): path.read_text()
        for path in [*project.rglob("*.sh"), *project.rglob("*.sbatch")]
    }
    readme = (project / "README.md").read_text()
    for number, block in enumerate(re.findall(r"```(?:bash|sh)\n(.*?)```", readme, re.DOTALL)):
        snippets[f"README.md block {number}"] = block
    definition = (project / "apptainer.def").read_text()
    for section in ("post", "environment", "runscript", "test"):
        body = re.search(rf"^%{section}\n(.*?)(?=^%|\Z)", definition, re.DOTALL | re.MULTILINE)
        snippets[f"apptainer.def %{section}"] = body.group(1)
    return snippets


def test_shell_snippets_parse(hostile: Path) -> None:
    snippets = shell_snippets(hostile)
    assert len(snippets) > 6
    for name, snippet in snippets.items():
        result = subprocess.run(["bash", "-n"], input=snippet, capture_output=True, text=True)
        assert result.returncode == 0, f"{name}: {result.stderr}"


def test_text_files_hold_the_answers_as_typed(hostile: Path) -> None:
    """`{{ x }}` stays text: the answers are never rendered as Jinja a second time."""
    readme = (hostile / "README.md").read_text().splitlines()
    assert readme[0] == f"# {HOSTILE['project_name']}"
    assert readme[2] == HOSTILE["description"]
    year = datetime.datetime.now(datetime.UTC).year
    license_text = (hostile / "LICENSE").read_text()
    assert f"Copyright (c) {year} {HOSTILE['author_name']}\n" in license_text
    dockerfile = (hostile / "Dockerfile").read_text().splitlines()
    assert dockerfile[0].startswith(f"# Training image for {HOSTILE['project_name']}: the ")
    assert f"for {HOSTILE['project_name']}\n" in (hostile / "apptainer.def").read_text()


def test_no_answer_ran_as_code(hostile: Path) -> None:
    assert not list(hostile.parent.parent.rglob("pwned"))


def test_recorded_answers_regenerate_the_same_project(tmp_path: Path) -> None:
    """The README's update check: replaying .cookiecutter.json renders the project again."""
    (tmp_path / "first").mkdir()
    (tmp_path / "again").mkdir()
    first = render_from_replay(tmp_path / "first", HOSTILE)
    recorded = json.loads((first / ".cookiecutter.json").read_text())["cookiecutter"]
    again = render_from_replay(tmp_path / "again", recorded)
    files = sorted(path.relative_to(first) for path in first.rglob("*") if path.is_file())
    assert sorted(path.relative_to(again) for path in again.rglob("*") if path.is_file()) == files
    assert [
        path for path in files if (again / path).read_bytes() != (first / path).read_bytes()
    ] == []


# ---- refused generations ---------------------------------------------------------------------


def only_what_was_there(tmp_path: Path) -> bool:
    """Nothing in the output directory, nothing new beside it (`../escape` would be there)."""
    beside = {path.name for path in tmp_path.iterdir()}
    return beside <= {"out", "replay.json"} and not list((tmp_path / "out").iterdir())


@pytest.mark.parametrize(
    ("answers", "message"),
    [
        ({"__project_dir": "../escape"}, "__project_dir '../escape' is not the name project_slug"),
        ({"license": "GPL-3.0"}, "license 'GPL-3.0' is not one of the choices"),
        ({"use_docker": "yes"}, "use_docker 'yes' is not yes or no"),
        ({"_copy_without_render": ["*"]}, "_copy_without_render is not an option"),
        ({"project_slug": "ddp-project\n"}, "project_slug 'ddp-project\\n' is not a safe"),
        ({"project_slug": "a" * 300}, f"project_slug '{'a' * 56}... is 300 characters long"),
        ({"author_email": 'you@x.com"\nevil = "1'}, "author_email 'you@x.com\"\\nevil"),
        ({"slurm_nodes": "\u0663"}, "slurm_nodes '\u0663' must be a whole number >= 1"),
        ({"_extensions": [], "__project_dir": "ddp-project"}, "_extensions [] leaves out"),
    ],
    ids=[
        "project_dir",
        "choice",
        "boolean",
        "cookiecutter setting",
        "newline",
        "long slug",
        "email",
        "digit",
        "extensions",
    ],
)
def test_refused_replay_says_why_and_leaves_nothing(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], answers: dict, message: str
) -> None:
    with pytest.raises(FailedHookException):
        render_from_replay(tmp_path, {**RECORDED, **answers})
    assert f"ERROR: {message}" in capfd.readouterr().err
    assert only_what_was_there(tmp_path)


def test_replay_without_the_project_directory_says_how_to_add_it(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """cookiecutter derives a key a replay file lacks without the replayed answers."""
    answers = {key: value for key, value in RECORDED.items() if key != "__project_dir"}
    with pytest.raises(FailedHookException):
        render_from_replay(tmp_path, answers)
    expected = "ERROR: __project_dir is missing from the replay file, and cookiecutter cannot"
    error = capfd.readouterr().err
    assert expected in error
    assert 'Add "__project_dir": "ddp-project" to the replay file' in error
    assert only_what_was_there(tmp_path)


def test_overlong_slug_on_the_command_line_is_refused_before_the_file_system_sees_it(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A 300-character directory name would fail with a traceback as it is created."""
    (tmp_path / "out").mkdir()
    with pytest.raises(FailedHookException):
        cookiecutter(
            str(ROOT),
            no_input=True,
            output_dir=str(tmp_path / "out"),
            extra_context={"project_slug": "a" * 300},
        )
    assert "ERROR: project_slug 'aaaaaaaa" in capfd.readouterr().err
    assert only_what_was_there(tmp_path)


def test_longest_project_name_derives_a_slug_and_package_that_are_accepted(
    tmp_path: Path,
) -> None:
    """The default slug is cut at a word boundary to the length the hook accepts."""
    name = "Self-Supervised Pretraining of Vision Transformers on Satellite Imagery " * 2
    project = cookiecutter(
        str(ROOT),
        no_input=True,
        output_dir=str(tmp_path),
        extra_context={"project_name": name[:100].strip()},
    )
    assert Path(project).name == "self-supervised-pretraining-of-vision-transformers"
