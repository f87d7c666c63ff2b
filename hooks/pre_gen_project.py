"""Validate every answer before anything is rendered.

Every problem is reported as `ERROR: <what> <why> <how to fix>` and generation stops with exit
status 1; cookiecutter then removes the half-made project directory, so nothing is left behind.
The answers arrive as JSON data, never as Python source, so no answer can run code here.

`VALIDATORS` holds one row for every key the render sees: the options of cookiecutter.json, its
private and derived keys, and the keys cookiecutter adds itself. A key without a row is refused,
because a replay file (`cookiecutter --replay-file`) is used as it is, private keys included: it
could otherwise name the project directory itself or switch on cookiecutter settings the
template never uses (`_copy_without_render`). For the same reason the choice lists and the
combination rules are read from the template's own cookiecutter.json, never from the answers.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import keyword
import re
import sys
import types
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

CONTEXT = json.loads(r"""{{ cookiecutter | tojson }}""")
#: Set by the template's Jinja extension; None when the answers dropped it from `_extensions`.
#: (In a list, so that the JSON text cannot end in a quote next to the closing quotes.)
TEMPLATE_DIR = json.loads(r"""[{{ template_dir | default(none) | tojson }}]""")[0]

MIN_COOKIECUTTER = (2, 7)
MAX_PACKAGE_NAME = 50
#: Import names the generated project depends on or ships as top-level directories.
RESERVED_PACKAGE_NAMES = {
    "alembic",
    "configs",
    "cookiecutter",
    "docs",
    "hatchling",
    "launch",
    "mlflow",
    "numpy",
    "pip",
    "pytest",
    "ruff",
    "setuptools",
    "sqlalchemy",
    "src",
    "tensorboard",
    "tests",
    "torch",
    "wandb",
    "yaml",
}
PACKAGE = re.compile(r"[a-z_][a-z0-9_]*")
#: name@host.tld as people type it: a dot-atom before the @ (RFC 5322, so no spaces, quotes,
#: backslashes or angle brackets), dot-separated host labels after it, all ASCII.
ATOM = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
EMAIL = re.compile(rf"{ATOM}(?:\.{ATOM})*@(?:{LABEL}\.)+[A-Za-z](?:[A-Za-z0-9-]*[A-Za-z0-9])?")
#: The longest address SMTP can carry (RFC 5321).
MAX_EMAIL = 254
#: Partition and account names, or comma-separated lists of them; empty means the default.
SLURM_NAME = re.compile(r"[A-Za-z0-9_.-]+(?:,[A-Za-z0-9_.-]+)*")
#: Slurm's time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S (ASCII digits only).
SLURM_TIME = re.compile(
    r"[0-9]{1,6}|[0-9]{1,6}:[0-9]{1,2}|[0-9]{1,6}:[0-9]{1,2}:[0-9]{1,2}"
    r"|[0-9]{1,4}-[0-9]{1,2}(?::[0-9]{1,2}){0,2}"
)
#: A whole number in ASCII digits without leading zeros (`str.isdigit` also takes '٣').
WHOLE_NUMBER = re.compile(r"0|[1-9][0-9]{0,5}")
#: Where a text answer goes, for the messages.
TEXT_FILES = "pyproject.toml, the README and the LICENSE"


@dataclass(frozen=True)
class Answers:
    """The answers, with what they are checked against."""

    values: dict[str, object]
    #: cookiecutter.json as the template ships it: choice lists and rules the answers cannot set.
    template: dict[str, object]
    #: The template's template_extensions.py: the slug rule, shared with the filter that names the
    #: project directory.
    formats: types.ModuleType


#: (option name, its value, all answers) -> what is wrong with the value, or None.
Validator = Callable[[str, object, Answers], str | None]


def _show(value: object) -> str:
    """The value as Python writes it (control characters visible), cut to a readable length."""
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def _char(char: str) -> str:
    """A character by code point and name: an unprintable one cannot be shown as it is."""
    return f"U+{ord(char):04X} ({unicodedata.name(char, 'a control character')})"


def _too_long(name: str, value: str, limit: int, why: str) -> str | None:
    """Refuses text over `limit` characters, saying `why` the limit is there."""
    if len(value) <= limit:
        return None
    return (
        f"{name} {_show(value)} is {len(value)} characters long; keep it to {limit} {why}. "
        f"Pass a shorter {name}=..."
    )


#: (option name, its value as text, all answers) -> what is wrong with the value, or None.
TextCheck = Callable[[str, str, Answers], str | None]


def text_option(example: str) -> Callable[[TextCheck], Validator]:
    """Make a check of text into a validator that first refuses any other type: a replay file
    can hold any JSON value (a number, a list, null) where the template expects text."""

    def decorate(check: TextCheck) -> Validator:
        @functools.wraps(check)
        def validate(name: str, value: object, answers: Answers) -> str | None:
            if isinstance(value, str):
                return check(name, value, answers)
            return (
                f"{name} {_show(value)} is {type(value).__name__}, not text: a replay file must "
                f"give it as a JSON string. Pass e.g. {name}={example}"
            )

        return validate

    return decorate


def one_line_text(example: str, max_length: int) -> Validator:
    """Free text (a name, a description): printable characters on one line, trimmed, bounded.

    Unprintable characters (line breaks, DEL, zero-width and bidirectional controls) would
    break or disguise the line in every file the text is written to; surrounding whitespace
    would become trailing whitespace that the project's own pre-commit hooks reject."""

    @text_option(example)
    def validate(name: str, value: str, answers: Answers) -> str | None:
        unprintable = [char for char in value if not char.isprintable()]
        if not value.strip() or unprintable:
            found = f" (it holds {_char(unprintable[0])})" if unprintable else ""
            return (
                f"{name} {_show(value)} must be one non-empty line of printable characters"
                f"{found}: it is written into {TEXT_FILES}. Pass e.g. {name}={example}"
            )
        if value != value.strip():
            return (
                f"{name} {_show(value)} starts or ends with whitespace, which would be trailing "
                f"whitespace in {TEXT_FILES}. Pass {name}={value.strip()!r}"
            )
        return _too_long(name, value, max_length, "to keep the files readable")

    return validate


@text_option("my-project")
def project_slug(name: str, value: str, answers: Answers) -> str | None:
    """The slug names the directory, the distribution, the console script and the image."""
    why = "as it names the project directory, the distribution and the Docker image"
    if (wrong := _too_long(name, value, answers.formats.MAX_SLUG, why)) is not None:
        return wrong
    if not answers.formats.is_slug(value):
        return (
            f"{name} {_show(value)} is not a safe directory name: use ASCII letters and "
            "digits, joined by single '-', '_' or '.' (no spaces or path separators), starting "
            f"and ending with a letter or digit. Pass e.g. {name}=my-project"
        )
    return None


@text_option("my_project")
def package_name(name: str, value: str, answers: Answers) -> str | None:
    """An importable name that shadows nothing the project imports."""
    if not PACKAGE.fullmatch(value):
        return (
            f"{name} {_show(value)} is not a valid import name: use lowercase ASCII letters, "
            f"digits and '_', not starting with a digit. Pass e.g. {name}=my_project"
        )
    if keyword.iskeyword(value) or keyword.issoftkeyword(value):
        return (
            f"{name} {_show(value)} is a Python keyword and cannot be imported. "
            f"Pass e.g. {name}={value}_project"
        )
    if value in sys.stdlib_module_names or value in RESERVED_PACKAGE_NAMES:
        return (
            f"{name} {_show(value)} would shadow the module of the same name in the standard "
            f"library or a dependency. Pass e.g. {name}={value}_project"
        )
    return _too_long(name, value, MAX_PACKAGE_NAME, "so that imports fit on a line")


@text_option("you@example.com")
def email_address(name: str, value: str, answers: Answers) -> str | None:
    """An address that packaging metadata can carry as it is."""
    if len(value) > MAX_EMAIL or not EMAIL.fullmatch(value):
        return (
            f"{name} {_show(value)} is not an email address (name@domain.tld in ASCII, at most "
            f"{MAX_EMAIL} characters, no spaces, quotes or brackets). "
            f"Pass e.g. {name}=you@example.com"
        )
    return None


def choice(name: str, value: object, answers: Answers) -> str | None:
    """One of the values cookiecutter.json lists (a replay file is not checked against it)."""
    choices = answers.template[name]
    assert isinstance(choices, list)
    if isinstance(value, str) and value in choices:
        return None
    return (
        f"{name} {_show(value)} is not one of the choices {', '.join(choices)}. "
        f"Pass e.g. {name}={choices[0]}"
    )


def yes_no(name: str, value: object, answers: Answers) -> str | None:
    """A boolean; a replay file could hold the string "yes" or the number 1 instead."""
    if type(value) is bool:
        return None
    return f"{name} {_show(value)} is not yes or no. Pass {name}=yes or {name}=no"


@text_option("gpu")
def slurm_names(name: str, value: str, answers: Answers) -> str | None:
    """Written into an #SBATCH line as it is: one word of Slurm name characters, or empty."""
    if value and not SLURM_NAME.fullmatch(value):
        return (
            f"{name} {_show(value)} is not a Slurm name: use ASCII letters, digits, '_', '.' "
            "and '-' (a comma-separated list for several), or leave it empty for the default. "
            f"Pass e.g. {name}=gpu"
        )
    return None


def whole_number(minimum: int) -> Validator:
    """A count written into an #SBATCH line: ASCII digits, at least `minimum`."""
    example = str(max(minimum, 1))

    @text_option(example)
    def validate(name: str, value: str, answers: Answers) -> str | None:
        if not WHOLE_NUMBER.fullmatch(value) or int(value) < minimum:
            return (
                f"{name} {_show(value)} must be a whole number >= {minimum} in the digits 0-9 "
                f"(at most 6, no leading zeros). Pass e.g. {name}={example}"
            )
        return None

    return validate


@text_option("24:00:00")
def slurm_time(name: str, value: str, answers: Answers) -> str | None:
    """Written into the #SBATCH --time line: one of Slurm's time formats."""
    if not SLURM_TIME.fullmatch(value):
        return (
            f"{name} {_show(value)} is not a Slurm time: use minutes, HH:MM:SS or D-HH:MM:SS "
            f"in the digits 0-9. Pass e.g. {name}=24:00:00"
        )
    return None


def project_dir(name: str, value: object, answers: Answers) -> str | None:
    """Derived from the slug in cookiecutter.json; a replay file could set it to `../x`.

    cookiecutter derives it from the replayed slug only when the replay file holds it: it
    renders the keys a replay file lacks without the answers the file gives."""
    expected = answers.formats.project_dir(answers.values.get("project_slug"))
    if value == expected:
        return None
    if value == answers.formats.INVALID_SLUG_DIRECTORY:
        return (
            f"{name} is missing from the replay file, and cookiecutter cannot derive it there "
            f'from the replayed project_slug. Add "{name}": {json.dumps(expected)} to the '
            "replay file (projects record it in .cookiecutter.json)"
        )
    return (
        f"{name} {_show(value)} is not the name project_slug gives ({expected!r}): the project "
        f"directory is always named after the slug. Remove {name} from the replay file"
    )


def same_as_template(name: str, value: object, answers: Answers) -> str | None:
    """A template setting that decides how files are rendered: it cannot be changed."""
    expected = answers.template[name]
    if value == expected:
        return None
    return (
        f"{name} {_show(value)} differs from the template's {expected!r}, which renders the "
        f"answers safely into the project's files. Remove {name} from the replay file"
    )


def not_taken_from_answers(name: str, value: object, answers: Answers) -> str | None:
    """Read from the template itself (rules) or only used before this hook (questions)."""
    return None


def set_by_cookiecutter(name: str, value: object, answers: Answers) -> str | None:
    """Where the template and the output are: cookiecutter overwrites any replayed value."""
    return None


def set_by_cruft(name: str, value: object, answers: Answers) -> str | None:
    """The template's commit, which cruft adds and records in .cruft.json; no file uses it."""
    return None


#: Every key of the context -> its validator. A new option needs a row here.
VALIDATORS: dict[str, Validator] = {
    "project_name": one_line_text(example='"My Project"', max_length=100),
    "project_slug": project_slug,
    "package_name": package_name,
    "description": one_line_text(example='"Train a model."', max_length=200),
    "author_name": one_line_text(example='"Ada Lovelace"', max_length=100),
    "author_email": email_address,
    "license": choice,
    "python_version": choice,
    "mixed_precision": choice,
    "example": choice,
    "use_slurm": yes_no,
    "slurm_partition": slurm_names,
    "slurm_account": slurm_names,
    "slurm_nodes": whole_number(minimum=1),
    "slurm_gpus_per_node": whole_number(minimum=0),
    "slurm_cpus_per_process": whole_number(minimum=1),
    "slurm_time_limit": slurm_time,
    "use_docker": yes_no,
    "tracker": choice,
    "ci": choice,
    "__project_dir": project_dir,
    "_extensions": same_as_template,
    "_invalid_combinations": not_taken_from_answers,
    "_ask_only_if": not_taken_from_answers,
    "__prompts__": not_taken_from_answers,
    "_template": set_by_cookiecutter,
    "_output_dir": set_by_cookiecutter,
    "_repo_dir": set_by_cookiecutter,
    "_checkout": set_by_cookiecutter,
    "_commit": set_by_cruft,
}


def cookiecutter_version_error() -> str | None:
    """Older cookiecutters turn "no" into a true string: refuse them before rendering."""
    try:
        found = metadata.version("cookiecutter")
    except metadata.PackageNotFoundError:
        return None
    numbers = tuple(int(part) for part in re.findall(r"\d+", found)[:2])
    if numbers < MIN_COOKIECUTTER:
        return (
            f"this template needs cookiecutter >= 2.7 (found {found}): older versions mishandle "
            "boolean answers. Upgrade with: pip install -U 'cookiecutter>=2.7'"
        )
    return None


def load_answers(context: dict, template_dir: str) -> Answers:
    """The answers with the template's cookiecutter.json and template_extensions.py."""
    root = Path(template_dir)
    template = json.loads((root / "cookiecutter.json").read_text(encoding="utf-8"))
    spec = importlib.util.spec_from_file_location(
        "template_extensions", root / "template_extensions.py"
    )
    assert spec is not None and spec.loader is not None
    formats = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(formats)
    return Answers(values=context, template=template, formats=formats)


def validate(context: dict, template_dir: str | None = TEMPLATE_DIR) -> list[str]:
    """Every problem with the answers, as messages; an empty list means they are fine."""
    if template_dir is None:
        return [
            f"_extensions {_show(context.get('_extensions'))} leaves out the template's own "
            "Jinja extension, which writes the answers safely into the project's files. "
            "Remove _extensions from the replay file"
        ]
    answers = load_answers(context, template_dir)
    errors = [
        f"template bug: option {name} has no validator in hooks/pre_gen_project.py"
        for name in answers.template
        if name not in VALIDATORS
    ]
    for name, value in context.items():
        validator = VALIDATORS.get(name)
        if validator is None:
            errors.append(
                f"{name} is not an option of this template, so the replay file that sets it "
                f"was written for another template or version. Remove {name} from it"
            )
        elif (message := validator(name, value, answers)) is not None:
            errors.append(message)
    rules = answers.template.get("_invalid_combinations", [])
    assert isinstance(rules, list)
    errors += [
        f"invalid combination: {message}" for message in refused_combinations(rules, context)
    ]
    return errors


def refused_combinations(rules: list[dict], context: dict) -> list[str]:
    """Messages of the `_invalid_combinations` rules that match the answers."""
    messages = []
    for rule in rules:
        if all(_matches(context.get(key), value) for key, value in rule["when"].items()):
            messages.append(rule["message"].format(**context))
    return messages


def _matches(answer: object, expected: object) -> bool:
    """A rule's value matches equal answers; a list of values matches any of them."""
    return answer in expected if isinstance(expected, list) else answer == expected


def main() -> int:
    errors = [message for message in [cookiecutter_version_error()] if message]
    errors += validate(CONTEXT)
    for message in errors:
        print(f"ERROR: {message}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
