"""Jinja filters that write an answer into each file format of the rendered project.

The pre-generation hook decides which answers are allowed; these filters make sure that an
allowed answer lands in a file as data of that file's format and never as its syntax: a quote
in a name cannot end a TOML string, a dot in the slug cannot open a TOML table, `$(...)` in a
description cannot run in a shell. A value that needs no escaping comes out as a person would
have written it (`"DDP Project"`, `ddp-project-train`), so default renders read as hand-written.

cookiecutter loads `FormatFilters` through `_extensions` in cookiecutter.json and puts this
directory on `sys.path` while it renders. The pre-generation hook loads this file too, for the
slug rule that also names the project directory; it finds it through the `template_dir` global,
because cookiecutter may give the hook a template path relative to a directory it has left.

The extension is loaded before the first question too, which is where `ConditionalQuestions`
takes effect: it leaves out the questions that an earlier answer makes pointless.

One process may render two checkouts of the template from one directory: `cruft update`
renders the project's release, then the new one, and cookiecutter imports `_extensions` by
module name. Python would hand the second render the module cached from the first, with the
first release's filters and globals (from 0.4.0, whose module was `local_extensions`, an update
failed on `'torch_floor' is undefined`). So this module takes itself out of `sys.modules` each
time cookiecutter has made its extension (`forget_this_module`): every environment imports the
file of the checkout it renders.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
import sys
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any, TypeGuard

from cookiecutter import prompt
from jinja2 import Environment
from jinja2.ext import Extension

#: Resolved on import, while the working directory is still the one the template path is
#: relative to.
TEMPLATE_DIR = Path(__file__).resolve().parent

#: A slug: ASCII letters and digits, words joined by one '.', '_' or '-'. That is a valid
#: distribution name (PEP 508), directory name, Docker image name (lowercased) and shell word.
SLUG = re.compile(r"[A-Za-z0-9]+(?:[._-][A-Za-z0-9]+)*")
#: Long enough for any real name, far below the file systems' 255-byte limit on a path part;
#: the default slug is cut to it (cookiecutter.json), and the package name derived from it fits
#: the hook's limit on package names.
MAX_SLUG = 50
#: The directory a refused slug renders into, so that the hook gets to say why it is refused
#: (a 300-character name would fail with a traceback as cookiecutter creates the directory).
INVALID_SLUG_DIRECTORY = "invalid-project-slug"
#: TOML keys that may stay bare; anything else (a dot would open a table) is quoted.
BARE_TOML_KEY = re.compile(r"[A-Za-z0-9_-]+")
#: Escapes understood alike by TOML, YAML and Python double-quoted strings.
SHORT_ESCAPES = {"\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}
#: Ruff's line length in the rendered project: a longer docstring line fails its lint.
PYTHON_LINE_LENGTH = 100


@functools.cache
def pinned_version(package: str) -> str:
    """The version of `package` that the template's tests install (requirements-test.txt), so
    that a rendered project pins the tools the template was checked with, in one place."""
    requirements = (TEMPLATE_DIR / "requirements-test.txt").read_text(encoding="utf-8")
    match = re.search(rf"^{re.escape(package)}==(\S+)$", requirements, re.MULTILINE)
    if match is None:
        raise LookupError(f"requirements-test.txt pins no version of {package}")
    return match.group(1)


def torch_floor() -> str:
    """The oldest torch a rendered project allows, major.minor: the one the template's tests
    run with, since no older one is tested."""
    major, minor = pinned_version("torch").split(".")[:2]
    return f"{major}.{minor}"


def is_slug(value: object) -> TypeGuard[str]:
    """Whether `value` may name the project directory, distribution and Docker image."""
    return isinstance(value, str) and len(value) <= MAX_SLUG and SLUG.fullmatch(value) is not None


def project_dir(slug: object) -> str:
    """The project directory's name: the slug, or a fixed safe name for a slug the hook refuses."""
    return slug if is_slug(slug) else INVALID_SLUG_DIRECTORY


def _escape_char(char: str) -> str:
    """One character as an escape that TOML, YAML and Python all read the same way."""
    code = ord(char)
    if char in SHORT_ESCAPES:
        return SHORT_ESCAPES[char]
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def _quoted(value: object, quote: str, needs_escape: Callable[[str], bool]) -> str:
    """`value` between `quote`s, with backslash escapes for `quote`, backslashes and every
    character `needs_escape` picks; lowercase hex, as ruff formats escapes."""
    text = str(value)
    body = "".join(
        "\\" + char
        if char == quote
        else _escape_char(char)
        if char == "\\" or needs_escape(char)
        else char
        for char in text
    )
    return quote + body + quote


def _not_printable(char: str) -> bool:
    """Control, format and separator characters: invisible, or line breaks to some parser."""
    return not char.isprintable()


def toml_string(value: object) -> str:
    """A TOML basic string (`"..."`): control characters, DEL and other unprintable ones are
    escaped, printable Unicode is kept as it is."""
    return _quoted(value, '"', _not_printable)


def toml_key(value: object) -> str:
    """A TOML key that is exactly `value`: bare where TOML allows it, quoted otherwise (a bare
    `my.project-train` would be the key `project-train` of a table `my`)."""
    text = str(value)
    return text if BARE_TOML_KEY.fullmatch(text) else toml_string(text)


def yaml_string(value: object) -> str:
    """A YAML double-quoted scalar: always a string (never `yes`, `null` or a number), with
    unprintable characters and YAML's extra line breaks (NEL, U+2028, U+2029) escaped."""
    return _quoted(value, '"', _not_printable)


def _not_printable_ascii(char: str) -> bool:
    """For Python source: anything ruff might flag as a look-alike, and the unprintable."""
    return not (char.isascii() and char.isprintable())


def python_string(value: object, docstring: bool = False) -> str:
    """A Python string literal whose value is exactly `value`, in the quotes ruff's formatter
    picks, with every non-ASCII character escaped: ruff flags letters that look like ASCII ones
    (an en dash, a Cyrillic `a`) in strings and docstrings.

    With `docstring=True`, a triple-quoted literal; one longer than the project's line length
    is continued over lines ending in a backslash, which adds no character to the value, and a
    space at either end is escaped, which ruff's formatter would otherwise strip.
    """
    text = str(value)
    if not docstring:
        quote = "'" if text.count('"') > text.count("'") else '"'
        return _quoted(text, quote, _not_printable_ascii)
    body = _quoted(text, '"', _not_printable_ascii)[1:-1]
    # ruff's formatter strips whitespace at either end of a docstring; an escape keeps it.
    body = re.sub(r"^ | $", r"\\x20", body)
    return '"""' + _wrap(body, PYTHON_LINE_LENGTH - len('""""""')) + '"""'


def _wrap(body: str, width: int) -> str:
    """Break `body` after spaces into lines of at most `width` characters, the line-continuation
    backslash that ends all but the last included; a word longer than a line stays whole."""
    lines = [""]
    for word in re.findall(r"[^ ]* *", body)[:-1]:
        if lines[-1] and len(lines[-1]) + len(word) + len("\\") > width:
            lines.append("")
        lines[-1] += word
    return "\\\n".join(lines)


def shell_quote(value: object) -> str:
    """One shell word: the value as it is when it holds no special character, else in single
    quotes, so that `$(...)`, backticks, globs and spaces are plain text."""
    return shlex.quote(str(value))


def json_value(value: object) -> str:
    """A JSON value; non-ASCII text stays readable (`"Zoë"`, not `"Zo\\u00eb"`)."""
    return json.dumps(value, ensure_ascii=False)


#: Filter name in templates -> function.
FILTERS: dict[str, Callable[..., str]] = {
    "toml_string": toml_string,
    "toml_key": toml_key,
    "yaml_string": yaml_string,
    "python_string": python_string,
    "shell_quote": shell_quote,
    "json_value": json_value,
    "project_dir": project_dir,
}


#: The functions of `cookiecutter.prompt` that ask one question each: (name, value) -> answer,
#: where the value is the default, or the list of choices whose first is the default.
QUESTION_FUNCTIONS = ("read_user_variable", "read_user_yes_no", "read_user_choice")


@functools.cache
def ask_only_if_rules() -> tuple[tuple[dict[str, object], frozenset[str]], ...]:
    """cookiecutter.json's `_ask_only_if`: (answers that must have been given, the questions
    asked only then)."""
    template = json.loads((TEMPLATE_DIR / "cookiecutter.json").read_text(encoding="utf-8"))
    return tuple((rule["when"], frozenset(rule["ask"])) for rule in template["_ask_only_if"])


class ConditionalQuestions:
    """Leaves out the questions that earlier answers make pointless (no Slurm details after
    "no" to use_slurm), by the `_ask_only_if` rules of cookiecutter.json.

    cookiecutter has no conditional questions (its issues 913, 1021 and 1914), so this wraps the
    functions of `cookiecutter.prompt` that ask one question each: every answer is remembered,
    and a question that an earlier answer rules out is given its default without being asked.
    Only questions go through them: `--no-input` with `key=value` overrides, replay files and
    cruft's updates set every key exactly as before, and the pre-generation hook validates them
    all. A cookiecutter without these functions asks every question, as without this class.
    """

    def __init__(self) -> None:
        self.answers: dict[str, object] = {}

    def is_ruled_out(self, name: str) -> bool:
        """Whether an answer given so far differs from one that a rule asks `name` after; an
        answer not given yet rules nothing out."""
        return any(
            self.answers.get(key, value) != value
            for when, asked in ask_only_if_rules()
            if name in asked
            for key, value in when.items()
        )

    def wrap(self, ask: Callable[..., Any]) -> Callable[..., Any]:
        """`ask`, which asks the question `name` with the default (or choices) `value`, made to
        remember its answer and to answer a ruled-out question with the default itself."""

        @functools.wraps(ask)
        def ask_unless_ruled_out(name: str, value: object, *args: Any, **kwargs: Any) -> Any:
            if self.is_ruled_out(name):
                answer = value[0] if isinstance(value, list) else value
            else:
                answer = ask(name, value, *args, **kwargs)
            self.answers[name] = answer
            return answer

        ask_unless_ruled_out.conditional = True  # type: ignore[attr-defined]
        return ask_unless_ruled_out

    def install(self) -> None:
        """Wrap cookiecutter's question functions, in place of a wrapper an earlier import of
        this file installed: cookiecutter makes a new Jinja environment before the first
        question of every generation, and the template it renders may be another release, whose
        rules are the ones to follow."""
        for name in QUESTION_FUNCTIONS:
            ask = getattr(prompt, name, None)
            if ask is None:
                continue
            while getattr(ask, "conditional", False):
                ask = ask.__wrapped__
            setattr(prompt, name, self.wrap(ask))


class FormatFilters(Extension):
    """Registers `FILTERS`, `template_dir` for the hooks, `ruff_version` and `cruft_version`
    for the tool pins and `torch_floor` in cookiecutter's Jinja environment, and leaves out
    pointless questions (`ConditionalQuestions`)."""

    def __init__(self, environment: Environment) -> None:
        super().__init__(environment)
        environment.filters.update(FILTERS)
        environment.globals["template_dir"] = str(TEMPLATE_DIR)
        environment.globals["ruff_version"] = pinned_version("ruff")
        environment.globals["cruft_version"] = pinned_version("cruft")
        environment.globals["torch_floor"] = torch_floor()
        ConditionalQuestions().install()
        forget_this_module()


def forget_this_module() -> None:
    """Take this module out of `sys.modules`, with its bytecode: the next Jinja environment then
    imports the file of the template checkout it renders, not this one.

    Only the module cookiecutter imported is taken out (one loaded from a path, as the hook and
    the tests load it, is in no `sys.modules` entry). The bytecode goes too: Python trusts a
    cached file whose source has the same size and modification second, which a checkout of
    the next release written within the same second as this import can have.
    """
    module = sys.modules.get(__name__)
    if module is None or vars(module) is not globals():
        return
    del sys.modules[__name__]
    bytecode = globals().get("__cached__")
    if bytecode:
        with suppress(OSError):
            Path(bytecode).unlink()
