"""Writing files so that a file under its final name is always complete.

>>> import tempfile, pathlib
>>> final = pathlib.Path(tempfile.mkdtemp()) / "report.json"
>>> with staged([final]) as (tmp,):
...     _ = tmp.write_text("{}")
>>> final.read_text()
'{}'
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged(finals: Sequence[Path]) -> Iterator[list[Path]]:
    """Temporary names next to ``finals`` (same folder and suffix: the rename is atomic and writers that add a
    suffix keep it), renamed onto them when the block completes and removed otherwise."""
    temps = [f.with_name(f".{f.stem}.partial.{os.getpid()}{f.suffix}") for f in finals]
    try:
        yield temps
    except BaseException:
        for temp in temps:
            temp.unlink(missing_ok=True)
        raise
    for temp, final in zip(temps, finals, strict=True):
        os.replace(temp, final)
