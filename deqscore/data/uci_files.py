"""The three UCI files of the DKEF benchmarks: their names, origin, SHA-256 and layout (:data:`UCI_FILES`), a
checked reader (:func:`read_uci_table`) and the download (:func:`download_file`, written whole or not at all)."""

from __future__ import annotations

import csv
import hashlib
import io
import math
import shutil
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from deqscore.data.errors import CorruptDataError
from deqscore.files import staged

__all__ = ["DOWNLOAD_TIMEOUT_S", "UCI_FILES", "UCIFile", "download_file", "read_uci_table"]

DOWNLOAD_TIMEOUT_S = 60.0
_UCI_BASE = "https://archive.ics.uci.edu/ml/machine-learning-databases"


@dataclass(frozen=True)
class UCIFile:
    """One UCI data file: its name, where to download it, the SHA-256 of the original and its layout."""

    name: str
    url: str
    sha256: str
    delimiter: str
    n_columns: int


UCI_FILES: dict[str, UCIFile] = {
    "redwine": UCIFile(
        "winequality-red.csv",
        f"{_UCI_BASE}/wine-quality/winequality-red.csv",
        "4a402cf041b025d4566d954c3b9ba8635a3a8a01e039005d97d6a710278cf05e",
        ";",
        12,
    ),
    "whitewine": UCIFile(
        "winequality-white.csv",
        f"{_UCI_BASE}/wine-quality/winequality-white.csv",
        "76c3f809815c17c07212622f776311faeb31e87610d52c26d87d6e361b169836",
        ";",
        12,
    ),
    "parkinsons": UCIFile(
        "parkinsons_updrs.data",
        f"{_UCI_BASE}/parkinsons/telemonitoring/parkinsons_updrs.data",
        "f2c7d5025dec4e92e7feae367a5f7ccf58789a10ac6b54bdf15976c599f9dd39",
        ",",
        22,
    ),
}


# -- reading and downloading -------------------------------------------------------------------------------


def read_uci_table(path: str | Path, spec: UCIFile) -> tuple[list[str], np.ndarray]:
    """``(header names, float64 values [N, n_columns])`` of a UCI file, checked.

    Warns when the SHA-256 differs from ``spec.sha256``; raises :class:`CorruptDataError` (naming the file and
    the problem) when the file cannot be decoded, has a row with the wrong number of columns, a non-numeric or
    non-finite value, or no data rows.
    """
    path = Path(path)
    raw = path.read_bytes()
    found = hashlib.sha256(raw).hexdigest()
    if found != spec.sha256:
        warnings.warn(
            f"{path}: SHA-256 {found} differs from that of the original UCI file {spec.name} "
            f"(expected {spec.sha256}); using it anyway as long as it parses",
            stacklevel=2,
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptDataError(f"{path}: not UTF-8 text ({exc})") from exc
    reader = csv.reader(io.StringIO(text), delimiter=spec.delimiter)
    rows = [(reader.line_num, row) for row in reader if row]  # blank lines are skipped
    if not rows:
        raise CorruptDataError(f"{path}: empty file (expected a header and rows of {spec.n_columns} columns)")
    header = [name.strip() for name in rows[0][1]]
    _check_width(path, header, rows[0][0], spec)
    if len(rows) == 1:
        raise CorruptDataError(f"{path}: no data rows after the header")
    values = np.array([_parse_row(path, row, line, spec) for line, row in rows[1:]])
    return header, values


def _check_width(path: Path, row: list[str], line: int, spec: UCIFile) -> None:
    if len(row) != spec.n_columns:
        raise CorruptDataError(
            f"{path}: line {line} has {len(row)} columns, expected {spec.n_columns} separated by {spec.delimiter!r}"
        )


def _parse_row(path: Path, row: list[str], line: int, spec: UCIFile) -> list[float]:
    _check_width(path, row, line, spec)
    values = []
    for column, field in enumerate(row):
        try:
            value = float(field)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise CorruptDataError(f"{path}: line {line}, column {column + 1}: {field!r} is not a finite number")
        values.append(value)
    return values


def _open_url(url: str, timeout: float):
    """``urllib.request.urlopen`` (the one place that touches the network; tests replace it)."""
    return urllib.request.urlopen(url, timeout=timeout)


def download_file(url: str, dest: str | Path, timeout: float = DOWNLOAD_TIMEOUT_S) -> None:
    """Download ``url`` to ``dest`` through a temporary file in the same folder, renamed when complete (an
    interrupted download leaves nothing behind). Network errors propagate (``OSError``/``URLError``)."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with staged([dest]) as (tmp,), _open_url(url, timeout) as response, open(tmp, "wb") as out:
        shutil.copyfileobj(response, out)


# -- pre-processing ----------------------------------------------------------------------------------------
