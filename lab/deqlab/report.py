"""The laboratory's one result format: every program's summary document is a :class:`Result`, written by
:func:`write_result` as ``<stem>.json`` and ``<stem>.md`` and read back by :func:`read_result`.

A result is a title, header lines (the environment: device, torch, threads, date, code commit, and the command),
notes, the exact settings, named tables (:class:`Table`) and plots beside the files. The markdown page is rendered
from the JSON document as it reads back (:func:`result_markdown`), so both files hold the same numbers, and a
committed page can be written again from its JSON alone.

>>> import tempfile
>>> out = Path(tempfile.mkdtemp())
>>> table = Table("t", "Two rows", [Column("n", "n"), Column("x", "x", ".2f")], [{"n": 1, "x": 0.125}])
>>> doc = write_result(out, "demo", Result("Demo", {"device": "cpu", "date": "today"}, {}, [table]))
>>> read_result(out / "demo.json")["sections"]["t"]["rows"]
[{'n': 1, 'x': 0.125}]
>>> print((out / "demo.md").read_text().splitlines()[-1])
| 1 | 0.12 |
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

FORMAT = 1  # the version of the result document; a reader refuses any other
HEADER_KEYS = ("device", "date")  # the header lines every result states


@dataclass
class Column:
    """A table column: row key, header text and a format spec for numbers (``".2f"``)."""

    key: str
    header: str
    fmt: str = ""


@dataclass
class Table:
    """One section of a result: columns, rows (dicts of raw values) and notes."""

    name: str
    title: str
    columns: list[Column]
    rows: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)  # further numbers for the JSON file

    def as_dict(self) -> dict:
        return {
            "title": self.title,
            "columns": [{"key": c.key, "header": c.header, "fmt": c.fmt} for c in self.columns],
            "rows": self.rows,
            "notes": self.notes,
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, name: str, section: dict) -> Table:
        """The table of a result document's section (the inverse of :meth:`as_dict`)."""
        columns = [Column(c["key"], c["header"], c["fmt"]) for c in section["columns"]]
        return cls(name, section["title"], columns, section["rows"], section["notes"], section["meta"])


@dataclass
class Result:
    """A program's summary: what :func:`write_result` writes."""

    title: str
    header: dict  # environment and run lines (a value may be any JSON value)
    settings: dict  # the exact settings of the run
    tables: list[Table]
    plots: list[str] = field(default_factory=list)  # image files beside the result, shown at the page's end
    notes: list[str] = field(default_factory=list)  # paragraphs between the header and the settings

    def as_dict(self) -> dict:
        return {"format": FORMAT, "title": self.title, "header": self.header, "notes": self.notes,
                "settings": self.settings, "sections": {t.name: t.as_dict() for t in self.tables},
                "plots": self.plots}


class ResultFormatError(ValueError):
    """A file that is not a result document of :data:`FORMAT` (the message names the file)."""


def ratio_cells(row: dict, ref: dict, keys: tuple[str, ...]) -> dict[str, str | None]:
    """``row[k] / ref[k]`` as ``"0.123x"`` for each key, None where either figure is missing or zero."""
    return {k: f"{row[k] / ref[k]:.3f}x" if row.get(k) and ref.get(k) else None for k in keys}


def fmt_value(value: object, spec: str = "") -> str:
    """Cell text: ``-`` for missing, yes/no for booleans, ``spec`` for numbers."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (int, float)) and spec:
        return format(value, spec)
    return str(value)


def pipe_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    r"""The lines of a markdown pipe table: the header, the separator, one line per row. Cells are text as given, a
    ``|`` in one escaped as ``\|`` (``||W||`` would split the cell) and an empty one rendered as ``| |``; a row of
    another width than the header is refused (ValueError naming it).

    >>> pipe_table(["a", "|w|"], [["1", ""]])
    ['| a | \\|w\\| |', '|---|---|', '| 1 | |']
    """
    for number, row in enumerate(rows, 1):
        if len(row) != len(headers):
            raise ValueError(f"pipe table row {number} has {len(row)} cells for {len(headers)} columns "
                             f"({', '.join(headers)}): {row}")

    def line(cells: list[str]) -> str:
        escaped = (cell.replace("|", r"\|") for cell in cells)
        return "|" + "|".join(f" {cell} " if cell else " " for cell in escaped) + "|"

    return [line(headers), "|" + "---|" * len(headers), *map(line, rows)]


def table_markdown(table: Table) -> str:
    """The table as a markdown pipe table, notes below."""
    lines = [f"## {table.title}", ""]
    if table.columns:
        lines += pipe_table([c.header for c in table.columns],
                            [[fmt_value(row.get(c.key), c.fmt) for c in table.columns] for row in table.rows])
    if table.notes:
        lines.append("")
        lines.extend(f"* {note}" for note in table.notes)
    return "\n".join(lines) + "\n"


def result_markdown(doc: dict) -> str:
    """The markdown page of a result document: title, header lines, notes, settings, tables, plots."""
    lines = [f"# {doc['title']}", ""]
    lines.extend(f"* **{key}**: {value}" for key, value in doc["header"].items())
    lines.append("")
    for note in doc["notes"]:
        lines += [note, ""]
    if doc["settings"]:
        lines += ["Settings:", "", "```json", json.dumps(doc["settings"], indent=1), "```", ""]
    lines += [table_markdown(Table.from_dict(name, section)) for name, section in doc["sections"].items()]
    lines += [f"![{p}]({p})" for p in doc["plots"]]
    return "\n".join(lines).rstrip("\n") + "\n"


def write_result(out_dir: Path, stem: str, result: Result) -> dict:
    """Write ``<stem>.json`` and ``<stem>.md`` under ``out_dir``; return the document as it reads back. The page is
    rendered from that document, not from the objects given: what the JSON holds is what the page shows."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result.as_dict(), indent=1, default=str) + "\n"
    doc = check_result(json.loads(text), f"{stem}.json")
    (out_dir / f"{stem}.json").write_text(text)
    (out_dir / f"{stem}.md").write_text(result_markdown(doc))
    return doc


def read_result(path: str | Path) -> dict:
    """The result document at ``path``, checked to be of :data:`FORMAT`; :class:`ResultFormatError` (naming the
    file) for one that is not."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ResultFormatError(f"{path}: not a readable JSON file ({err})") from None
    return check_result(doc, str(path))


def check_result(doc: object, where: str) -> dict:
    """``doc`` if it is a result document of :data:`FORMAT`, else :class:`ResultFormatError` naming ``where``."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ResultFormatError(f"{where}: not a result document of format {FORMAT} ({what})")

    need(isinstance(doc, dict), "not a JSON object")
    assert isinstance(doc, dict)
    need(doc.get("format") == FORMAT, f"format {doc.get('format')!r}")
    keys = {"format", "title", "header", "notes", "settings", "sections", "plots"}
    need(set(doc) == keys, f"keys {sorted(set(doc) ^ keys)} differ")
    need(isinstance(doc["title"], str) and isinstance(doc["settings"], dict), "title or settings")
    need(isinstance(doc["header"], dict) and all(k in doc["header"] for k in HEADER_KEYS),
         f"header without {', '.join(HEADER_KEYS)}")
    need(all(isinstance(x, str) for x in [*doc["notes"], *doc["plots"]]), "notes and plots are strings")
    need(isinstance(doc["sections"], dict), "sections")
    for name, section in doc["sections"].items():
        need(isinstance(section, dict) and set(section) == {"title", "columns", "rows", "notes", "meta"},
             f"section {name!r}")
        need(all(isinstance(c, dict) and set(c) == {"key", "header", "fmt"} for c in section["columns"]),
             f"section {name!r}'s columns")
        need(all(isinstance(r, dict) for r in section["rows"]), f"section {name!r}'s rows")
    return doc


def section_rows(doc: dict, name: str) -> list[dict]:
    """The rows of section ``name`` of a result document ([] where it has none)."""
    return doc["sections"].get(name, {}).get("rows", [])
