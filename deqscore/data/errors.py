"""Errors shared by the data loaders of every dataset (kept apart so that any loader can raise them)."""

from __future__ import annotations

from ..errors import NamesAnOption

__all__ = ["CorruptDataError", "DataNotFoundError"]


class CorruptDataError(NamesAnOption, ValueError):
    """A data file exists but cannot be decoded or has unexpected content; the message names the file."""


class DataNotFoundError(NamesAnOption, FileNotFoundError):
    """A data set is not where it is looked for (and could not be downloaded); the message says what to put where."""
