"""A CSV logger whose ``metrics.csv`` survives a resume (Lightning's own deletes it)."""

from __future__ import annotations

from ..privates import AppendingCSVLogger


class ResumableCSVLogger(AppendingCSVLogger):
    """``CSVLogger`` that appends to the run's ``metrics.csv``, so curves of a resumed run keep their history."""
