"""Write docs/options.md from cookiecutter.json, the single source of truth for options.

Run `make docs` after changing cookiecutter.json; a test fails while the page is stale.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPTIONS_PAGE = ROOT / "docs" / "options.md"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def _yes_no(value: object) -> object:
    return {True: "yes", False: "no"}.get(value, value) if isinstance(value, bool) else value


def _answers(when: dict) -> str:
    """A rule's answers, as `key=value` in the page's words."""
    return " and ".join(f"`{key}={_yes_no(value)}`" for key, value in when.items())


def render_options_page(context: dict) -> str:
    """The Markdown page: one row per option, then the rules that reject combinations."""
    prompts = context.get("__prompts__", {})
    asked_only_when = {
        name: rule["when"] for rule in context.get("_ask_only_if", []) for name in rule["ask"]
    }
    lines = [
        "# Template options",
        "",
        "Generated from `cookiecutter.json` by `docs/generate_options.py`; do not edit by hand.",
        "Pass any of them on the command line, e.g.",
        "`cookiecutter gh:org/ddp-template --no-input use_slurm=no tracker=wandb`.",
        "A question asked only after certain answers keeps its default when it is not asked;",
        "on the command line it can always be set.",
        "",
        "| option | question | default | choices |",
        "| --- | --- | --- | --- |",
    ]
    for name, value in context.items():
        if name.startswith("_"):
            continue
        prompt = prompts.get(name, "")
        if isinstance(prompt, dict):
            labels = {k: v for k, v in prompt.items() if k != "__prompt__" and v != k}
            prompt = prompt.get("__prompt__", "")
        else:
            labels = {}
        if name in asked_only_when:
            prompt += f"; asked only after {_answers(asked_only_when[name])}"
        if isinstance(value, list):
            default = f"`{value[0]}`"
            choices = ", ".join(
                f"`{choice}` ({labels[choice]})" if choice in labels else f"`{choice}`"
                for choice in value
            )
        elif isinstance(value, bool):
            default, choices = f"`{_yes_no(value)}`", "`yes`, `no`"
        elif "{{" in str(value):
            default, choices = f"derived: `{value}`", "any valid value"
        else:
            default, choices = (f"`{value}`" if value else "empty"), "any text"
        lines.append(f"| `{name}` | {_cell(prompt)} | {_cell(default)} | {_cell(choices)} |")
    rules = context.get("_invalid_combinations", [])
    if rules:
        lines += ["", "## Combinations that are refused", ""]
        for rule in rules:
            when = ", ".join(
                f"`{key}` in {', '.join(f'`{v}`' for v in value)}"
                if isinstance(value, list)
                else f"`{key}={_yes_no(value)}`"
                for key, value in rule["when"].items()
            )
            message = re.sub(r"\{(\w+)\}", r"<\1>", rule["message"])
            lines.append(f"- {when}: {message}")
    return "\n".join(lines) + "\n"


def main() -> None:
    context = json.loads((ROOT / "cookiecutter.json").read_text())
    OPTIONS_PAGE.write_text(render_options_page(context))
    print(f"wrote {OPTIONS_PAGE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
