"""The template's Jinja filters (template_extensions.py): each writes any text as data of its
format, read back exactly by that format's own parser, and leaves a value that needs no escaping
as a person would have written it."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import jinja2
import pytest
import yaml
from answers import FORMATS, VALID
from matrix import ROOT
from test_update import copy_template

#: Text that is syntax in at least one of the formats, or that their parsers treat specially.
HOSTILE_TEXT = [
    "",
    "plain",
    'double " quote',
    "single ' quote",
    "triple \"\"\" and ''' quotes",
    "back\\slash, \\n and \\u0041 as text",
    "new\nline, carriage\rreturn, tab\t",
    "DEL \x7f, escape \x1b, bell \x07, backspace \b, form feed \f",
    "line breaks of YAML: \x85 \u2028 \u2029",
    "Zoë Ünal, 日本語, emoji 🎉, en dash \u2013",
    "$(touch pwned) `touch pwned` ${HOME} $HOME; && | > < & * ? ~ ! #",
    "{{ cookiecutter.project_name }} {% if x %} {# comment #}",
    'key = 1\n[table]\nx.y = "2"',
    "- item\n? k\n: v\n&anchor *alias !tag %YAML @ `",
    "yes",
    "null",
    "~",
    "1.0",
    "0x10",
    " leading and trailing ",
    "zero\u200bwidth, byte order mark \ufeff, right-to-left override \u202e",
]
IDS = [ascii(text)[:40] for text in HOSTILE_TEXT]


@pytest.mark.parametrize("text", HOSTILE_TEXT, ids=IDS)
def test_toml_string_reads_back_exactly(text: str) -> None:
    assert tomllib.loads(f"key = {FORMATS.toml_string(text)}") == {"key": text}


@pytest.mark.parametrize("text", HOSTILE_TEXT, ids=IDS)
def test_toml_key_is_one_key_that_reads_back_exactly(text: str) -> None:
    """A dot in a bare key would make a table: `my.project-train = ...`."""
    assert tomllib.loads(f"{FORMATS.toml_key(text)} = 1") == {text: 1}


@pytest.mark.parametrize("text", HOSTILE_TEXT, ids=IDS)
def test_yaml_string_reads_back_exactly(text: str) -> None:
    assert yaml.safe_load(f"key: {FORMATS.yaml_string(text)}\nnext: 1\n") == {
        "key": text,
        "next": 1,
    }


@pytest.mark.parametrize("text", HOSTILE_TEXT, ids=IDS)
def test_python_string_reads_back_exactly_in_ascii(text: str) -> None:
    literal = FORMATS.python_string(text)
    assert literal.isascii()
    assert ast.literal_eval(literal) == text


@pytest.mark.parametrize(
    "text", [*HOSTILE_TEXT, "word " * 60, "x" * 150], ids=[*IDS, "long", "word"]
)
def test_python_docstring_reads_back_exactly(text: str) -> None:
    docstring = FORMATS.python_string(text, docstring=True)
    assert ast.get_docstring(ast.parse(docstring), clean=False) == text


def test_long_python_docstring_is_continued_over_lines_that_fit() -> None:
    docstring = FORMATS.python_string("Train a large model on many nodes. " * 10, docstring=True)
    lines = docstring.splitlines()
    assert len(lines) > 1
    assert all(len(line) <= FORMATS.PYTHON_LINE_LENGTH for line in lines)
    assert all(line.endswith(" \\") for line in lines[:-1])


def test_python_strings_pass_the_rendered_projects_ruff(tmp_path: Path) -> None:
    """Quotes as ruff's formatter picks them, no look-alike characters (RUF001-RUF003)."""
    long_text = "Fast training \u2013 on many GPUs. " * 5
    blocks = []
    for i, text in enumerate(HOSTILE_TEXT):
        blocks.append(f"X{i} = {FORMATS.python_string(text)}")
        blocks.append(f"def f{i}() -> None:\n    {FORMATS.python_string(text, docstring=True)}")
    docstring = FORMATS.python_string(long_text, docstring=True)
    module = docstring + "\n\n" + "\n\n\n".join(blocks) + "\n"
    (tmp_path / "m.py").write_text(module)
    # The rendered project's own pyproject.toml, for its ruff settings.
    template = (ROOT / "{{cookiecutter.__project_dir}}" / "pyproject.toml").read_text()
    environment = jinja2.Environment(extensions=[FORMATS.FormatFilters])
    pyproject = environment.from_string(template).render(cookiecutter=VALID)
    (tmp_path / "pyproject.toml").write_text(pyproject)
    ruff = str(Path(sys.executable).parent / "ruff")
    for command in (["check", "--no-cache"], ["format", "--check", "--diff", "--no-cache"]):
        result = subprocess.run([ruff, *command, "m.py"], cwd=tmp_path, capture_output=True)
        assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


def test_shell_quote_makes_one_word_that_reads_back_exactly() -> None:
    """`$(...)`, backticks and globs stay text; each value is exactly one argument."""
    texts = HOSTILE_TEXT
    words = " ".join(FORMATS.shell_quote(text) for text in texts)
    result = subprocess.run(
        ["bash", "-c", f"printf '%s\\0' {words}"], capture_output=True, check=True, cwd="/"
    )
    assert result.stdout.decode().split("\0")[:-1] == texts


@pytest.mark.parametrize("text", HOSTILE_TEXT, ids=IDS)
def test_json_value_reads_back_exactly(text: str) -> None:
    assert json.loads(FORMATS.json_value(text)) == text


@pytest.mark.parametrize(
    ("name", "value", "written"),
    [
        ("toml_string", "DDP Project", '"DDP Project"'),
        ("toml_string", "Zoë Ünal", '"Zoë Ünal"'),
        ("toml_key", "ddp-project-train", "ddp-project-train"),
        ("toml_key", "my.project-train", '"my.project-train"'),
        ("yaml_string", "3.11", '"3.11"'),
        ("python_string", "ddp-project", '"ddp-project"'),
        ("python_string", 'say "hi"', "'say \"hi\"'"),
        ("shell_quote", "ddp-project", "ddp-project"),
        ("shell_quote", "a b", "'a b'"),
        ("json_value", "Zoë", '"Zoë"'),
        ("json_value", True, "true"),
    ],
)
def test_value_that_needs_no_escaping_is_written_as_by_hand(
    name: str, value: object, written: str
) -> None:
    assert FORMATS.FILTERS[name](value) == written


def test_module_docstring_that_fits_stays_on_one_line() -> None:
    text = "Distributed PyTorch training with DistributedDataParallel."
    assert FORMATS.python_string(text, docstring=True) == f'"""{text}"""'


@pytest.mark.parametrize("slug", ["ddp-project", "my.project", "A1", "a" * 50])
def test_valid_slug_names_the_project_directory(slug: str) -> None:
    assert FORMATS.project_dir(slug) == slug


@pytest.mark.parametrize(
    "slug", ["", ".", "..", "../escape", "a/b", "ddp\n", "a" * 51, "a" * 300, None, 42]
)
def test_refused_slug_renders_into_a_fixed_safe_directory(slug: object) -> None:
    """The hook runs inside the project directory: it must be creatable for any slug, so that
    the hook, not the file system, says what is wrong."""
    assert FORMATS.project_dir(slug) == FORMATS.INVALID_SLUG_DIRECTORY


def test_extension_registers_every_filter_and_the_template_directory() -> None:
    environment = jinja2.Environment(extensions=[FORMATS.FormatFilters])
    assert set(FORMATS.FILTERS) <= set(environment.filters)
    assert environment.globals["template_dir"] == str(ROOT)


def test_extension_is_the_one_cookiecutter_json_names() -> None:
    context = json.loads((ROOT / "cookiecutter.json").read_text())
    assert context["_extensions"] == ["template_extensions.FormatFilters"]


#: Renders a template twice in one process, as `cruft update` does: the first checkout, then
#: the next one written over it in the same directory. The next release's extension here swaps
#: the torch floor's numbers (pyproject.toml's `torch>=2.13` becomes `torch>=13.2`), in a file of
#: the same size and modification time, which Python's bytecode check cannot tell apart.
TWO_CHECKOUTS = """
import os, sys
from pathlib import Path
from cookiecutter.main import cookiecutter

template, out = Path(sys.argv[1]), Path(sys.argv[2])
cookiecutter(str(template), no_input=True, output_dir=str(out / "first"))
extension = template / "template_extensions.py"
before = extension.stat()
text = extension.read_text()
old, new = 'return f"{major}.{minor}"', 'return f"{minor}.{major}"'
assert text.count(old) == 1
extension.write_text(text.replace(old, new))
os.utime(extension, ns=(before.st_atime_ns, before.st_mtime_ns))
assert extension.stat().st_size == before.st_size
cookiecutter(str(template), no_input=True, output_dir=str(out / "second"))
"""


def test_a_checkout_rendered_after_another_in_one_process_gets_its_own_extension(
    tmp_path: Path,
) -> None:
    """An update from 0.4.0 failed on `'torch_floor' is undefined`: the new release's render
    was given the module Python had cached for the old one."""
    template = tmp_path / "template"
    copy_template(template)
    # Bytecode written, as where nothing turns it off.
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    result = subprocess.run(
        [sys.executable, "-c", TWO_CHECKOUTS, str(template), str(tmp_path)],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    floors = []
    for render in ("first", "second"):
        pyproject = tomllib.loads((tmp_path / render / "ddp-project/pyproject.toml").read_text())
        floors += [spec for spec in pyproject["project"]["dependencies"] if "torch" in spec]
    major, minor = FORMATS.torch_floor().split(".")
    assert floors == [f"torch>={major}.{minor},<3", f"torch>={minor}.{major},<3"]
