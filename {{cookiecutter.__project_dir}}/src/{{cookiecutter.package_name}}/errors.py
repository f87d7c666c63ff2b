"""ConfigError, the error of a refused setting, in a module that imports nothing.

The config reads task.py (its TaskConfig is the `task` section) and, for the gpt example, the
token shards' manifest, and both of those refuse settings of their own. With the error here,
each imports it without importing the config package, and no module of the package imports one
that imports it back. `from .config import ConfigError`, as task.py files before this release
wrote it, keeps working: the config package exports the same class.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type or out of range."""
