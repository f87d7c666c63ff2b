"""Option combinations, derived from cookiecutter.json: every valid one, and a pairwise cover."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONTEXT = json.loads((ROOT / "cookiecutter.json").read_text())
#: Every option with a fixed set of values: choice lists, and booleans.
CHOICES = {
    name: value if isinstance(value, list) else [True, False]
    for name, value in CONTEXT.items()
    if not name.startswith("_") and isinstance(value, (list, bool))
}
DEFAULTS = {name: values[0] for name, values in CHOICES.items()}
RULES = CONTEXT["_invalid_combinations"]


def is_refused(combo: dict) -> bool:
    """True when a rule of `_invalid_combinations` matches (value equal, or in a list)."""
    return any(
        all(
            combo[key] in value if isinstance(value, list) else combo[key] == value
            for key, value in rule["when"].items()
        )
        for rule in RULES
    )


def valid_combinations() -> list[dict]:
    names = list(CHOICES)
    products = itertools.product(*CHOICES.values())
    every = (dict(zip(names, values, strict=True)) for values in products)
    return [combo for combo in every if not is_refused(combo)]


def _pairs(combo: dict) -> set[tuple]:
    return set(itertools.combinations(sorted(combo.items(), key=str), 2))


def pairwise_cover() -> list[dict]:
    """A small set of valid combinations in which every pair of option values that can occur
    together occurs at least once. Greedy and deterministic; the default comes first."""
    candidates = valid_combinations()
    uncovered = set().union(*(_pairs(combo) for combo in candidates))
    chosen = [DEFAULTS]
    uncovered -= _pairs(DEFAULTS)
    while uncovered:
        best = max(candidates, key=lambda combo: len(_pairs(combo) & uncovered))
        chosen.append(best)
        uncovered -= _pairs(best)
    return chosen


def combo_id(combo: dict) -> str:
    return "-".join(f"{key}={value}" for key, value in combo.items())
