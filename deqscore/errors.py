"""Errors that describe a usage mistake rather than a bug.

A :class:`ConfigError` names the option and the values it accepts. ``train.py`` and ``sample.py`` print it
as one line and exit with status 2; any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable


class NamesAnOption:
    """An error about one option: ``key`` is its name among its class's arguments (``val_fraction``), which the
    command line turns into the option to write (``--data.init_args.val_fraction``); None when there is none."""

    def __init__(self, *args: object, key: str | None = None):
        super().__init__(*args)
        self.key = key


class ConfigError(NamesAnOption, ValueError):
    """A configuration value is unknown, of the wrong kind or out of range."""


def _raise(error: type[ValueError], message: str, key: str) -> None:
    # ``key`` is a label ending with the option's name (``DEQ tol``): the name is what the error carries
    raise error(message, key=key.split()[-1]) if issubclass(error, NamesAnOption) else error(message)


def choice_error(key: str, value: object, accepted: Iterable[object]) -> ConfigError:
    """``ConfigError`` for ``key=value`` outside ``accepted``, listing the accepted values."""
    names = ", ".join(repr(a) for a in accepted)
    return ConfigError(f"unknown {key} {value!r}; accepted: {names}", key=key.split()[-1])


def check_real(
    key: str, value: object, high: float = math.inf, high_closed: bool = True, error: type[ValueError] = ConfigError
) -> None:
    """Raise ``error`` naming ``key`` (the option's name, after its owner's: ``DEQ tol``) unless ``value`` is a
    finite real number in ``(0, high]`` (``(0, high)`` with ``high_closed=False``). NaN and Inf are refused
    explicitly: ``value <= 0`` is False for NaN."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _raise(error, f"{key} must be a number, got {value!r}", key)
    if not math.isfinite(value):
        _raise(error, f"{key} must be finite, got {value}", key)
    if value <= 0:
        _raise(error, f"{key} must be positive, got {value}", key)
    if value > high or (value == high and not high_closed):
        interval = f"(0, {high:g}]" if high_closed else f"(0, {high:g})"
        _raise(error, f"{key} must lie in {interval}, got {value}", key)


def check_count(
    key: str, value: object, low: int = 1, why: str = "", error: type[ValueError] = ConfigError
) -> None:
    """Raise ``error`` naming ``key`` unless ``value`` is an int >= ``low`` (a bool or float is not); ``why`` is
    appended to the message of an out-of-range value."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _raise(error, f"{key} must be an int >= {low}, got {value!r}", key)
    if value < low:
        _raise(error, f"{key} must be >= {low}, got {value}{why}", key)
