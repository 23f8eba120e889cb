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
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged(finals: Sequence[Path]) -> Iterator[list[Path]]:
    """Temporary names next to ``finals`` (same folder and suffix: the rename is atomic and writers that add a
    suffix keep it), renamed onto them when the block completes and removed otherwise. A temporary name may be
    written as a file or as a folder (a folder replaces only an absent or empty final folder)."""
    temps = [Path(f).with_name(f".{Path(f).stem}.partial.{os.getpid()}{Path(f).suffix}") for f in finals]
    for temp in temps:  # left by an earlier process of the same id
        _remove(temp)
    try:
        yield temps
    except BaseException:
        for temp in temps:
            _remove(temp)
        raise
    for temp, final in zip(temps, finals, strict=True):
        os.replace(temp, final)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def nearest_existing(path: Path) -> Path:
    """``path`` itself or its closest ancestor that exists (a file, a directory or a dangling link)."""
    path = path.absolute()
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def unwritable(path: Path) -> tuple[Path, str] | None:
    """Why files cannot be created in the directory ``path`` (existing or still to be made): its nearest existing
    ancestor and the reason (``"not a directory"`` or the error of a trial file), or None when they can. A trial
    file is made because root passes every permission check."""
    existing = nearest_existing(path)
    if not existing.is_dir():
        return existing, "not a directory"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        return existing, str(err.strerror or err)
    return None
