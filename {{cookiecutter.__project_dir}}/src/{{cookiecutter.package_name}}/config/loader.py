"""Settings onto the schema: a YAML file, then `section.key=value` overrides, each checked.

It works on any tree of dataclasses (the root is given: `Config`, which __init__.py binds): each
value is checked against its field's type, a key no field has is refused naming the valid ones,
and `--help` lists every field with the `#:` comment above it. Nothing here names a section.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import inspect
import math
import re
import types
import typing
from collections.abc import Hashable
from pathlib import Path, PurePath
from typing import Any, Literal, NamedTuple, get_args, get_origin

import yaml

from .schema import Config, ConfigError, field_types, plain, setting_key, validate


class Setting(NamedTuple):
    """One `section.key` of the config, as `--help` lists it."""

    key: str
    type: str
    default: str
    help: str


def load(schema: type[Config], path: str | Path | None, overrides: list[str] | None) -> Config:
    """`schema`'s defaults, with an optional YAML file, then `section.key=value` overrides."""
    values: dict[str, Any] = {}
    if path is not None:
        values = _read_yaml(Path(path))
    for override in overrides or []:
        _apply_override(values, override)
    return build(schema, values)


def build(schema: type[Config], values: dict[str, Any]) -> Config:
    """`schema`'s defaults with `values` (nested as `to_dict()` writes them) applied, checked and
    validated."""
    config = _build(schema(), values, prefix="")
    validate(config)
    return config


def read_checked(schema: type[Config], path: Path) -> Config:
    """`schema`'s defaults with a YAML file applied and type-checked, not validated: `validate`
    says whether training can start here, which a run's own config.yaml passed when written."""
    return _build(schema(), _read_yaml(path), prefix="")


def flatten(values: dict[str, Any], schema: type) -> dict[str, Any]:
    """`section.key` -> value for a nested dict of `schema`'s settings: the overrides' names.

    Only sections (dataclasses) are opened: a dict-valued setting stays one value, so that a key
    added to it is a change of that setting rather than a setting that exists on one side only.
    """
    return _flatten(values, schema, prefix="")


def to_yaml(config: Config) -> str:
    """The resolved config as YAML, in declaration order."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False)


def settings(schema: type) -> list[Setting]:
    """Every `section.key` of `schema()` with its type, default and one-line help, in order."""
    return _settings(schema(), prefix="")


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        with open(path) as handle:  # a stream, so that errors name the file and the line
            loaded = yaml.load(handle, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {error}") from error
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path} must hold a mapping of sections, got {type(loaded).__name__}")
    return loaded


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping: YAML would keep the last
    one silently, so a setting written twice in a config file could quietly lose its first
    value."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # the base loader refuses it, naming it
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"the key {key!r} appears twice in one mapping; keep one of them",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _apply_override(values: dict[str, Any], override: str) -> None:
    key, sep, raw = override.partition("=")
    if not sep or not key or "." not in key:
        raise ConfigError(
            f"override {override!r} must look like section.key=value, e.g. train.epochs=5"
        )
    *sections, leaf = key.split(".")
    node = values
    for section in sections:
        node = node.setdefault(section, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {section!r} is not a section")
    try:
        node[leaf] = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError as error:
        raise ConfigError(f"override {override!r}: cannot parse value {raw!r}: {error}") from error


def _build(base: Any, values: Any, prefix: str) -> Any:
    """`base` (a dataclass instance) with the settings in `values` replaced, each type-checked."""
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {values!r}")
    hints = field_types(type(base))
    names = {setting_key(f): f.name for f in dataclasses.fields(base) if f.init}
    unknown = sorted(set(values) - set(names))
    if unknown:
        where = prefix.rstrip(".") or "top level"
        keys = ", ".join(prefix + str(key) for key in unknown)
        raise ConfigError(f"unknown key(s) {keys} in {where}; valid keys: {', '.join(names)}")
    changes = {
        name: _coerce(values[key], hints[name], prefix + key, getattr(base, name))
        for key, name in names.items()
        if key in values
    }
    return dataclasses.replace(base, **changes)


def _coerce(value: Any, hint: Any, key: str, current: Any = None) -> Any:
    """`value` as the type `hint`, or a ConfigError naming `key` and the type expected."""
    origin, args = get_origin(hint), get_args(hint)
    if dataclasses.is_dataclass(hint):
        # A nested section: unset keys keep the current value, not the class's default.
        return _build(current if isinstance(current, hint) else hint(), value, prefix=f"{key}.")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in (arg for arg in args if arg is not type(None)):
            try:
                return _coerce(value, option, key, current)
            except ConfigError:
                continue
        raise _mismatch(value, hint, key)
    if origin is Literal:
        if any(value == choice and type(value) is type(choice) for choice in args):
            return value
        raise ConfigError(f"{key} must be one of {', '.join(map(str, args))}; got {value!r}")
    if _is_subclass(hint, enum.Enum):
        try:
            return hint(value)
        except (ValueError, TypeError):
            values = ", ".join(str(member.value) for member in hint)
            raise ConfigError(f"{key} must be one of {values}; got {value!r}") from None
    if origin in (list, tuple, dict):
        return _coerce_collection(value, hint, key)
    return _coerce_scalar(value, hint, key)


def _coerce_collection(value: Any, hint: Any, key: str) -> Any:
    """A `list[X]`, `tuple[X, ...]`, fixed tuple or `dict[K, V]`, each item checked by name."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is list and isinstance(value, (list, tuple)):
        return [_coerce(item, args[0], f"{key}[{i}]") for i, item in enumerate(value)]
    if origin is tuple and isinstance(value, (list, tuple)):
        kinds = (args[0],) * len(value) if args[-1:] == (...,) else args
        if len(value) != len(kinds):
            raise ConfigError(f"{key} must be a list of {len(kinds)} values, got {value!r}")
        pairs = enumerate(zip(value, kinds, strict=True))
        return tuple(_coerce(item, kind, f"{key}[{i}]") for i, (item, kind) in pairs)
    if origin is dict and isinstance(value, dict):
        return {
            _coerce(name, args[0], f"a key of {key}"): _coerce(item, args[1], f"{key}.{name}")
            for name, item in value.items()
        }
    raise _mismatch(value, hint, key)


def _coerce_scalar(value: Any, hint: Any, key: str) -> Any:
    """A bool, int, float, str or path: strict, so that `1` is no bool and `"3"` no int."""
    if hint is float:
        return _coerce_float(value, key)
    if hint is bool:
        fits = isinstance(value, bool)
    elif hint is int:
        fits = isinstance(value, int) and not isinstance(value, bool)
    elif hint is str:
        fits = isinstance(value, str)
    elif _is_subclass(hint, PurePath):
        if isinstance(value, (str, PurePath)):
            return hint(value)
        fits = False
    else:
        raise TypeError(f"{key}: type {_type_name(hint)} is not supported in the config")
    if not fits:
        raise _mismatch(value, hint, key)
    return value


def _coerce_float(value: Any, key: str) -> float:
    """A finite number; an int is taken, and a string that reads as a number."""
    number: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):  # YAML reads 1e-4 (no dot) as a string
        with contextlib.suppress(ValueError):
            number = float(value)
    if number is None:
        raise _mismatch(value, float, key)
    if not math.isfinite(number):
        raise ConfigError(f"{key} must be a finite number, got {value!r}")
    return number


def _mismatch(value: Any, hint: Any, key: str) -> ConfigError:
    """The error for a value of another type than its setting's."""
    got = f"{value!r} ({type(value).__name__})"
    return ConfigError(f"{key} must be of type {_type_name(hint)}, got {got}")


def _flatten(values: dict[str, Any], schema: type, prefix: str) -> dict[str, Any]:
    hints = field_types(schema)
    flat: dict[str, Any] = {}
    for key, value in values.items():
        hint = hints.get(key)
        if dataclasses.is_dataclass(hint) and isinstance(value, dict):
            flat.update(_flatten(value, hint, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _settings(section: Any, prefix: str) -> list[Setting]:
    hints = field_types(type(section))
    described = _descriptions(type(section))
    found: list[Setting] = []
    for f in dataclasses.fields(section):
        value, key = getattr(section, f.name), prefix + setting_key(f)
        if dataclasses.is_dataclass(value):
            found += _settings(value, f"{key}.")
        else:
            default = _inline_yaml(plain(value))
            help = described.get(f.name, "")
            found.append(Setting(key, _type_name(hints[f.name]), default, help))
    return found


def _descriptions(cls: type) -> dict[str, str]:
    """Each field's one-line help: the `#:` comment above it (a base class's for inherited ones)."""
    names = {f.name for f in dataclasses.fields(cls)}
    described: dict[str, str] = {}
    for klass in filter(dataclasses.is_dataclass, cls.__mro__):  # the subclass first
        try:
            lines = inspect.getsource(klass).splitlines()
        except (OSError, TypeError):  # no source to read, e.g. the package runs from a zip
            continue
        comment: list[str] = []
        for line in map(str.strip, lines):
            if line.startswith("#:"):
                comment.append(line[2:].strip())
                continue
            named = re.match(r"(\w+)\s*:", line)
            if comment and named and named[1] in names:
                described.setdefault(named[1], " ".join(comment))
            comment = []
    return described


def _type_name(hint: Any) -> str:
    """`hint` as users write it: `int | None`, `list[int]`, `fp16|bf16` for a choice."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is type(None):
        return "None"
    if origin is Literal:
        return "|".join(map(str, args))
    if _is_subclass(hint, enum.Enum):
        return "|".join(str(member.value) for member in hint)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(map(_type_name, args))
    if origin is not None:
        inner = ", ".join("..." if arg is ... else _type_name(arg) for arg in args)
        return f"{origin.__name__}[{inner}]"
    return getattr(hint, "__name__", str(hint))


def _is_subclass(hint: Any, base: type) -> bool:
    """Whether `hint` is a plain class derived from `base` (`list[int]` is not a class here)."""
    return get_origin(hint) is None and isinstance(hint, type) and issubclass(hint, base)


def _inline_yaml(value: Any) -> str:
    """`value` as it is typed in an override: `runs/default`, `[0.9, 0.999]`, `null`."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1_000_000).strip()
    return text.removesuffix("...").strip()
