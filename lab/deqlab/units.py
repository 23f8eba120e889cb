"""Recorded units of long benchmark runs. A unit's result is written whole when it is done and read back instead
of computed again while the settings it was recorded with are the same, so an interrupted run continues where it
stopped (a unit recorded with other settings is computed again and replaces it). Below, the second call reads the
first one's value back: ``1 / 0`` is never run.

>>> import tempfile
>>> path = Path(tempfile.mkdtemp()) / "unit.json"
>>> recorded(path, {"steps": 3}, lambda: [1, 2])
[1, 2]
>>> recorded(path, {"steps": 3}, lambda: 1 / 0)  # doctest: +ELLIPSIS
[bench] recorded earlier: .../unit.json
[1, 2]
>>> mean_stderr([1.0, 2.0, 3.0])
(2.0, 0.5773502691896257)
>>> repo_relative(f"--data.init_args.root={ROOT / 'datasets' / 'uci'}")
'--data.init_args.root=<repo>/datasets/uci'
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from deqscore.families import ROOT
from deqscore.files import staged

from .measure import log


def recorded(path: Path, settings: dict, compute: Callable[[], Any], still_holds: Callable[[dict], bool] | None = None,
             timed: bool = False, **facts: Any) -> Any:
    """``compute()``, or the value recorded at ``path`` with the same ``settings`` (or, given ``still_holds``, one
    whose recorded unit it accepts); a computed value is written (atomically) with its settings and ``facts`` (e.g.
    the device), and with ``timed`` its start and end (UTC, ISO 8601)."""
    settings = json.loads(json.dumps(settings))  # as it reads back (tuples become lists)
    if path.exists():
        saved = json.loads(path.read_text())
        if saved.get("settings") == settings if still_holds is None else still_holds(saved):
            log(f"recorded earlier: {path}")
            return saved["value"]
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    value = compute()
    if timed:
        facts |= {"started": started, "ended": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    path.parent.mkdir(parents=True, exist_ok=True)
    with staged([path]) as (tmp,):
        tmp.write_text(json.dumps({**facts, "settings": settings, "value": value}, indent=1))
    return value


def mean_stderr(values: Sequence[float]) -> tuple[float, float | None]:
    """The mean and its standard error (None for a single value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def repo_relative(text: str) -> str:
    """``text`` with this checkout's path written ``<repo>``, so that what a unit records agrees between clones."""
    return text.replace(str(ROOT), "<repo>")
