"""The user-mistake error every layer raises; its own module so that any module can raise it."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user mistake (configuration, data, run folder); the CLI prints it in one line and exits 2."""
