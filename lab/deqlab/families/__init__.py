"""The laboratory's file of each model family, keyed by the family's name: ``deqlab/families/<name>.py`` holds
the family's benchmark section (``section(settings, device)``) and its study evaluation (``evaluate``), or one of
them. The family itself is declared in the library (:mod:`deqscore.families`); a family without a file here has no
benchmark section and no study evaluation.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def family_file(name: str) -> ModuleType | None:
    """The laboratory file of family ``name``, or None where it has none."""
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as err:
        if err.name == f"{__name__}.{name}":
            return None
        raise
