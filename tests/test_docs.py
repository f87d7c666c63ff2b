"""The documentation site builds without a warning; its options page matches cookiecutter.json."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = ROOT / "{{cookiecutter.__project_dir}}" / "src" / "{{cookiecutter.package_name}}"


def _generator():
    spec = importlib.util.spec_from_file_location(
        "generate_options", ROOT / "docs" / "generate_options.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_options_page_is_up_to_date() -> None:
    """docs/options.md is what `make docs` generates from cookiecutter.json today."""
    context = json.loads((ROOT / "cookiecutter.json").read_text())
    expected = _generator().render_options_page(context)
    assert (ROOT / "docs" / "options.md").read_text() == expected, "run `make docs`"


def test_every_option_has_a_prompt() -> None:
    context = json.loads((ROOT / "cookiecutter.json").read_text())
    public = {name for name in context if not name.startswith("_")}
    assert public == set(context["__prompts__"])


def test_the_site_builds_in_strict_mode(tmp_path: Path) -> None:
    """`mkdocs build --strict`: a broken link or anchor, or a page left out of the nav, fails."""
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "index.html").is_file()


TEST_REFERENCE = re.compile(r"(template: )?tests/((?:\w+/)?test_\w+\.py)(?:::(\w+))?")
#: A test function named alone, after a reference to its file: `test_name`.
BARE_TEST_NAME = re.compile(r"`(test_\w+)`")


def test_every_test_the_pages_name_exists() -> None:
    """Pages tie behaviours to tests by file and function: a renamed test leaves no stale name.

    `template: tests/...` is the template's own suite; other names are the generated project's,
    or the template's for pages about the template.
    """
    suites = [ROOT / "{{cookiecutter.__project_dir}}" / "tests", ROOT / "tests"]
    every_test = "".join(path.read_text() for suite in suites for path in suite.rglob("test_*.py"))
    missing = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text()
        for prefix, file_name, function in TEST_REFERENCE.findall(text):
            places = suites[1:] if prefix else suites
            found = [place / file_name for place in places if (place / file_name).is_file()]
            if not found or (
                function and not any(f"def {function}(" in path.read_text() for path in found)
            ):
                missing.append(f"{page.name}: {prefix}tests/{file_name}::{function}")
        for function in BARE_TEST_NAME.findall(text):
            if f"def {function}(" not in every_test:
                missing.append(f"{page.name}: {function}")
    assert not missing, "\n".join(missing)


def test_the_architecture_page_names_every_module_of_the_package_and_no_other() -> None:
    """Its module table is the map of the package: a module added, moved or removed shows."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    table = page[: page.index("\n## ")]
    named = set(re.findall(r"`((?:\w+/)?\w+)\.py`", table))
    modules = {
        str(path.relative_to(PACKAGE_DIR).with_suffix(""))
        for path in PACKAGE_DIR.rglob("*.py")
        if path.name != "__init__.py"
    }
    assert sorted(modules - named) == [], "modules missing from docs/architecture.md"
    assert sorted(named - modules) == [], "docs/architecture.md names modules that are gone"


def test_the_architecture_page_shows_the_step_as_the_trainer_has_it() -> None:
    """The page's copy of `optimizer_step` (its body but the docstring and the return) is the
    code."""
    source = (PACKAGE_DIR / "training" / "trainer.py").read_text()
    step = source[source.index("    def optimizer_step(") :]
    body = step[step.index('"""\n', step.index('"""') + 3) + 4 : step.index("        return ")]
    code = textwrap.dedent(body).strip()
    page = (ROOT / "docs" / "architecture.md").read_text()
    shown = page[page.index("```python\n", page.index("### One step")) + 10 :]
    shown = shown[: shown.index("\n```")]
    assert shown == code, "docs/architecture.md: copy optimizer_step's body into 'One step'"
