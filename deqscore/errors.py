"""Errors that describe a usage mistake rather than a bug.

A :class:`ConfigError` names the option and the values it accepts. ``train.py`` and ``sample.py`` print it
as one line and exit with status 2; any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

from collections.abc import Iterable


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong kind or out of range."""


def choice_error(key: str, value: object, accepted: Iterable[object]) -> ConfigError:
    """``ConfigError`` for ``key=value`` outside ``accepted``, listing the accepted values."""
    names = ", ".join(repr(a) for a in accepted)
    return ConfigError(f"unknown {key} {value!r}; accepted: {names}")
