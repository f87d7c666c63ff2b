"""Option combinations, derived from cookiecutter.json: every valid one, and a pairwise cover."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable
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


def _tuples(combo: dict, names: Iterable[str], strength: int) -> set[tuple]:
    """The `strength`-sized sets of (option, value) that `combo` holds among `names`."""
    chosen = sorted((name, combo[name]) for name in names)
    return set(itertools.combinations(chosen, strength))


def cover(
    strength: int = 2, names: Iterable[str] = CHOICES, start: Iterable[dict] = (DEFAULTS,)
) -> list[dict]:
    """A small set of valid combinations in which every `strength` values of the options
    `names` that can occur together occur at least once (strength 2: every pair; 1: every
    value): the combinations of `start`, then greedy and deterministic choices, where the
    options outside `names` keep their first (default) values wherever they can."""
    names = list(names)
    candidates = valid_combinations()
    uncovered = set().union(*(_tuples(combo, names, strength) for combo in candidates))
    chosen = list(start)
    for combo in chosen:
        uncovered -= _tuples(combo, names, strength)
    while uncovered:
        best = max(candidates, key=lambda combo: len(_tuples(combo, names, strength) & uncovered))
        chosen.append(best)
        uncovered -= _tuples(best, names, strength)
    return chosen


def pairwise_cover() -> list[dict]:
    """Every pair of option values that can occur together, in few combinations; the default
    comes first."""
    return cover(2)


def combo_id(combo: dict) -> str:
    return "-".join(f"{key}={value}" for key, value in combo.items())
