"""The generation hooks: answers are validated as data, refused with a clear message, and a
refused generation leaves nothing behind."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
from answers import VALID, load_hook
from matrix import CONTEXT, ROOT, RULES


@pytest.fixture(scope="module")
def pre_gen() -> types.ModuleType:
    return load_hook("pre_gen_project.py", VALID)


def errors_for(pre_gen: types.ModuleType, **answers: object) -> list[str]:
    return pre_gen.validate({**VALID, **answers})


def test_valid_answers_pass(pre_gen: types.ModuleType) -> None:
    assert errors_for(pre_gen) == []


@pytest.mark.parametrize("slug", ["", ".", "..", ".hidden", "a/b", "../evil", "a\\b", "-x", "a b"])
def test_unsafe_project_slug_is_refused(pre_gen: types.ModuleType, slug: str) -> None:
    assert any("is not a safe directory name" in e for e in errors_for(pre_gen, project_slug=slug))


@pytest.mark.parametrize(
    ("package", "reason"),
    [
        ("1abc", "is not a valid import name"),
        ("my-pkg", "is not a valid import name"),
        ("MyPkg", "is not a valid import name"),
        ("über", "is not a valid import name"),
        ("class", "is a Python keyword"),
        ("match", "is a Python keyword"),
        ("json", "would shadow"),
        ("os", "would shadow"),
        ("torch", "would shadow"),
        ("yaml", "would shadow"),
        ("tests", "would shadow"),
        ("a" * 51, "characters long"),
    ],
)
def test_unusable_package_name_is_refused(
    pre_gen: types.ModuleType, package: str, reason: str
) -> None:
    assert any(reason in e for e in errors_for(pre_gen, package_name=package))


@pytest.mark.parametrize("email", ["nope", "a@b", "a @b.com", "@example.com", "a@@b.com"])
def test_malformed_email_is_refused(pre_gen: types.ModuleType, email: str) -> None:
    assert any("is not an email address" in e for e in errors_for(pre_gen, author_email=email))


@pytest.mark.parametrize("field", ["project_name", "description", "author_name"])
def test_multi_line_text_is_refused(pre_gen: types.ModuleType, field: str) -> None:
    """A newline would break pyproject.toml and the README heading."""
    assert any("must be one non-empty line" in e for e in errors_for(pre_gen, **{field: "a\nb"}))


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("slurm_partition", "gpu --exclusive", "is not a Slurm name"),
        ("slurm_account", "proj\n#SBATCH --mem=1", "is not a Slurm name"),
        ("slurm_nodes", "0", "must be a whole number >= 1"),
        ("slurm_nodes", "two", "must be a whole number >= 1"),
        ("slurm_gpus_per_node", "-1", "must be a whole number >= 0"),
        ("slurm_cpus_per_process", "1.5", "must be a whole number >= 1"),
        ("slurm_time_limit", "1 day", "is not a Slurm time"),
        ("slurm_time_limit", "24h", "is not a Slurm time"),
    ],
)
def test_bad_slurm_answer_is_refused(
    pre_gen: types.ModuleType, field: str, value: str, reason: str
) -> None:
    """These answers become #SBATCH lines; a bad one would fail only at submit time."""
    assert any(f"{field} {value!r} {reason}" in e for e in errors_for(pre_gen, **{field: value}))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("slurm_partition", "gpu,gpu-long"),
        ("slurm_time_limit", "90"),
        ("slurm_time_limit", "1-12"),
        ("slurm_time_limit", "00:30:00"),
    ],
)
def test_slurm_formats_are_accepted(pre_gen: types.ModuleType, field: str, value: str) -> None:
    assert errors_for(pre_gen, **{field: value}) == []


def test_every_rule_of_the_table_refuses_its_combination(pre_gen: types.ModuleType) -> None:
    """Each rule of `_invalid_combinations` fires on its own combination and names the values."""
    for rule in RULES:
        answers = {k: v[0] if isinstance(v, list) else v for k, v in rule["when"].items()}
        errors = errors_for(pre_gen, **answers)
        assert any(e.startswith("invalid combination:") for e in errors), rule
        assert all("{" not in e for e in errors), "placeholders must be filled in"


def test_old_cookiecutter_is_refused(
    pre_gen: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pre_gen.metadata, "version", lambda name: "2.6.0")
    assert "needs cookiecutter >= 2.7 (found 2.6.0)" in pre_gen.cookiecutter_version_error()
    monkeypatch.setattr(pre_gen.metadata, "version", lambda name: "2.7.1")
    assert pre_gen.cookiecutter_version_error() is None


#: Keys cookiecutter adds to every context, whatever cookiecutter.json holds, and the template
#: commit that cruft adds.
RUNTIME_KEYS = {"_template", "_output_dir", "_repo_dir", "_checkout", "_commit"}


def test_every_key_the_render_sees_has_one_validator(pre_gen: types.ModuleType) -> None:
    """Adding an option to cookiecutter.json means adding its row to the table, and the table
    has no row for a key that no longer exists."""
    assert set(pre_gen.VALIDATORS) == set(CONTEXT) | RUNTIME_KEYS


def test_option_without_a_validator_is_reported_as_a_template_bug(
    pre_gen: types.ModuleType, tmp_path: Path
) -> None:
    shutil.copy(ROOT / "template_extensions.py", tmp_path)
    (tmp_path / "cookiecutter.json").write_text(json.dumps({**CONTEXT, "new_option": "x"}))
    errors = pre_gen.validate(VALID, str(tmp_path))
    assert errors == [
        "template bug: option new_option has no validator in hooks/pre_gen_project.py"
    ]


def test_answers_without_the_template_extension_are_refused(pre_gen: types.ModuleType) -> None:
    """Without its extension the template cannot escape the answers, nor find its own files."""
    [error] = pre_gen.validate({**VALID, "_extensions": []}, template_dir=None)
    assert error.startswith("_extensions [] leaves out the template's own Jinja extension")
    assert error.endswith("Remove _extensions from the replay file")


def test_combination_rules_come_from_the_template_not_the_answers(
    pre_gen: types.ModuleType,
) -> None:
    """A replay file that empties `_invalid_combinations` is still held to the rules."""
    errors = errors_for(
        pre_gen,
        _invalid_combinations=[],
        use_docker=True,
        python_version=RULES[0]["when"]["python_version"][0],
    )
    assert any(error.startswith("invalid combination:") for error in errors)


def render_cli(out: Path, *answers: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "cookiecutter", "--no-input", str(ROOT), "-o", str(out)]
    return subprocess.run([*command, *answers], capture_output=True, text=True, cwd=out.parent)


@pytest.mark.parametrize(
    ("answers", "message"),
    [
        (["project_slug=a/b"], "project_slug 'a/b' is not a safe directory name"),
        (["project_slug=../evil"], "project_slug '../evil' is not a safe directory name"),
        (["project_slug=.hidden"], "project_slug '.hidden' is not a safe directory name"),
        (["project_slug="], "project_slug '' is not a safe directory name"),
        (["package_name=os"], "package_name 'os' would shadow"),
        (["package_name=class"], "package_name 'class' is a Python keyword"),
        (["author_email=nope"], "author_email 'nope' is not an email address"),
        (["use_docker=yes", "python_version=3.13"], "invalid combination: the Docker image"),
    ],
    ids=lambda value: value if isinstance(value, str) else " ".join(value),
)
def test_refused_generation_says_why_and_leaves_nothing(
    tmp_path: Path, answers: list[str], message: str
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    result = render_cli(out, *answers)
    assert result.returncode != 0
    assert f"ERROR: {message}" in result.stderr
    assert list(out.iterdir()) == []
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out"]


def test_answers_are_data_not_code(tmp_path: Path) -> None:
    """Quotes and code in a text answer end up as text, and nothing runs."""
    payload = '"""); import os; os.system("touch PWNED") #'
    out = tmp_path / "out"
    out.mkdir()
    result = render_cli(out, f"description={payload}", 'author_name=O\'Brien "Bob"')
    assert result.returncode == 0, result.stderr
    assert not list(tmp_path.rglob("PWNED"))
    project = out / "ddp-project"
    assert payload in (project / "README.md").read_text()
    init = project / "src" / "ddp_project" / "__init__.py"
    namespace: dict = {}
    exec(compile(init.read_text(), str(init), "exec"), namespace)
    assert namespace["__doc__"] == payload


def make_tree(root: Path, paths: list[str]) -> None:
    for path in paths:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text("x")


def test_post_gen_removes_exactly_the_deselected_files(tmp_path: Path) -> None:
    answers = {**VALID, "use_slurm": False, "use_docker": True, "tracker": "none", "ci": "gitlab"}
    answers["example"] = "classifier"
    post_gen = load_hook("post_gen_project.py", answers)
    table = [p.format(package_name="ddp_project") for p in post_gen.KEEP_ONLY_IF]
    directories = {"launch/slurm", ".github"}
    make_tree(tmp_path, [*(f"{p}/x" if p in directories else p for p in table), "keep.py"])
    assert post_gen.prune(tmp_path, answers) == []
    remaining = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()}
    assert remaining == {
        "keep.py",
        "tests/example/test_classifier.py",
        "Dockerfile",
        ".dockerignore",
        "apptainer.def",
        ".gitlab-ci.yml",
        "renovate.json",
    }


def test_post_gen_reports_table_entries_that_were_not_rendered(tmp_path: Path) -> None:
    """A path in the table that the template no longer renders is a template bug, reported."""
    post_gen = load_hook("post_gen_project.py", VALID)
    assert "Dockerfile" in post_gen.prune(tmp_path, VALID)
